"""kvtier.vllm.KvtierConnector inside vLLM 0.33's own code, on CPU, against a real daemon.

Run by tests/engines_vllm.rs with the daemon's socket as argv[1] and its KV event replay
endpoint as argv[2], in the vLLM venv with the source package on PYTHONPATH. vLLM's
KVConnectorFactory builds the connector from a KVTransferConfig naming ``kvtier.vllm``; vLLM's v1 Scheduler (a ModelConfig on a tiny
Llama config.json, DeviceConfig("cpu"), one FullAttentionSpec group) schedules real
Requests. Each "engine" here is a Scheduler with its scheduler-side connector plus a
worker-side connector whose registered KV caches are CPU tensors; the model forward is
stood in for only by writing each scheduled token's K/V (a function of its token id and
position, so a shared prefix has the same KV in any engine) into its slot.

Engine 1 runs request A (session agent-7) and stores its full blocks with their token
ids: the daemon's own KV events, replayed and decoded with vLLM's KVEventBatch decoder,
carry each block's 16 token ids and its parent. Engines 2 (asynchronous load) and 3
(synchronous load), fresh vLLM instances on the same daemon, run request B sharing A's
first 3 blocks: each gets num_computed_tokens = 48 from kvtier's hit, and the loaded
blocks are checked element for element. B carries a Dynamo KvHint envelope as vLLM's
Request.kv_hints, naming its blocks by vLLM's integer event hashes: kv.fetch@1.0 is
accepted for 3 pages, kv.fetch@2.0 is ignored (unsupported_version), and a hash kvtier
does not hold is ignored (unknown_pages).

A prompt of exactly A's 3 full blocks in a fresh engine loads all 3 and vLLM computes only
its last token (num_computed_tokens 47, the connector's default ``whole_prompt_hit``); with
``whole_prompt_hit`` off, 2 blocks load and vLLM computes the third (32).
"""

import json
import sys
import time

import msgspec
import torch
import zmq
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import kvtier
import kvtier.vllm
from vllm_support import BLOCKS, BS, DIM, HEADS, LAYERS, tiny_model_config

SOCKET, REPLAY = sys.argv[1], sys.argv[2]
END = (-1).to_bytes(8, "big", signed=True)
model_config = tiny_model_config()


def kv_cache_config():
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYERS, FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM,
                                                   dtype=torch.float16))])


def transfer_config(name, load_async, **extra):
    return KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
                            kv_role="kv_both",
                            kv_connector_extra_config={"socket": SOCKET, "instance": name, "model": "tiny-llama",
                                                       "load_async": load_async, **extra})


class Engine:
    """One vLLM instance: its Scheduler (with the scheduler-side connector) and its worker
    connector over CPU KV caches."""

    def __init__(self, name, load_async, **extra):
        cfg = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024,
                                             is_encoder_decoder=False),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=transfer_config(name, load_async, **extra),
        )
        cfg.cache_config.num_gpu_blocks = BLOCKS
        kvc = kv_cache_config()
        self.sched = Scheduler(vllm_config=cfg, kv_cache_config=kvc, log_stats=False,
                               structured_output_manager=StructuredOutputManager(cfg), block_size=BS)
        assert isinstance(self.sched.connector, kvtier.vllm.KvtierConnector), type(self.sched.connector)
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
        assert isinstance(self.worker, kvtier.vllm.KvtierConnector)
        self.caches = {n: torch.zeros(2, BLOCKS, BS, HEADS, DIM, dtype=torch.float16) for n in LAYERS}
        self.worker.register_kv_caches(self.caches)
        self.requests = {}

    def add(self, req):
        self.requests[req.request_id] = req
        self.sched.add_request(req)

    def step(self):
        out = self.sched.schedule()
        # The scheduler collects the connector's events in update_from_output (and publishes
        # them when KV events are on); take them here to check them.
        self.events = list(self.sched.connector.take_events())
        # The model forward: K/V of every scheduled token into its slot.
        for new in out.scheduled_new_reqs:
            self.forward(new.req_id, new.block_ids[0], new.num_computed_tokens, out.num_scheduled_tokens[new.req_id])
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(ctx)
        for layer in LAYERS:
            self.worker.wait_for_layer_load(layer)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                  invalid_block_ids=errors)))
        return out, errors

    def forward(self, req_id, block_ids, start, n):
        tokens = self.requests[req_id].all_token_ids
        for pos in range(start, start + n):
            block, off = block_ids[pos // BS], pos % BS
            for li, layer in enumerate(LAYERS):
                for part in (0, 1):
                    self.caches[layer][part, block, off] = expected_token(tokens[pos], pos, li, part)


def expected_token(token, pos, layer, part):
    """What the model writes for one token: [heads, dim], distinct per element."""
    base = (token * 131 + pos * 17 + layer * 7 + part * 3) % 997
    return (torch.arange(HEADS * DIM, dtype=torch.float32).reshape(HEADS, DIM) + base) % 1024 / 8


def request(rid, tokens, **kw):
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256), **kw)


