"""kvtier as an SGLang HiCache storage backend (the shape of ``HiCacheStorage``).

HiCache moves pages between its host pool and a storage backend by string keys; the
backend answers ``batch_exists`` with the number of leading keys present (HiCache only
ever uses a consecutive prefix), and copies pages in and out of host-pool indices
(``batch_get_v1`` / ``batch_set_v1``). SGLang's dynamic backend option can load such a
class by module path and class name::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtier", "module_path": "hicache_backend", "class_name": "KvtierHiCacheStorage",
        "socket": "/run/kvtier.sock", "lib": "/path/libkvtier.so"}'

Here the host pool is kvtier's emulated device region (one slot per host page), so the
example runs without SGLang or torch; with SGLang, the host indices would address the
HiCache host pool registered as the device region. Run ``python3 hicache_backend.py
--socket ... --lib ...`` for a self-check that prints ``OK ...``.
"""

import argparse
import hashlib
import sys

import kvtier_ctypes as kv


class KvtierHiCacheStorage:
    """The HiCacheStorage methods HiCache calls, over one kvtier client rank."""

    def __init__(self, storage_config=None, kwargs=None):
        cfg = dict(kwargs or {})
        self.page_size = int(cfg.get("page_size", 4))
        tp_rank = getattr(storage_config, "tp_rank", 0) if storage_config is not None else 0
        tp_size = getattr(storage_config, "tp_size", 1) if storage_config is not None else 1
        lib = kv.load_library(cfg.get("lib"))
        self.client = kv.Client(lib, cfg["socket"], cfg.get("instance", "hicache"), cfg.get("model", "hicache-model"),
                                tp_rank=tp_rank, tp_size=tp_size, layout=(4, 4, 16, 2, self.page_size))
        self.client.register_emulated(int(cfg.get("host_pages", 64)))

    @staticmethod
    def _hash(key):
        # HiCache keys are hex SHA-256 page hashes; other strings are hashed to 32 bytes.
        try:
            raw = bytes.fromhex(key)
            if 8 <= len(raw) <= 32:
                return raw
        except ValueError:
            pass
        return hashlib.sha256(key.encode()).digest()

    def batch_exists(self, keys, extra_info=None):
        """How many leading keys are complete in kvtier (host or nearer)."""
        if not keys:
            return 0
        device, host, _pool = self.client.lookup([self._hash(k) for k in keys])
        return device + host

    def exists(self, key):
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        """Stores the pages at ``host_indices``; one bool per key."""
        if len(keys) != len(host_indices):
            raise ValueError("one host index per key")
        if not keys:
            return []
        ticket, _, _ = self.client.store([self._hash(k) for k in keys], list(host_indices))
        complete, _total, _failed = self.client.wait(ticket, 5000)
        return [i < complete for i in range(len(keys))]

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        """Loads the leading pages present into ``host_indices``; one bool per key."""
        if len(keys) != len(host_indices):
            raise ValueError("one host index per key")
        if not keys:
            return []
        loaded = self.client.load([self._hash(k) for k in keys], list(host_indices), kv.LOAD_BEST_EFFORT)
        return [i < loaded for i in range(len(keys))]

    def clear(self):
        """HiCache calls this on reset; kvtier's pages outlive one engine, so nothing to do."""

    def close(self):
        self.client.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--lib")
    args = ap.parse_args()
    store = KvtierHiCacheStorage(None, {"socket": args.socket, "lib": args.lib, "host_pages": 64})
    c = store.client
    obj = c.object_bytes()
    keys = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(5)]
    assert store.batch_exists(keys) == 0, "cold storage reports hits"
    for idx, key in enumerate(keys[:4]):
        c.write_object(idx, kv.PART_K, hashlib.sha256((key + "k").encode()).digest() * (obj // 32))
        c.write_object(idx, kv.PART_V, hashlib.sha256((key + "v").encode()).digest() * (obj // 32))
    assert store.batch_set_v1(keys[:4], [0, 1, 2, 3]) == [True] * 4
    # The fifth key was never set, so the consecutive hit prefix is four.
    hits = store.batch_exists(keys)
    assert hits == 4, f"batch_exists = {hits}"
    got = store.batch_get_v1(keys, [40, 41, 42, 43, 44])
    assert got == [True, True, True, True, False], got
    for idx, key in enumerate(keys[:4]):
        assert c.read_object(40 + idx, kv.PART_K) == hashlib.sha256((key + "k").encode()).digest() * (obj // 32)
        assert c.read_object(40 + idx, kv.PART_V) == hashlib.sha256((key + "v").encode()).digest() * (obj // 32)
    store.close()
    print(f"OK hicache exists={hits} bytes_checked={4 * 2 * obj}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
