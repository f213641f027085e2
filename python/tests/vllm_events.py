"""Decodes kvtier's KV events with vLLM's own msgspec types, as a vLLM-side consumer does.

Usage: vllm_events.py current <PUB> <replay ROUTER>
       vllm_events.py legacy <PUB> <replay ROUTER> <vllm 0.23 wheel>

`current` imports `vllm.distributed.kv_events` from the installed vLLM (0.33: tagged map
events in an array batch; replay answered `[topic, seq, payload]`, ended by
`[b"", END, b""]`). `legacy` loads `vllm/distributed/kv_events.py` straight out of a
vLLM 0.23 wheel (array events; replay answered `[seq, payload]`, ended by `[END, b""]`),
its imports served by the installed vLLM. Every payload goes through
`msgspec.msgpack.Decoder(KVEventBatch)`; a payload vLLM's types refuse raises, so the
process exits non-zero.

It subscribes, prints "ready", then answers commands on stdin, one JSON line each:
  heard <ms>        wait up to <ms> for a live batch (the test stores probe pages until
                    one comes: a PUB socket drops what it sends before a subscription
                    reaches it); print whether one came
  until <n>         receive live batches until <n> BlockStored events of host pages
                    (medium CPU_PINNED) arrived in all, probe pages (hashes whose top 16
                    bits are 0x7e57) not counted; print every live batch by seq
  replay <start>    replay from <start> with the mode's protocol; print what came back
  flood <n>         send <n> replay requests from 0 back to back on one socket; print
                    how many were answered with batches and how many with the end alone
  bad               send a malformed replay request; print whether the end came back
"""

import json
import sys
import types
import zipfile

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)
# The top 16 bits of the test's probe pages' hashes (tests/vllm_events.rs).
PROBE_TOP = 0x7E57


def is_probe(e):
    return any(isinstance(h, int) and h >> 48 == PROBE_TOP for h in e.get("block_hashes", []))


def load(mode, wheel):
    if mode == "current":
        import vllm.distributed.kv_events as kv

        return kv
    src = zipfile.ZipFile(wheel).read("vllm/distributed/kv_events.py")
    kv = types.ModuleType("vllm023_kv_events")
    kv.__file__ = wheel + "/vllm/distributed/kv_events.py"
    sys.modules[kv.__name__] = kv
    exec(compile(src, kv.__file__, "exec"), kv.__dict__)
    return kv


def event_json(kv, e):
    if isinstance(e, kv.BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(e.block_hashes),
            "parent_block_hash": e.parent_block_hash,
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "lora_id": e.lora_id,
            "medium": e.medium,
        }
    if isinstance(e, kv.BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
    assert isinstance(e, kv.AllBlocksCleared), type(e)
    return {"type": "AllBlocksCleared"}


def main():
    mode, pub, replay_ep = sys.argv[1:4]
    kv = load(mode, sys.argv[4] if len(sys.argv) > 4 else None)
    dec = msgspec.msgpack.Decoder(kv.KVEventBatch)

    def decode(payload):
        b = dec.decode(payload)
        assert isinstance(b.ts, float) and b.ts > 1.6e9, b.ts
        return {"dp": b.data_parallel_rank, "events": [event_json(kv, e) for e in b.events]}

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 20000)
    sub.connect(pub)
    live = {}

    def dealer():
        # vLLM's subscribers talk to the ROUTER from a DEALER: `[b"", start]` out, and
        # every answer comes back behind an empty delimiter frame.
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10000)
        sock.connect(replay_ep)
        return sock

    def recv(sock):
        frames = sock.recv_multipart()
        assert frames[0] == b"", frames[:1]
        return frames[1:]

    def replay(start):
        sock = dealer()
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            frames = recv(sock)
            if mode == "current":
                # vLLM >= 0.26: [topic, seq, payload] ... [b"", END, b""]
                assert len(frames) == 3, f"expected 3, got {len(frames)}"
                topic, seq, payload = frames
                if seq == END:
                    assert topic == b"" and payload == b"", frames
                    break
            else:
                assert len(frames) == 2, f"expected 2, got {len(frames)}"
                seq, payload = frames
                if seq == END:
                    assert payload == b"", frames
                    break
            got.append((int.from_bytes(seq, "big"), decode(payload)))
        sock.close()
        return got

    def receive():
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"" and len(seq) == 8, (topic, seq)
        s = int.from_bytes(seq, "big")
        assert s not in live, f"seq {s} twice"
        live[s] = decode(payload)

    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "heard":
            came = bool(sub.poll(int(cmd[1])))
            if came:
                receive()
            print(json.dumps({"heard": came}), flush=True)
        elif cmd[0] == "until":
            want = int(cmd[1])

            def host_stored():
                return sum(
                    1
                    for b in live.values()
                    for e in b["events"]
                    if e["type"] == "BlockStored" and e["medium"] == "CPU_PINNED" and not is_probe(e)
                )

            while host_stored() < want:
                receive()
            print(json.dumps({str(s): live[s] for s in sorted(live)}), flush=True)
        elif cmd[0] == "replay":
            got = replay(int(cmd[1]))
            print(json.dumps({"seqs": [s for s, _ in got], "batches": [b for _, b in got]}), flush=True)
        elif cmd[0] == "flood":
            # One peer sending requests back to back, as a misbehaving subscriber would;
            # each answer ends with the end marker.
            d = dealer()
            n = int(cmd[1])
            for _ in range(n):
                d.send_multipart([b"", (0).to_bytes(8, "big")])
            served = refused = 0
            for _ in range(n):
                batches = 0
                while recv(d)[-2] != END:
                    batches += 1
                if batches:
                    served += 1
                else:
                    refused += 1
            d.close()
            print(json.dumps({"served": served, "refused": refused}), flush=True)
        elif cmd[0] == "bad":
            d = dealer()
            d.send_multipart([b"", b"\x01\x02"])
            frames = recv(d)
            d.close()
            print(json.dumps({"end": frames[-2] == END, "frames": len(frames)}), flush=True)
        else:
            raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
