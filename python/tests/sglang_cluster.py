"""Two SGLang 0.5.23 instances on two kvtier daemons that share one Mooncake Store.

Run by tests/sglang_cluster.rs with daemon A's and daemon B's sockets as argv[1] and
argv[2] (both `kvtier serve --pool-kind mooncake` on one master), in the SGLang venv with the
source package on PYTHONPATH. SGLang's own StorageBackendFactory creates KvtierStorage
for instance A on daemon A and for instance B on daemon B, each over SGLang's own
MHATokenToKVPoolHost on CPU. A stores pages with batch_set_v1, which shares them to A's
pool; B's daemon has never seen them, so B's batch_exists reports them only through the
pool, and B's batch_get_v1 fills B's host pool with A's bytes, every element compared.
Prints the page hashes (hex) it stored, for the test to ask the daemons about.
"""

import hashlib
import sys
import time

import torch

from sglang_support import PAGE, indices, page, storage

SOCKET_A, SOCKET_B = sys.argv[1], sys.argv[2]
PAGES = 6


def until(what, f, limit=60.0):
    """Polls f() until it is true: A's share copies to the store in the background."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        v = f()
        if v:
            return v
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


sa, ha = storage(SOCKET_A, "sglang-a", "tiny/model")
sb, hb = storage(SOCKET_B, "sglang-b", "tiny/model")
g = torch.Generator().manual_seed(11)
ha.kv_buffer.copy_(torch.randn(ha.kv_buffer.shape, generator=g).to(torch.float16))
keys = [hashlib.sha256(f"cluster-page-{i}".encode()).hexdigest() for i in range(PAGES)]
missing = hashlib.sha256(b"never stored anywhere").hexdigest()
assert sb.batch_exists(keys) == 0, "B knows nothing before A stores"
src = [7, 1, 12, 3, 0, 9]
assert sa.batch_set_v1(keys, indices(src)) == [True] * PAGES
assert sa.batch_exists(keys) == PAGES
print(f"OK instance A stored {PAGES} pages on daemon A")
print("HASHES " + ",".join(keys))

# B's daemon learns of the pages only from the store, once A's share has landed there.
until("B to find A's pages in the pool", lambda: sb.batch_exists(keys) == PAGES)
assert sb.batch_exists(keys + [missing]) == PAGES
assert sb.batch_exists([missing] + keys) == 0
assert not sb.exists(missing)
print(f"OK daemon B finds {PAGES} of them in the shared pool; a page never stored is a miss")

before = hb.kv_buffer.clone()
dst = [2, 10, 5, 14, 8, 11]
assert sb.batch_get_v1(keys + [missing], indices(dst + [13])) == [True] * PAGES + [False]
checked = 0
for s, d in zip(src, dst):
    got, want = page(hb, d), page(ha, s)
    assert torch.equal(got, want), (s, d, int((got != want).sum()))
    checked += got.numel()
for p in range(hb.size // PAGE):
    if p not in dst:
        assert torch.equal(page(hb, p), before[:, :, p * PAGE:(p + 1) * PAGE]), p
print(f"OK instance B loaded {PAGES} pages into its host pool: {checked} elements equal, other pages untouched")
sa.close()
sb.close()
print("OK done")
