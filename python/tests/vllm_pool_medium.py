"""Decodes kvtier's KV events with vLLM 0.33's own msgspec types and reports each event's
medium and locality, for tests/vllm_pool_medium.rs.

Usage: vllm_pool_medium.py <PUB endpoint>

Subscribes, prints "ready", then reads one command per stdin line. `join <ms>` waits up to
<ms> for any batch (a SUB socket receives nothing published before its subscription has
reached the publisher) and prints "joined", dropping what it received, or "again" when
none came: the test publishes a probe page's event until one arrives. `collect <n>` receives
live batches until <n> BlockStored events of pool pages (medium STORAGE) have arrived in
all, then prints every event received so far as one JSON line: a list of
{type, block_hashes, medium, locality}. Every payload goes through
`msgspec.msgpack.Decoder(KVEventBatch)`, so a batch vLLM's types refuse raises and the
process exits non-zero.
"""

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVEventBatch


def main():
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 30000)
    sub.connect(sys.argv[1])
    seen = []
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, n = line.split()
        if cmd == "join":
            sub.setsockopt(zmq.RCVTIMEO, int(n))
            try:
                sub.recv_multipart()
                print("joined", flush=True)
            except zmq.Again:
                print("again", flush=True)
            sub.setsockopt(zmq.RCVTIMEO, 30000)
            continue
        assert cmd == "collect", cmd
        want = int(n)
        while sum(1 for e in seen if e["type"] == "BlockStored" and e["medium"] == MEDIUM_STORAGE) < want:
            _topic, _seq, payload = sub.recv_multipart()
            for e in dec.decode(payload).events:
                if isinstance(e, (BlockStored, BlockRemoved)):
                    seen.append({"type": type(e).__name__, "block_hashes": list(e.block_hashes),
                                 "medium": e.medium, "locality": e.locality})
        print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