def check_blocks(eng, req, block_ids, n_blocks):
    """Every element of the request's first n_blocks blocks holds its tokens' K/V."""
    tokens = req.all_token_ids
    checked = 0
    for b in range(n_blocks):
        for off in range(BS):
            pos = b * BS + off
            for li, layer in enumerate(LAYERS):
                for part in (0, 1):
                    got = eng.caches[layer][part, block_ids[b], off].float()
                    want = expected_token(tokens[pos], pos, li, part)
                    assert torch.equal(got, want), (req.request_id, b, off, layer, part)
                    checked += got.numel()
    return checked


def daemon_stored_events():
    """Every BlockStored event the daemon published so far, through vLLM's replay protocol
    (a DEALER sends ``[b"", start seq]``; ``[b"", topic, seq, payload]`` frames come back,
    ended by seq -1), each payload decoded with vLLM's own KVEventBatch decoder."""
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(REPLAY)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    stored = []
    while True:
        _, _topic, seq, payload = sock.recv_multipart()
        if seq == END:
            break
        stored += [e for e in dec.decode(payload).events if isinstance(e, BlockStored)]
    sock.close()
    return stored


prefix = [(i * 37 + 11) % 1000 for i in range(48)]
a_tokens = prefix + [901, 902]                          # 50 tokens: 3 full blocks
b_tokens = prefix + [(i * 53 + 5) % 1000 for i in range(12)]  # 60 tokens: shares 3 blocks

# -- Engine 1 stores A's full blocks. --------------------------------------------------------
e1 = Engine("vllm-1", load_async=False)
req_a = request("A", a_tokens, session_id="agent-7")
e1.add(req_a)
out, errors = e1.step()
assert [r.req_id for r in out.scheduled_new_reqs] == ["A"] and not errors
assert out.scheduled_new_reqs[0].num_computed_tokens == 0
saves = out.kv_connector_metadata.saves
assert [(s.req_id, len(s.hashes), s.session) for s in saves] == [("A", 3, "agent-7")], saves
assert req_a.status == RequestStatus.FINISHED_LENGTH_CAPPED, req_a.status
events = e1.events
assert len(events) == 1 and isinstance(events[0], BlockStored), events
assert events[0].block_hashes == [maybe_convert_block_hash(h) for h in req_a.block_hashes[:3]] and events[0].session_id == "agent-7", events[0]
assert events[0].token_ids == a_tokens[:48] and events[0].parent_block_hash is None
layout = kvtier.vllm.layout_of(kv_cache_config())
with kvtier.Client(layout, socket=SOCKET, instance="probe", model="tiny-llama") as probe:
    assert sum(probe.lookup([bytes(h) for h in req_a.block_hashes])) == 3
print("OK engine 1 stored 3 blocks; BlockStored event with the request's hashes and session")
# request_finished told the daemon that A of session agent-7 ended; the test reads the
# daemon's request trace line against these page ids (its traces use a hash's first 8 bytes).
print("A-TRACE " + json.dumps({"session_id": "agent-7", "input_length": 50, "output_length": 1,
                               "hash_ids": [int.from_bytes(bytes(h)[:8], "big") for h in req_a.block_hashes]}))

# The daemon's own events for the host copies of those pages: the blocks' token ids,
# chained by parent, the blocks named as vLLM names them.
ev_hash = [maybe_convert_block_hash(h) for h in req_a.block_hashes[:3]]
for _ in range(250):
    stored = [e for e in daemon_stored_events() if e.medium == "CPU_PINNED"]
    if len(stored) >= 3:
        break
    time.sleep(0.02)
got = [(e.block_hashes, e.parent_block_hash, list(e.token_ids), e.block_size, e.medium) for e in stored]
want = [([ev_hash[0]], None, a_tokens[0:16], 16, "CPU_PINNED"),
        ([ev_hash[1]], ev_hash[0], a_tokens[16:32], 16, "CPU_PINNED"),
        ([ev_hash[2]], ev_hash[1], a_tokens[32:48], 16, "CPU_PINNED")]
assert got == want, (got, want)
print(f"OK daemon events: {sum(len(e.token_ids) for e in stored)} token ids of 3 blocks, decoded by vLLM")

