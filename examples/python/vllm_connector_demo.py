"""A KV connector shaped like vLLM's (KVConnectorBase_V1), backed by kvtier through ctypes.

vLLM asks a connector, on the scheduler side, how many of a request's tokens it can supply
(``get_num_new_matched_tokens``) and, on the worker side, to start loading them
(``start_load_kv``), to wait for them (``wait_for_layer_load``), to save new KV
(``save_kv_layer``, ``wait_for_save``) and finally tells it a request finished
(``request_finished``). This demo keeps that shape with plain arguments (block hashes and
block ids) instead of vLLM's objects, and plays two requests that share a prefix:

    python3 vllm_connector_demo.py --socket /run/kvtier.sock --lib target/debug/libkvtier.so

It prints ``OK ...`` and exits 0 when every byte that came back equals what was saved.
"""

import argparse
import hashlib
import sys

import kvtier_ctypes as kv


class KvtierConnector:
    """One worker rank's connector; ``block_size`` tokens a block (= a kvtier page)."""

    def __init__(self, client, block_size):
        self.client = client
        self.block_size = block_size
        self._pending_load = None
        self._pending_save = []

    # -- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, block_hashes, num_computed_tokens):
        """Tokens beyond ``num_computed_tokens`` kvtier can load, and whether async."""
        if not block_hashes:
            return 0, False
        device, host, pool = self.client.lookup(block_hashes)
        hit_tokens = (device + host) * self.block_size
        return max(0, hit_tokens - num_computed_tokens), False

    # -- worker side ------------------------------------------------------------------
    def start_load_kv(self, block_hashes, block_ids):
        self._pending_load = (list(block_hashes), list(block_ids))

    def wait_for_layer_load(self):
        """Runs the pending load; returns how many blocks arrived."""
        if self._pending_load is None:
            return 0
        hashes, ids = self._pending_load
        self._pending_load = None
        return self.client.load(hashes, ids, kv.LOAD_WAIT_COMPLETE)

    def save_kv_layer(self, block_hashes, block_ids, session=""):
        ticket, _written, _complete = self.client.store(block_hashes, block_ids, session)
        self._pending_save.append((ticket, len(block_hashes)))

    def wait_for_save(self, timeout_ms=5000):
        """Waits until every saved block is complete on host; returns the block count."""
        done = 0
        for ticket, n in self._pending_save:
            complete, total, failed = self.client.wait(ticket, timeout_ms)
            if complete != n or failed:
                raise RuntimeError(f"ticket {ticket}: {complete}/{total} complete, {failed} failed")
            done += complete
        self._pending_save = []
        return done

    def request_finished(self, block_hashes, session=None):
        """The engine frees the request's device blocks; kvtier keeps its host copies."""
        self.client.removed(block_hashes)
        if session:
            self.client.session(session, None, kv.PHASE_ACTING)
        return False, None  # (delay freeing blocks, kv_transfer_params)


def block_bytes(block_hash, part, n):
    """Deterministic bytes of one object of a block (what a model would have computed)."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{block_hash}:{part}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--lib")
    ap.add_argument("--blocks", type=int, default=6)
    args = ap.parse_args()
    lib = kv.load_library(args.lib)
    block_size = 4
    with kv.Client(lib, args.socket, "vllm-demo", "demo-model", layout=(4, 4, 16, 2, block_size)) as c:
        c.register_emulated(64)
        conn = KvtierConnector(c, block_size)
        obj = c.object_bytes()
        prefix = [0xA000 + i for i in range(args.blocks)]

        # Request A: prefill computes every block, the connector saves them.
        assert conn.get_num_new_matched_tokens(prefix, 0) == (0, False), "a cold cache matched tokens"
        for blk, h in enumerate(prefix):
            for part in (kv.PART_K, kv.PART_V):
                c.write_object(blk, part, block_bytes(h, part, obj))
        c.session("req-a", None, kv.PHASE_REASONING)
        conn.save_kv_layer(prefix, list(range(args.blocks)), session="req-a")
        saved = conn.wait_for_save()
        conn.request_finished(prefix, session="req-a")

        # Request B shares A's prefix plus two new blocks: the prefix is matched and loaded
        # into other device blocks.
        req_b = prefix + [0xB000, 0xB001]
        matched, _ = conn.get_num_new_matched_tokens(req_b, 0)
        assert matched == args.blocks * block_size, f"matched {matched} tokens"
        target = list(range(32, 32 + args.blocks))
        conn.start_load_kv(prefix, target)
        loaded = conn.wait_for_layer_load()
        assert loaded == args.blocks, f"loaded {loaded} blocks"
        checked = 0
        for blk, h in zip(target, prefix):
            for part in (kv.PART_K, kv.PART_V):
                got = c.read_object(blk, part)
                assert got == block_bytes(h, part, obj), f"block {h:#x} part {part} differs"
                checked += len(got)
        outcome = c.hint(kv.HINT_RETAIN, session="req-a", target=kv.TARGET_SESSION, priority=5, ttl_ms=1000)
        print(f"OK vllm saved={saved} matched_tokens={matched} bytes_checked={checked} retain={outcome[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
