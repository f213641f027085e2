"""On a machine with an NVIDIA GPU: the `kvtier` Python package with PyTorch CUDA tensors,
against a real `kvtier serve`, on the real driver.

Three forms of vLLM's KV cache, each a model of its own (a layout is part of a page's
identity) with a writer and a reader client:

* split K and V, ``[2, blocks, block_size, heads, head_dim]`` per layer, registered with
  ``kvtier.tensors.register``;
* packed K|V, ``[blocks, heads, block_size, 2 x head_dim]`` per layer (one run a block);
* packed K|V with heads outside blocks (a run per head, copied as 2-D copies).

For each: a writer fills its tensors on a side stream and stores pages without
synchronizing (kvtier must wait on the stream it was given), a reader with zeroed tensors
loads them into other blocks, and every loaded block is compared with the written one on
the GPU; blocks not loaded into stay zero. Prints ``OK ...`` lines; exits non-zero on any
difference.

Usage: python3 scripts/gpu-tensors.py <kvtier binary> [--cpu]   (PYTHONPATH at the package
and KVTIER_LIB at a libkvtier.so built with the `cuda` feature; scripts/gpu-check.sh sets
both). ``--cpu`` runs the same checks on host tensors, to try the script on a machine
without a GPU.
"""

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvtier
import kvtier.tensors

cpu = "--cpu" in sys.argv[2:]
if not cpu and not torch.cuda.is_available():
    print("SKIPPED: torch sees no CUDA device", file=sys.stderr)
    sys.exit(1)

LAYERS, HEADS, DIM, TOKENS, BLOCKS = 4, 8, 128, 16, 64
OBJECT = LAYERS * TOKENS * HEADS * DIM * 2  # one part of one page, fp16
dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
name = "host tensors (--cpu)" if cpu else torch.cuda.get_device_name(dev)
print(f"gpu-tensors: {name}, torch {torch.__version__}, kvtier {kvtier.__version__}")


def side_stream():
    """A stream other than the current one, and its handle (host tensors: none, 0)."""
    if cpu:
        return contextlib.nullcontext(), 0
    s = torch.cuda.Stream(dev)
    return torch.cuda.stream(s), s.cuda_stream


def current_stream():
    return 0 if cpu else torch.cuda.current_stream(dev).cuda_stream


def synchronize():
    if not cpu:
        torch.cuda.synchronize(dev)

# The arena on tmpfs: Linux lets no driver pin a shared mapping of a file on a disk.
work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
sock = work / "kvtier.sock"
log = open(work / "daemon.log", "wb")
daemon = subprocess.Popen(
    [sys.argv[1], "serve", "--socket", str(sock), "--host-path", str(work / "arena"), "--host-bytes", str(256 << 20),
     "--set", "host.lock=false", "--set", "host.prefault=false", "--set", f"host.slot_bytes={OBJECT}",
     "--set", "pool.bytes=8388608", "--set", f"admin.socket={work / 'admin.sock'}"],
    stdout=subprocess.DEVNULL, stderr=log)


def connected(layout, name, model):
    deadline = time.monotonic() + 20
    while True:
        try:
            return kvtier.Client(layout, socket=str(sock), instance=name, model=model)
        except kvtier.UnavailableError:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not serve {sock}: {(work / 'daemon.log').read_text()}")
            time.sleep(0.02)


def check(name, layout, make, register, block_view):
    """``make()`` gives the layer tensors; ``register(client, tensors, stream)`` registers
    them; ``block_view(tensors, b)`` is block ``b``'s bytes of every layer, as one tensor."""
    side, side_handle = side_stream()
    src = make()
    gen = torch.Generator(device=dev).manual_seed(7)
    with side:
        for t in src:
            t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, generator=gen, device=dev,
                                                    dtype=torch.int16))
    hashes = [0x5000 + i for i in range(16)]
    written = [(i * 5 + 3) % BLOCKS for i in range(16)]
    into = [(i * 7 + 1) % BLOCKS for i in range(16)]
    with connected(layout, f"{name}-writer", name) as w:
        register(w, src, side_handle)
        # No synchronize: the store's copies must follow the fill on `side`.
        receipt = w.store(hashes, written, session=name)
        status = w.wait(receipt.ticket, 10000)
        assert status.complete == 16 and status.failed == 0, (name, status)
        w.removed(hashes)  # the writer's blocks are not where the reader finds them
    dst = make()
    with connected(layout, f"{name}-reader", name) as r:
        register(r, dst, current_stream())
        assert sum(r.lookup(hashes)) == 16, (name, r.lookup(hashes))
        assert r.load(hashes, into) == 16, name
    synchronize()
    # Compared as integers: random bits hold NaNs, which never equal themselves as floats.
    def bits(ts, b):
        return block_view(ts, b).view(torch.int16)

    for s, d in zip(written, into):
        assert torch.equal(bits(dst, d), bits(src, s)), f"{name}: block {s} loaded into {d} differs"
    untouched = sorted(set(range(BLOCKS)) - set(into))
    for b in untouched:
        assert not bits(dst, b).any(), f"{name}: block {b} was never loaded into but is not zero"
    print(f"OK {name}: 16 pages of {2 * OBJECT >> 10} KiB from {dev.type} tensors stored and loaded byte for byte; "
          f"{len(untouched)} other blocks untouched")


try:
    # Split K and V: [2, blocks, block_size, heads, head_dim] per layer.
    check("split-nhd", kvtier.Layout(LAYERS, HEADS, DIM, 2, TOKENS, dtype=torch.float16),
          lambda: [torch.zeros(2, BLOCKS, TOKENS, HEADS, DIM, dtype=torch.float16, device=dev)
                   for _ in range(LAYERS)],
          lambda c, ts, st: kvtier.tensors.register(c, [[t[0] for t in ts], [t[1] for t in ts]], stream=st),
          lambda ts, b: torch.stack([t[:, b] for t in ts]))

    # Packed K|V, one run a block: [blocks, heads, block_size, 2 x head_dim].
    def packed(c, ts, st):
        ptrs, stride, pages, device, runs, run_stride = kvtier.tensors.packed_views(c.layout, ts, HEADS)
        kvtier.tensors.register_addresses(c, ptrs, stride, pages, device, st, runs, run_stride)

    check("packed-hnd", kvtier.Layout(LAYERS, HEADS, DIM, 2, TOKENS, dtype=torch.float16, kv_order="packed-hnd"),
          lambda: [torch.zeros(BLOCKS, HEADS, TOKENS, 2 * DIM, dtype=torch.float16, device=dev)
                   for _ in range(LAYERS)],
          packed, lambda ts, b: torch.stack([t[b] for t in ts]))

    # Heads outside blocks: [heads, blocks, block_size, 2 x head_dim] seen as vLLM's 4-D
    # view; a block is one run per head.
    check("packed-heads-outside",
          kvtier.Layout(LAYERS, HEADS, DIM, 2, TOKENS, dtype=torch.float16, kv_order="packed-hnd"),
          lambda: [torch.zeros(HEADS, BLOCKS, TOKENS, 2 * DIM, dtype=torch.float16, device=dev).permute(1, 0, 2, 3)
                   for _ in range(LAYERS)],
          packed, lambda ts, b: torch.stack([t[b] for t in ts]))
finally:
    daemon.terminate()
    daemon.wait(timeout=30)
    shutil.rmtree(work, ignore_errors=True)
print("gpu-tensors: passed")
