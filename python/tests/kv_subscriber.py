"""A router-side subscriber for kvtier's event publishers, used by tests/events.rs.

Usage: kv_subscriber.py <positional PUB> <positional replay ROUTER> <tagged PUB> <mooncake PUB>

The positional publisher sends vLLM <= 0.23's form (array events, replay answered
`[seq, payload]`), the tagged one vLLM 0.24+'s (map events in an array batch). It
subscribes, prints "ready", prints "heard" once a message came on each of the three (the
test provokes events until then: a PUB socket drops what it sends before a subscription
reaches it), receives until the test writes "done <batches> <tagged batches> <mooncake
batches>" on stdin and those batches arrived, checks every message's
exact shape (frame count, sequence frames, field order and types, medium), fills the gap
it had before it connected by replaying from sequence 0, checks a replay from a middle
sequence, and prints one JSON document of everything it decoded for the test to compare
with kvtier's own event log. Any shape violation raises, so the process exits non-zero.
"""

import json
import sys
import threading
import time

import msgpack
import zmq

MEDIA = {"GPU", "CPU_PINNED", "SHARED"}
END_SEQ = b"\xff" * 8
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
REMOVED_KEYS = ["type", "block_hashes", "medium"]
MOONCAKE_BASE = [
    "event_id", "timestamp", "event_type", "type", "model_name", "block_size", "additional_salt", "lora_name",
    "tenant_id", "backend_id", "group_id", "medium", "dp_rank", "object_key", "seq_hashes", "block_hashes",
    "base_block_idx",
]
# Mooncake's publisher's fields with its legacy ones on, in its order; kvtier's two at the end.
MOONCAKE_KEYS = {
    "stored": MOONCAKE_BASE + ["parent_hash", "token_ids", "parent_block_hash", "page_hash", "seq"],
    "removed": MOONCAKE_BASE + ["page_hash", "seq"],
}
LEGACY = {"stored": "BlockStored", "removed": "BlockRemoved"}
EVENT_IDS = []


def hash_json(h):
    assert isinstance(h, (int, bytes)), f"block hash of type {type(h)}"
    return h if isinstance(h, int) else h.hex()


def check_positional_event(e):
    assert isinstance(e, list) and e and isinstance(e[0], str), e
    tag = e[0]
    if tag == "BlockStored":
        assert len(e) == 8, e
        _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = e
        assert isinstance(hashes, list) and len(hashes) == 1, e
        assert parent is None and tokens == [] and lora_id is None and lora_name is None, e
        assert isinstance(block_size, int) and not isinstance(block_size, bool), e
        assert medium in MEDIA, e
        return ["BlockStored", [hash_json(hashes[0])], block_size, medium]
    if tag == "BlockRemoved":
        assert len(e) == 3, e
        _, hashes, medium = e
        assert isinstance(hashes, list) and len(hashes) == 1 and medium in MEDIA, e
        return ["BlockRemoved", [hash_json(hashes[0])], medium]
    assert tag == "AllBlocksCleared" and len(e) == 1, e
    return ["AllBlocksCleared"]


def check_named_event(e):
    assert isinstance(e, dict), e
    keys = list(e.keys())
    if e.get("type") == "BlockStored":
        assert keys == STORED_KEYS, keys
        return check_positional_event([e[k] for k in STORED_KEYS])
    if e.get("type") == "BlockRemoved":
        assert keys == REMOVED_KEYS, keys
        return check_positional_event([e[k] for k in REMOVED_KEYS])
    assert keys == ["type"] and e["type"] == "AllBlocksCleared", e
    return ["AllBlocksCleared"]


def decode_vllm(payload, tagged):
    b = msgpack.unpackb(payload, raw=False)
    # The batch is an array in both forms; only the events differ.
    assert isinstance(b, list) and len(b) == 3, b
    ts, events, dp = b
    check = check_named_event if tagged else check_positional_event
    assert isinstance(ts, float) and ts > 1.6e9, ts
    assert isinstance(dp, int) and isinstance(events, list) and events, b
    return {"dp": dp, "events": [check(e) for e in events]}


