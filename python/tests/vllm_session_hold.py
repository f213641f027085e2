"""A paused session's new requests wait in vLLM 0.33's own scheduler, and go on resume.

Run by tests/engines_vllm_hold.rs with the daemon's socket as argv[1], against a daemon with
100 pages of host, exclusive tiers and its session events on ``ipc`` beside the socket.
Two vLLM Schedulers (a tiny Llama config on CPU, as python/tests/vllm_connector.py builds
them) load ``kvtier.vllm.KvtierConnector`` through vLLM's factory; the connector finds the
daemon's session event endpoint by itself. A kvtier package client stands in for the
engine whose session the pressure controller pauses: its acting session ``tool-h`` holds
10 pages and a filler takes host to 96 of 100, so the daemon pauses ``tool-h``; loading
the filler's pages (exclusive tiers: they leave host) resumes it. The script waits for
each decision on its own subscription to the same events (a deadline, not a timing
check). Prints ``OK ...`` lines the Rust test asserts on.
"""

import json
import sys
import time
from pathlib import Path

import msgspec
import torch
import zmq
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import kvtier
import kvtier.vllm
from pkg_pages import store
from vllm_support import BLOCKS, BS, DIM, HEADS, LAYERS, tiny_model_config

SOCKET = sys.argv[1]
EVENTS = f"ipc://{Path(SOCKET).parent / 'session-events.ipc'}"
model_config = tiny_model_config()


def scheduler(name, extra):
    cfg = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm", kv_role="kv_both",
            kv_connector_extra_config={"socket": SOCKET, "instance": name, "model": "tiny-llama", **extra}),
    )
    cfg.cache_config.num_gpu_blocks = BLOCKS
    kvc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYERS, FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM,
                                                   dtype=torch.float16))])
    s = Scheduler(vllm_config=cfg, kv_cache_config=kvc, log_stats=False,
                  structured_output_manager=StructuredOutputManager(cfg), block_size=BS)
    assert isinstance(s.connector, kvtier.vllm.KvtierConnector), type(s.connector)
    return s


def request(rid, session):
    tokens = [(i * 37 + len(rid) * 11) % 1000 for i in range(40)]
    kw = {"session_id": session} if session else {}
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256), **kw)


def scheduled(sched):
    return [r.req_id for r in sched.schedule().scheduled_new_reqs]


def wait_event(sub, kind, session, limit_s=15.0):
    """The next session event, which must be ``kind`` for ``session``."""
    sub.setsockopt(zmq.RCVTIMEO, int(limit_s * 1000))
    try:
        _topic, _seq, payload = sub.recv_multipart()
    except zmq.Again:
        raise SystemExit(f"no {kind} event for {session} within {limit_s} s")
    ev = msgspec.msgpack.decode(payload)
    assert (ev["type"], ev["session_id"]) == (kind, session), ev
    return ev


# The connector of A holds for the daemon's cap (the default); B's for 1 ms.
a = scheduler("vllm-a", {})
b = scheduler("vllm-b", {"session_hold_ms": 1})
assert a.connector._hold is not None and a.connector._hold.endpoint == EVENTS, a.connector._hold
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"kvtier.sessions")
sub.connect(EVENTS)


def probe_until_heard(c):
    """A PUB socket drops what it sends before a subscription reaches it. Until the
    script's subscription and both connectors' have heard one, session ``probe`` is
    reported paused and then reasoning again, which the daemon answers with one
    ``session_resume``; then the script's subscription reads on up to the last probe, so
    its next event is the scenario's first. The probe then ends."""
    holds = (a.connector._hold, b.connector._hold)
    deadline = time.monotonic() + 20
    probes, heard = 0, 0
    sub.setsockopt(zmq.RCVTIMEO, 200)
    while not heard or any(h.last_seq == 0 for h in holds):
        assert time.monotonic() < deadline, ("no probe reached every subscriber", heard,
                                             [h.last_seq for h in holds])
        c.session("probe", None, "paused")
        c.session("probe", None, "reasoning")
        probes += 1
        if not heard:
            try:
                _topic, seq, payload = sub.recv_multipart()
                ev = msgspec.msgpack.decode(payload)
                assert (ev["type"], ev["session_id"]) == ("session_resume", "probe"), ev
                heard = int.from_bytes(seq, "big")
            except zmq.Again:
                pass
        for h in holds:
            h.poll()
    while heard < probes:
        ev = wait_event(sub, "session_resume", "probe")
        assert ev["seq"] == heard + 1, (ev, heard)
        heard = ev["seq"]
    c.session("probe", None, "ended")
    return probes


layout = kvtier.Layout(layers=4, kv_heads=4, head_dim=16, dtype_bytes=2, page_tokens=4)
with kvtier.Client(layout, socket=SOCKET, instance="tool-engine", model="pressure") as c:
    c.register_emulated(128)
    probes = probe_until_heard(c)
    c.session("tool-h", None, "reasoning")
    store(c, "tool-h", 0x1000, 10)
    c.session("tool-h", None, "acting")
    filler = store(c, "filler", 0x5000, 86)
    ev = wait_event(sub, "session_pause", "tool-h")
    assert ev["seq"] == probes + 1, (ev, probes)
    # Each connector's own subscription gets the event too, in its own time (a deadline).
    deadline = time.monotonic() + 15
    for hold in (a.connector._hold, b.connector._hold):
        while "tool-h" not in hold.paused:
            assert time.monotonic() < deadline, "a connector did not hear the pause"
            hold.poll()
            time.sleep(0.01)

    # tool-h's new turn waits in A's queue step after step; another session's goes.
    a.add_request(request("R-held", "tool-h"))
    a.add_request(request("R-other", "other"))
    got = scheduled(a)
    assert got == ["R-other"], (got, a.connector._hold.paused, a.connector._hold.last_seq)
    for _ in range(3):
        got = scheduled(a)
        assert "R-held" not in got, (got, a.connector._hold.paused, a.connector._hold.last_seq)
    held = a.requests["R-held"]
    assert held.status == RequestStatus.WAITING and held.num_computed_tokens == 0, held.status
    print("OK a paused session's new request waits in vLLM's scheduler; another session's is scheduled")

    # B bounds the wait at 1 ms: its request is held once, then admitted though still paused.
    b.add_request(request("R-bounded", "tool-h"))
    assert scheduled(b) == []
    time.sleep(0.01)
    assert scheduled(b) == ["R-bounded"]
    assert "tool-h" in b.connector._hold.paused
    print("OK session_hold_ms bounds the wait: admitted while its session is still paused")

    # The filler's pages go to device and leave host: the daemon resumes tool-h.
    assert c.load(filler, list(range(86))) == 86
    wait_event(sub, "session_resume", "tool-h")
    deadline = time.monotonic() + 15
    got = []
    while "R-held" not in got:
        # The resume event is on its way to A's subscription too (a deadline, not a timing check).
        assert time.monotonic() < deadline, "R-held was not scheduled after the resume"
        got = scheduled(a)
        time.sleep(0.01)
    assert "tool-h" not in a.connector._hold.paused
    print("OK on resume the held request is scheduled")
a.connector.shutdown()
b.connector.shutdown()
print("OK done")