# -- Engine 2 loads asynchronously. -------------------------------------------------------------
e2 = Engine("vllm-2", load_async=True)
# As Dynamo's router writes it: blocks named by the integer hashes of vLLM's KV events.
b_event_hashes = [maybe_convert_block_hash(h) for h in request("probe", b_tokens).block_hashes[:3]]
assert all(isinstance(h, int) for h in b_event_hashes), b_event_hashes
fetch = {"source_control_endpoint": "tcp://10.1.2.3:25000", "block_hashes": b_event_hashes, "mode": "copy"}
envelope = KvHintsEnvelope(protocol_version="0.1", message_id="m-b", actions=[
    KvHintAction(action_id="b-fetch", action_type="kv.fetch", action_version="1.0", payload=fetch),
    KvHintAction(action_id="b-v2", action_type="kv.fetch", action_version="2.0", payload=fetch),
    KvHintAction(action_id="b-unknown", action_type="kv.fetch", action_version="1.0",
                 payload={**fetch, "block_hashes": [0x0123_4567_89AB_CDEF]}),
])
req_b = request("B", b_tokens, kv_hints=envelope)
e2.add(req_b)
out, errors = e2.step()
assert out.scheduled_new_reqs == [] and not errors, out.scheduled_new_reqs
assert req_b.status == RequestStatus.WAITING_FOR_REMOTE_KVS, req_b.status
loads = out.kv_connector_metadata.loads
assert [(l.req_id, len(l.block_ids), l.is_async) for l in loads] == [("B", 3, True)], loads
load_blocks = loads[0].block_ids
reports = list(e2.sched.connector.kv_hint_reports)
assert [r for r, _ in reports] == ["B"], reports
report = reports[0][1]
assert report["message_id"] == "m-b", report
outcomes = [(a["action_id"], a["pages"], a.get("outcome")) for a in report["actions"]]
assert outcomes == [
    ("b-fetch", 3, {"outcome": "accepted", "pages": 3}),
    ("b-v2", 0, {"outcome": "ignored", "reason": "unsupported_version"}),
    ("b-unknown", 1, {"outcome": "ignored", "reason": "unknown_pages"}),
], outcomes
print("OK kv_hints: kv.fetch@1.0 accepted for 3 pages, kv.fetch@2.0 ignored, unknown page ignored")
scheduled = None
for _ in range(200):
    out, errors = e2.step()
    assert not errors, errors
    if out.scheduled_new_reqs:
        scheduled = out.scheduled_new_reqs[0]
        break
    time.sleep(0.02)
assert scheduled is not None, "B was never scheduled after its asynchronous load"
assert scheduled.req_id == "B" and scheduled.num_computed_tokens == 48, scheduled
assert out.num_scheduled_tokens["B"] == 12, out.num_scheduled_tokens
assert list(scheduled.block_ids[0][:3]) == load_blocks
n = check_blocks(e2, req_b, load_blocks, 3)
print(f"OK engine 2 async load: num_computed_tokens 48, {n} elements checked")

# -- Engine 3 loads synchronously. --------------------------------------------------------------
e3 = Engine("vllm-3", load_async=False)
req_b3 = request("B3", b_tokens)
e3.add(req_b3)
out, errors = e3.step()
assert not errors, errors
assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("B3", 48)], out.scheduled_new_reqs
loads = out.kv_connector_metadata.loads
assert [(l.req_id, len(l.block_ids), l.is_async) for l in loads] == [("B3", 3, False)], loads
n = check_blocks(e3, req_b3, loads[0].block_ids, 3)
# Untouched blocks stayed zero: nothing was loaded beyond the hit.
others = sorted(set(range(BLOCKS)) - set(out.scheduled_new_reqs[0].block_ids[0]))
assert all(float(e3.caches[l][:, others].abs().sum()) == 0 for l in LAYERS)
print(f"OK engine 3 sync load: num_computed_tokens 48, {n} elements checked")

# -- Whole-prompt hits: a prompt of exactly A's 3 full blocks. -----------------------------------
# Engine 4 (default): all 3 blocks load and vLLM computes only the last token (47 + 1);
# engine 5 (whole_prompt_hit off): 2 blocks load and vLLM computes the third (32 + 16).
whole = []
for name, extra, want_computed, want_blocks in (("vllm-4", {}, 47, 3),
                                                 ("vllm-5", {"whole_prompt_hit": False}, 32, 2)):
    e = Engine(name, load_async=False, **extra)
    req = request(name, list(prefix))
    e.add(req)
    out, errors = e.step()
    assert not errors, errors
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [(name, want_computed)], \
        out.scheduled_new_reqs
    assert out.num_scheduled_tokens[name] == 48 - want_computed, out.num_scheduled_tokens
    loads = out.kv_connector_metadata.loads
    assert [(l.req_id, len(l.block_ids)) for l in loads] == [(name, want_blocks)], loads
    assert list(out.scheduled_new_reqs[0].block_ids[0][:want_blocks]) == loads[0].block_ids
    # The loaded blocks (the last one's final slot rewritten by the step) hold A's K/V.
    n = check_blocks(e, req, out.scheduled_new_reqs[0].block_ids[0], 3)
    whole.append(e)
    print(f"OK {name} prompt of 3 whole blocks: num_computed_tokens {want_computed}, {want_blocks} blocks loaded, "
          f"{n} elements checked")
try:
    Engine("vllm-6", load_async=False, whole_prompt_hit="yes")
    raise AssertionError("whole_prompt_hit='yes' was accepted")
except ValueError as e:
    assert "whole_prompt_hit" in str(e), e
print("OK whole_prompt_hit takes only true or false")

for e in (e1, e2, e3, *whole):
    e.worker.shutdown()
    e.sched.connector.shutdown()
print("OK done")