def decode_mooncake(payload):
    b = msgpack.unpackb(payload, raw=False)
    assert isinstance(b, list) and len(b) == 3, b
    ts_ms, events, dp = b
    assert isinstance(ts_ms, int) and ts_ms > 1.6e12, ts_ms
    assert isinstance(dp, int) and isinstance(events, list) and events, b
    out = []
    for e in events:
        assert isinstance(e, dict) and e.get("event_type") in MOONCAKE_KEYS, e
        assert list(e.keys()) == MOONCAKE_KEYS[e["event_type"]] and e["type"] == LEGACY[e["event_type"]], e
        assert all(isinstance(e[k], str) for k in ("object_key", "tenant_id", "group_id", "backend_id")), e
        assert isinstance(e["seq"], int) and e["medium"] == "cpu" and e["backend_id"] == "kvtier", e
        assert e["timestamp"] == ts_ms and e["dp_rank"] == dp, e
        low64 = int(e["page_hash"][-16:], 16)
        assert e["seq_hashes"] == [low64] and e["block_hashes"] == [low64], e
        if e["event_type"] == "stored":
            assert e["base_block_idx"] == 0 and e["parent_hash"] is None and e["token_ids"] is None, e
            assert e["parent_block_hash"] is None, e
        else:
            assert e["base_block_idx"] is None, e
        assert e["model_name"] == "m" and e["block_size"] == 16, e
        EVENT_IDS.append(e["event_id"])
        out.append([e["event_type"], e["object_key"], e["tenant_id"], e["group_id"], e["page_hash"], e["seq"]])
    return {"dp": dp, "events": out}


def split(frames):
    assert len(frames) == 3, f"{len(frames)} frames"
    topic, seq, payload = frames
    assert len(seq) == 8, seq
    return topic, int.from_bytes(seq, "big"), payload


def replay(ctx, endpoint, start):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        frames = sock.recv_multipart()
        assert len(frames) == 3 and frames[0] == b"", frames[:1]
        if frames[1] == END_SEQ:
            assert frames[2] == b""
            break
        got.append((int.from_bytes(frames[1], "big"), frames[2]))
    sock.close()
    return got


def main():
    pos_ep, replay_ep, named_ep, moon_ep = sys.argv[1:5]
    ctx = zmq.Context()
    subs = {}
    for name, ep in (("positional", pos_ep), ("tagged", named_ep), ("mooncake", moon_ep)):
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(ep)
        subs[name] = s
    poller = zmq.Poller()
    for s in subs.values():
        poller.register(s, zmq.POLLIN)
    print("ready", flush=True)

    want = {}

    def read_done():
        line = sys.stdin.readline().split()
        assert line and line[0] == "done", line
        want.update(positional=int(line[1]), tagged=int(line[2]), mooncake=int(line[3]))

    t = threading.Thread(target=read_done, daemon=True)
    t.start()
    live = {k: {} for k in subs}
    heard = False
    deadline = time.time() + 60
    while time.time() < deadline:
        # vLLM batches are numbered from 0, Mooncake's from 1: the last is want - 1 or want.
        last = {k: want[k] - (k != "mooncake") for k in want}
        if want and all(len(live[k]) and max(live[k]) >= last[k] for k in subs):
            break
        if not heard and all(live.values()):
            # Every subscription has reached its publisher: what is sent from now on arrives.
            print("heard", flush=True)
            heard = True
        for sock, _ in poller.poll(100):
            name = next(k for k, s in subs.items() if s is sock)
            topic, seq, payload = split(sock.recv_multipart())
            assert topic == b"", topic
            assert seq not in live[name], f"{name}: seq {seq} twice"
            live[name][seq] = decode_mooncake(payload) if name == "mooncake" else decode_vllm(payload, name == "tagged")
    assert want, "the test never said done"
    for k in subs:
        seqs = sorted(live[k])
        assert seqs == list(range(seqs[0], seqs[-1] + 1)), f"{k}: live sequence has gaps: {seqs}"
    # Mooncake numbers events from 1, without gaps: from the first one it heard on, the
    # subscriber saw them all.
    assert EVENT_IDS and EVENT_IDS == list(range(EVENT_IDS[0], EVENT_IDS[0] + len(EVENT_IDS))), EVENT_IDS

    # Fill the gap before we connected from the replay socket, and check a later start.
    first_live = min(live["positional"])
    full = replay(ctx, replay_ep, 0)
    replayed = {seq: decode_vllm(p, False) for seq, p in full}
    for seq, batch in live["positional"].items():
        assert replayed[seq] == batch, f"replayed batch {seq} differs from the live one"
    merged = dict(replayed)
    merged.update(live["positional"])
    assert sorted(merged) == list(range(want["positional"])), sorted(merged)
    middle = replay(ctx, replay_ep, 1)
    print(json.dumps({
        "first_live_seq": first_live,
        "replay_from_0": [s for s, _ in full],
        "replay_from_1": [s for s, _ in middle],
        "positional": [merged[s] for s in sorted(merged)],
        "named_seqs": sorted(live["tagged"]),
        "named": [live["tagged"][s] for s in sorted(live["tagged"])],
        "mooncake_seqs": sorted(live["mooncake"]),
        "mooncake": [live["mooncake"][s] for s in sorted(live["mooncake"])],
    }), flush=True)


if __name__ == "__main__":
    main()
