"""kvtier.sglang.KvtierStorage inside SGLang 0.5.23's own code, on CPU, against a real daemon.

Run by tests/engines_sglang.rs with the daemon's socket as argv[1], in the SGLang venv with
the source package on PYTHONPATH. SGLang's StorageBackendFactory builds the backend through
its dynamic backend from the extra config; SGLang's own MHATokenToKVPoolHost (over a CPU
MHATokenToKVPool, as SGLang's storage unit tests build it) is registered as the memory
kvtier copies into and out of. Engine 1 stores pages with batch_set_v1; engine 2, another
backend with its own host pool on the same daemon, finds them with batch_exists and loads
them with batch_get_v1 into other host slots; every element is compared. A batch stored
with a session id in HiCacheStorageExtraInfo.extra_info (as SGLang's Mooncake linker passes
it) is tagged with that session; the test reads the daemon's session table.
"""

import hashlib
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo

import kvtier
import kvtier.sglang
from sglang_support import PAGE, indices, page, storage

SOCKET = sys.argv[1]


s1, h1 = storage(SOCKET, "sglang-1", "tiny")
g = torch.Generator().manual_seed(7)
h1.kv_buffer.copy_(torch.randn(h1.kv_buffer.shape, generator=g).to(torch.float16))
keys = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(5)]
missing = hashlib.sha256(b"never stored").hexdigest()
assert s1.batch_exists(keys) == 0
assert s1.batch_set_v1(keys[:4], indices([3, 0, 6, 1])) == [True] * 4
assert s1.batch_exists(keys[:4] + [missing]) == 4
assert s1.batch_exists([missing] + keys[:4]) == 0
assert s1.exists(keys[2]) and not s1.exists(keys[4])
print("OK engine 1 stored 4 pages; batch_exists counts the leading hits")

s2, h2 = storage(SOCKET, "sglang-2", "tiny")
assert s2.batch_exists(keys[:4]) == 4
before = h2.kv_buffer.clone()
assert s2.batch_get_v1(keys[:4] + [missing], indices([9, 2, 5, 11, 12])) == [True] * 4 + [False]
checked = 0
for src, dst in [(3, 9), (0, 2), (6, 5), (1, 11)]:
    assert torch.equal(page(h2, dst), page(h1, src)), (src, dst)
    checked += page(h2, dst).numel()
touched = {9, 2, 5, 11}
for p in range(h2.size // PAGE):
    if p not in touched:
        assert torch.equal(page(h2, p), before[:, :, p * PAGE:(p + 1) * PAGE]), p
print(f"OK engine 2 loaded 4 pages into its host pool: {checked} elements equal, other pages untouched")

# Bad input: indices off page boundaries or of the wrong count fail those keys, and the
# backend keeps serving.
assert s2.batch_get_v1(keys[:1], torch.arange(1, 1 + PAGE)) == [False]
assert s2.batch_set_v1(keys[:2], indices([0])) == [False, False]
try:
    kvtier.sglang.KvtierStorage(HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="tiny",
        extra_config={"sokcet": SOCKET}))
    raise SystemExit("an unknown extra config key was accepted")
except ValueError as e:
    assert "sokcet" in str(e) and "socket" in str(e), e
try:
    kvtier.sglang.KvtierStorage(HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="tiny",
        extra_config={"socket": SOCKET, "share": "yes"}))
    raise SystemExit("a non-boolean share was accepted")
except ValueError as e:
    assert "share" in str(e) and "true or false" in str(e), e
assert s2.batch_get_v1(keys[3:4], indices([0])) == [True]
assert torch.equal(page(h2, 0), page(h1, 1))
print("OK misaligned indices and unknown config keys refused; the backend keeps serving")

# The legacy flat-page API through SGLang's own page accessors.
assert s1.set(keys[4], h1.get_data_page(8 * PAGE))
flat = h2.get_dummy_flat_data_page()
assert s2.get(keys[4], flat) is flat
assert torch.equal(flat, h1.get_data_page(8 * PAGE)), "legacy get"
assert s2.batch_get([missing], [h2.get_dummy_flat_data_page()]) == [None]
print("OK legacy set/get round trip")

session_keys = [hashlib.sha256(f"session-{i}".encode()).hexdigest() for i in range(2)]
info = HiCacheStorageExtraInfo(prefix_keys=keys[:4], extra_info={"session_id": "sg-session"})
assert s1.batch_set_v1(session_keys, indices([12, 13]), info) == [True, True]
assert s2.batch_exists(session_keys) == 2
print("OK a batch stored with a session id in extra_info")
s1.close()
s2.close()
s1.close()
print("OK done")
