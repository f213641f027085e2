"""kvtier.sglang.KvtierStorage under SGLang 0.5.23's own HiCacheController, on CPU, against
a real daemon: every host layout KvtierStorage registers (layer_first, page_first,
page_first_direct), for an MHA and an MLA model.

Run by tests/engines_sglang.rs with the daemon's socket as argv[1] (and ``down`` as argv[2]
for the daemon-down case, :func:`down`), in the SGLang venv with
the source package on PYTHONPATH. For each case SGLang's HiCacheController attaches the
dynamic storage backend from its extra config (StorageBackendFactory, interface_v1), over
SGLang's own device pool, token allocator and host pool of that layout. Then, driven the
way SGLang's radix cache drives it:

- write back: ``write_storage`` of 6 host pages, hashed by SGLang's own
  ``get_storage_hash_str``; the backup thread stores them through ``batch_set_v1``;
- evict: ``evict_host`` frees the pages, and the freed host memory is overwritten;
- prefetch: ``prefetch`` of the same tokens; the prefetch thread's ``batch_exists`` finds
  all 6 pages, they get other host pages (as the scheduler allocates them), and the I/O
  thread loads them through ``batch_get_v1``.

Every element of every loaded page is compared with what was written back, and the
objects kvtier holds for a page with SGLang's own flat page of that layout. Pages in one
byte order are loaded by a controller of another host layout with the same order
(layer_first's pages into page_first_direct), and a controller in the other order on the
same model name is refused at attach, so it never reads them as its own.
"""

import hashlib
import logging
import queue
import struct
import sys
import time

import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache import utils as sglang_utils
from sglang.srt.mem_cache.cpp_utils import native_hash
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

import kvtier.sglang

SOCKET = sys.argv[1]
PAGE, HEADS, DIM, LAYERS, LORA, ROPE = 4, 2, 16, 3, 24, 8
TOKENS = 256
N = 6
DEADLINE = 60.0


def extra(instance):
    return {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStorage",
            "interface_v1": 1, "socket": SOCKET, "instance": instance}


def pools(attn, layout):
    """SGLang's device pool, its token allocator and a host pool of `layout` over it."""
    if attn == "mha":
        device = MHATokenToKVPool(TOKENS, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                                  end_layer=LAYERS)
        host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=device.size,
                                    start_layer=0, end_layer=LAYERS)
    else:
        device = MLATokenToKVPool(TOKENS, PAGE, torch.bfloat16, LORA, ROPE, LAYERS, "cpu", False, start_layer=0,
                                  end_layer=LAYERS)
        host = MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=device.size,
                                    start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)
    allocator = TokenToKVPoolAllocator(TOKENS, torch.float16 if attn == "mha" else torch.bfloat16, "cpu", device,
                                       False)
    return allocator, host


def controller(attn, layout, model, instance):
    allocator, host = pools(attn, layout)
    import threading

    c = HiCacheController(allocator, host, PAGE, None, threading.Event(), storage_backend="dynamic",
                          model_name=model, storage_backend_extra_config=extra(instance), prefetch_threshold=PAGE)
    assert isinstance(c.storage_backend, kvtier.sglang.KvtierStorage), type(c.storage_backend)
    return c, host


def take(q, pred, what):
    """The first item of `q` that `pred` accepts, within the deadline."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        try:
            item = q.get(timeout=0.5)
        except queue.Empty:
            continue
        if pred(item):
            return item
    raise SystemExit(f"timed out waiting for {what}")


def pages(host, indices):
    """Each page's data (every part, layer, token) as SGLang's own accessor returns it."""
    return [host.get_data_page(int(indices[i * PAGE]), flat=False).clone() for i in range(len(indices) // PAGE)]


def write_back(c, host, tokens):
    idx = host.alloc(len(tokens))
    g = torch.Generator().manual_seed(len(tokens) + idx[0].item())
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.kv_buffer.dtype))
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    op_id = c.write_storage(idx, tokens, hash_value=hashes)
    op = take(c.ack_backup_queue, lambda o: o.id == op_id, "the backup ack")
    assert op.completed_tokens == len(tokens), (op.completed_tokens, len(tokens))
    flat = host.get_data_page(int(idx[0]), flat=True).clone()
    return idx, pages(host, idx), hashes[0], flat


def evict(c, host, idx):
    freed = c.evict_host(idx)
    assert freed == len(idx), freed
    # The freed host memory is reused: nothing of the written pages survives in it.
    host.kv_buffer.zero_()


def prefetch(c, host, tokens, rid):
    op = c.prefetch(rid, tokens)
    hit = take(c.prefetch_hit_queue, lambda o: o is op, "the storage hit query")
    if hit.storage_hit_count == 0:
        return 0, None
    # The scheduler's part: host pages for the hit, other than the written ones.
    host.alloc(2 * PAGE)
    idx = host.alloc(hit.storage_hit_count)
    op.host_indices = idx
    c.prefetch_buffer.put(op)
    done = take(c.ack_prefetch_queue, lambda a: a.operation is op and a.completed_tokens is not None,
                "the prefetch transfer")
    return done.completed_tokens, idx


def check(loaded, written):
    n = 0
    for i, (a, b) in enumerate(zip(loaded, written)):
        assert torch.equal(a, b), f"page {i} differs"
        n += a.numel()
    return n


def sha256_pages(token_ids, prior_digest, page_size=None):
    """SGLang's page hash for plain token ids (hash_binding.cpp): per page, SHA-256 of the
    previous page's digest and the page's token ids as little-endian u32, in hex."""
    out, prior = [], prior_digest
    for start in range(0, len(token_ids), page_size or len(token_ids)):
        page = token_ids[start:start + (page_size or len(token_ids))]
        h = hashlib.sha256(prior or b"")
        h.update(struct.pack(f"<{len(page)}I", *page))
        prior = h.digest()
        out.append(prior.hex())
    return out if page_size else out[0]


# SGLang builds its page hash as a C++ extension at first use, which needs ninja; where it
# cannot, the same hash in Python keys the pages (for the write-back and the prefetch
# thread's hit query alike).
try:
    native_hash._load_native_hash_module()
    print("NOTE page keys from SGLang's native page hash")
except RuntimeError as e:
    sglang_utils.get_native_hash = sha256_pages
    print(f"NOTE page keys from SGLang's page hash in Python: the native one does not build here ({e.__cause__})")

def down(tokens):
    """The daemon is not running when SGLang attaches the backend: the controller starts
    (the backend logs one warning), write-backs store nothing and prefetches find nothing
    (SGLang computes locally); once the daemon is up (the test starts it when this prints
    ``DAEMON start``) the backend connects and registers the host pool by itself, and a
    write-back, eviction and prefetch round-trips every element."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("kvtier").addHandler(handler)
    c, host = controller("mha", "page_first", "tiny-down", "sg-down")
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no daemon" in warnings[0], warnings
    idx = host.alloc(len(tokens))
    op_id = c.write_storage(idx, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
    op = take(c.ack_backup_queue, lambda o: o.id == op_id, "the backup ack")
    assert op.completed_tokens == 0, op.completed_tokens
    miss, _ = prefetch(c, host, tokens, "down-miss")
    assert miss == 0, miss
    host.free(idx)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    print("OK SGLang's controller started with no daemon: one warning, nothing stored, no hits (computed locally)",
          flush=True)
    print("DAEMON start", flush=True)
    assert sys.stdin.readline().strip() == "ok"
    # The backend connects again at most a second after a failure: write back until the
    # daemon has the pages.
    end = time.monotonic() + DEADLINE
    while True:
        idx = host.alloc(len(tokens))
        g = torch.Generator().manual_seed(7)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.kv_buffer.dtype))
        op_id = c.write_storage(idx, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
        op = take(c.ack_backup_queue, lambda o: o.id == op_id, "the backup ack")
        if op.completed_tokens == len(tokens):
            break
        host.free(idx)
        assert time.monotonic() < end, "the backend never connected to the daemon"
        time.sleep(0.1)
    written = pages(host, idx)
    evict(c, host, idx)
    got, idx2 = prefetch(c, host, tokens, "down-hit")
    assert got == len(tokens), got
    n = check(pages(host, idx2), written)
    print(f"OK the daemon appeared: the backend connected, wrote back, evicted and prefetched {N} pages, "
          f"{n} elements equal", flush=True)
    c.storage_backend.close()


# No distributed state here: one rank, as SGLang's own radix cache test kit sets it.
get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
tokens = list(range(1000, 1000 + N * PAGE))
if sys.argv[2:3] == ["down"]:
    down(tokens)
    print("OK done")
    sys.exit(0)
for attn in ("mha", "mla"):
    for layout in kvtier.sglang.HOST_LAYOUTS:
        model = f"tiny-{attn}-{layout}"
        c, host = controller(attn, layout, model, f"sg-{attn}-{layout}")
        idx, written, first, flat = write_back(c, host, tokens)
        evict(c, host, idx)
        assert all(not torch.equal(p, w) for p, w in zip(pages(host, idx), written)), "eviction kept the bytes"
        got, idx2 = prefetch(c, host, tokens, f"{attn}-{layout}")
        assert got == N * PAGE, got
        assert not torch.equal(idx2, idx)
        n = check(pages(host, idx2), written)
        # The objects kvtier holds are SGLang's own flat page of this layout, byte for byte
        # (K then V, or the latent, each in the layout's order), read back through the
        # backend's flat-page API.
        got_flat = c.storage_backend.get(first, host.get_dummy_flat_data_page())
        assert got_flat is not None and torch.equal(got_flat, flat), "object bytes are not SGLang's page"
        miss, _ = prefetch(c, host, [7] * (2 * PAGE), f"{attn}-{layout}-miss")
        assert miss == 0, miss
        print(f"OK {attn} {layout}: wrote back, evicted and prefetched {N} pages, {n} elements equal")
        c.storage_backend.close()

# One byte order, two host layouts: layer_first's pages load into page_first_direct.
c1, h1 = controller("mha", "layer_first", "tiny-shared", "sg-lf")
_, written, _, _ = write_back(c1, h1, tokens)
c2, h2 = controller("mha", "page_first_direct", "tiny-shared", "sg-pfd")
got, idx2 = prefetch(c2, h2, tokens, "shared")
assert got == N * PAGE, got
# page_first_direct pages come back as [2, 1, layers, page, heads, dim]; layer_first's as
# [2, layers, page, heads, dim]: the same elements.
n = check([p.reshape(w.shape) for p, w in zip(pages(h2, idx2), written)], written)
print(f"OK layer_first pages loaded into a page_first_direct host pool: {n} elements equal")
# The other order on the same model name: refused at attach, never loaded.
try:
    controller("mha", "page_first", "tiny-shared", "sg-pf")
    raise SystemExit("a page_first host pool registered over layer-first pages")
except Exception as e:  # noqa: BLE001 - SGLang wraps the backend's error
    text = f"{e} {e.__cause__}"
    assert "layout" in text, text
    print("OK a page_first pool on the layer-first model name is refused")
c1.storage_backend.close()
c2.storage_backend.close()
print("OK done")
