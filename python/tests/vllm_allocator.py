"""kvtier's vLLM connector on the KV tensors vLLM 0.33's own allocator makes, on CPU.

Run by tests/engines_vllm_alloc.rs with the daemon's socket as argv[1], in the vLLM 0.33
venv (the GPU build's Python code) with the source package on PYTHONPATH.

For every attention backend in vLLM's registry (``AttentionBackendEnum``) whose class
imports without a GPU, and every KV cache layout that backend declares
(``get_supported_kv_cache_layouts``), the KV tensors come from vLLM's own path, in the
engine core's order: the backend's ``customize_spec`` on the layer specs,
``resolve_kv_cache_layout``, ``get_global_kv_cache_groups``, ``get_kv_cache_configs`` (the
layout recorded on the config as the engine core does), then the model runner's
``allocate_kv_cache`` on the CPU device (the views of one backing buffer, cross-layer for
the block-outermost layouts). vLLM's ``KVConnectorFactory`` builds the scheduler and
worker connectors from that config and the worker registers the tensors:

* every layout registers: one block of one layer one contiguous run (vLLM's
  ``is_block_compact``, or one head, as MLA has), or one run per head (heads outside
  blocks: ``LHBNC``/``BHLNC``), registered as pages cut into head runs;
* MHA runs with 2 and with 4 KV heads a rank, so the heads-outside halves are one head
  run each and two head runs each (kvtier's multi-run pages);
* a backend's K/V head slots (ROCm's ``num_head_slots=2``) register as split ``nhd``
  pages, any other head-slot packing would be refused (counted, none expected).

For each distinct geometry that registered (layout, MLA or not, dtype, block size), a
store and a load run through vLLM's v1 ``Scheduler`` and the worker side in the order
vLLM's model runner calls it (``bind_connector_metadata``, ``start_load_kv``, per layer
``wait_for_layer_load`` and ``save_kv_layer``, ``wait_for_save``, ``get_finished``,
``get_block_ids_with_load_errors``, ``clear_connector_metadata``): engine 1 writes
random bytes into the slots of request A's tokens (the forward pass's stand-in) and
stores its full blocks; engine 2, a fresh allocation, gets request B's shared prefix from
kvtier (``num_computed_tokens``), and every loaded block is bit-identical to engine 1's
block, while every other byte of engine 2's backing buffer is still zero.

Then the sharing check: pages an ``LHBNC`` (and a ``BHLNC``) engine stored load into an
``LBHNC`` engine of the same model, and each of its blocks holds the same logical
``[heads, tokens, K + V]`` values as the storing engine's block: the head runs in order
are the ``LBHNC`` block's bytes.
"""

import os
import sys
from collections import Counter

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache, select_common_block_size

import kvtier.vllm
from kvtier.errors import LayoutError
from vllm_support import DIM, HEADS, LAYERS, tiny_model_config

SOCKET = sys.argv[1]
#: MLA's latent width (a kv_lora_rank and a rope part); the backends do not compute here.
LATENT = 72
#: The tiny model's max_model_len: vLLM's planner wants one request of it to fit.
MAX_LEN = 1024
model_config = tiny_model_config()


def block_size_for(backend, make_spec):
    """The smallest of 16, 32, 64, ... that the backend's kernels take whole (no kernel
    block split: kvtier addresses vLLM's blocks)."""
    for bs in (16, 32, 64, 128, 256):
        spec = make_spec(bs)
        try:
            if select_common_block_size(bs, [backend], [spec]) == bs:
                return bs
        except ValueError:
            continue
    return None


def vllm_config(bs, name):
    cfg = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=1024,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm", kv_role="kv_both",
            kv_connector_extra_config={"socket": SOCKET, "instance": name, "model": name, "session_events": ""}))
    return cfg


def allocate(backend, layout, spec, name):
    """vLLM's allocation path for one worker; returns (config, kv cache config, caches)."""
    cfg = vllm_config(spec.block_size, name)
    specs = {n: spec for n in LAYERS}
    got = resolve_kv_cache_layout(cfg, [[layout.name]], specs.values())
    assert got == layout, (got, layout)
    groups = get_global_kv_cache_groups(cfg, [specs])
    memory = (MAX_LEN // spec.block_size + 8) * spec.page_size_bytes * len(LAYERS)
    kvc = get_kv_cache_configs(cfg, [specs], [memory], groups)[0]
    kvc.kv_cache_layout = cfg.cache_config.kv_cache_layout
    kernel = [select_common_block_size(spec.block_size, [backend], [spec])]
    caches = allocate_kv_cache(kvc, torch.device("cpu"), layout, kernel)
    assert sorted(caches) == sorted(LAYERS), sorted(caches)
    cfg.cache_config.num_gpu_blocks = kvc.num_blocks
    return cfg, kvc, caches


def raw(t):
    """Every byte of the backing buffer under ``t``."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))


def block_bytes(t, b):
    return t[b].contiguous().view(-1).view(torch.uint8)


class Engine:
    """vLLM's Scheduler with the scheduler-side connector, and the worker-side connector
    over vLLM's own KV tensors."""

    def __init__(self, cfg, kvc, caches):
        self.caches = caches
        self.bs = cfg.cache_config.block_size
        self.sched = Scheduler(vllm_config=cfg, kv_cache_config=kvc, log_stats=False,
                               structured_output_manager=StructuredOutputManager(cfg), block_size=self.bs)
        assert isinstance(self.sched.connector, kvtier.vllm.KvtierConnector), type(self.sched.connector)
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
        self.worker.register_kv_caches(caches)
        assert self.worker._link.get() is not None, "the worker did not connect to the daemon"
        self.gen = torch.Generator().manual_seed(hash(kvc.kv_cache_layout) & 0xFFFF)

    def step(self):
        out = self.sched.schedule()
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
        for layer in LAYERS:
            w.wait_for_layer_load(layer)
            # The forward pass's stand-in: random bytes into the slots of the step's tokens.
            for new in out.scheduled_new_reqs:
                ids, start = new.block_ids[0], new.num_computed_tokens
                for pos in range(start, start + out.num_scheduled_tokens[new.req_id]):
                    slot = self.caches[layer][ids[pos // self.bs], :, pos % self.bs]
                    slot.view(torch.uint8).copy_(torch.randint(1, 256, slot.view(torch.uint8).shape,
                                                               dtype=torch.uint8, generator=self.gen))
            w.save_kv_layer(layer, self.caches[layer], None)
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                  invalid_block_ids=errors)))
        return out, errors


def request(rid, tokens, bs):
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, block_hasher=get_request_block_hasher(bs, sha256))


def round_trip(backend, layout, spec, name, load_as=None):
    """Engine 1 stores request A's 3 full blocks; engine 2 (fresh tensors; ``load_as``'s
    backend and layout when given, else engine 1's) loads them for B. Returns the bytes
    compared."""
    bs = spec.block_size
    e1 = Engine(*allocate(backend, layout, spec, name))
    backend, layout = load_as or (backend, layout)
    prefix = [(i * 37 + 11) % 1000 for i in range(3 * bs)]
    a = request("A", prefix + [901, 902], bs)
    e1.sched.add_request(a)
    out, errors = e1.step()
    assert not errors and [len(s.hashes) for s in out.kv_connector_metadata.saves] == [3], \
        out.kv_connector_metadata.saves
    a_blocks = list(out.scheduled_new_reqs[0].block_ids[0][:3])

    e2 = Engine(*allocate(backend, layout, spec, name))
    b = request("B", prefix + [(i * 53 + 5) % 1000 for i in range(bs // 2)], bs)
    e2.sched.add_request(b)
    out, errors = e2.step()
    assert not errors, errors
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 3 * bs, (name, new.num_computed_tokens)
    loads = out.kv_connector_metadata.loads
    assert len(loads) == 1 and len(loads[0].block_ids) == 3, loads
    b_blocks = list(new.block_ids[0][:3])
    assert loads[0].block_ids == b_blocks, (loads[0].block_ids, b_blocks)
    # Every loaded block equals the stored one, in every layer ...
    compared = 0
    for layer in LAYERS:
        for ba, bb in zip(a_blocks, b_blocks):
            got, want = block_bytes(e2.caches[layer], bb), block_bytes(e1.caches[layer], ba)
            assert bool(want.ne(0).any()), f"{name}: engine 1's block {ba} of {layer} was never written"
            assert torch.equal(got, want), f"{name}: block {bb} of {layer} differs from engine 1's block {ba}"
            compared += got.numel()
    # ... and nothing outside them was written: on a copy of engine 2's whole backing
    # buffer, clear B's blocks through the same views; what is left must be zero.
    clone = raw(e2.caches[LAYERS[0]]).clone()
    for layer in LAYERS:
        t = e2.caches[layer]
        v = torch.as_strided(clone.view(t.dtype), t.shape, t.stride(), t.storage_offset())
        for blk in new.block_ids[0]:
            v[blk].zero_()
    stray = int(clone.ne(0).sum())
    assert stray == 0, f"{name}: {stray} bytes of engine 2's buffer outside B's blocks are not zero"
    return compared


def main():
    mha = lambda bs, dtype, heads: FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=DIM,  # noqa: E731
                                                     dtype=dtype)
    mla = lambda bs, dtype, _: MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=LATENT, dtype=dtype)  # noqa: E731
    counts, skipped, geometries = Counter(), [], {}
    for member, heads in [(m, h) for m in AttentionBackendEnum for h in (HEADS, 2 * HEADS)]:
        try:
            backend = member.get_class()
        except Exception as e:  # noqa: BLE001 - a backend whose module needs a GPU library
            if heads == HEADS:
                skipped.append(f"{member.name} ({type(e).__name__})")
            continue
        is_mla = bool(backend.is_mla())
        if is_mla and heads != HEADS:
            continue  # MLA has one latent head
        dtypes = list(getattr(backend, "supported_dtypes", [torch.float16]))
        dtype = torch.float16 if torch.float16 in dtypes else dtypes[0]

        def make(bs, dtype=dtype, is_mla=is_mla, backend=backend, heads=heads):
            spec = (mla if is_mla else mha)(bs, dtype, heads)
            return backend.customize_spec(spec) if hasattr(backend, "customize_spec") else spec

        bs = block_size_for(backend, make)
        if bs is None:
            if heads == HEADS:
                skipped.append(f"{member.name} (no block size up to 256 without a kernel split)")
            continue
        spec = make(bs)
        for layout in get_supported_kv_cache_layouts([backend]):
            name = f"alloc-{os.getpid()}-{member.name}-{layout.name}-h{heads}"
            try:
                cfg, kvc, caches = allocate(backend, layout, spec, name)
            except (ValueError, AssertionError) as e:
                # vLLM's own planner refuses this combination: nothing to register.
                skipped.append(f"{member.name}/{layout.name} (vLLM: {str(e)[:80]})")
                continue
            t0 = caches[LAYERS[0]]
            slots = getattr(spec, "num_head_slots", None)
            print(f"{name}: {'MLA' if is_mla else 'MHA'} {spec.dtype} block {bs} heads {heads} slots {slots} view "
                  f"{tuple(t0.shape)} strides {t0.stride()}", flush=True)
            try:
                e = Engine(cfg, kvc, caches)
            except LayoutError as err:
                print(f"{name}: refused: {err}", flush=True)
                counts["refused"] += 1
                continue
            counts["registered"] += 1
            counts["mla" if is_mla else "mha"] += 1
            if not (layout.is_block_compact or is_mla or slots):
                counts["heads outside"] += 1
                assert e.worker._layout.kv_order == "packed-hnd", (name, e.worker._layout)
            if slots:
                counts["kv slots"] += 1
                assert e.worker._layout.kv_order == "nhd", (name, e.worker._layout)
            key = (layout.name, is_mla, str(spec.dtype), bs, getattr(spec, "page_size_padded", None),
                   1 if is_mla else heads, slots)
            geometries.setdefault(key, (backend, layout, spec, name))
    compared = 0
    for (lname, is_mla, dtype, bs, _, heads, slots), (backend, layout, spec, name) in \
            sorted(geometries.items(), key=lambda kv: str(kv[0])):
        compared += round_trip(backend, layout, spec, name + "-rt")
        print(f"round trip {lname} {'MLA' if is_mla else 'MHA'} {dtype} block {bs} heads {heads}"
              f"{' kv-slots' if slots else ''}: ok", flush=True)
    # Sharing: heads-outside pages load into an LBHNC engine (same spec, same model).
    shared = 0
    for (lname, is_mla, dtype, bs, padded, heads, slots), (backend, layout, spec, name) in \
            sorted(geometries.items(), key=lambda kv: str(kv[0])):
        into = geometries.get(("LBHNC", is_mla, dtype, bs, padded, heads, slots))
        if lname not in ("LHBNC", "BHLNC") or is_mla or slots or into is None:
            continue
        compared += round_trip(backend, layout, spec, f"{name}-share", load_as=into[:2])
        shared += 1
        print(f"shared {lname} -> LBHNC MHA {dtype} block {bs} heads {heads}: ok", flush=True)
    print(f"skipped (import needs a GPU library, or vLLM refuses): {', '.join(skipped)}", flush=True)
    layouts = sorted({k[0] for k in geometries})
    print(f"OK registered {counts['registered']} backend layouts ({counts['mha']} MHA, {counts['mla']} MLA; "
          f"{counts['heads outside']} MHA with heads outside blocks, {counts['kv slots']} with K/V head slots), "
          f"refused {counts['refused']}", flush=True)
    print(f"OK round trips: {len(geometries)} geometries over layouts {','.join(layouts)}, {shared} shared into "
          f"LBHNC, {compared} bytes bit-identical, no stray bytes", flush=True)
    assert {"LBHNC", "LBNHC", "BLHNC", "BLNHC", "LHBNC", "BHLNC"} <= set(layouts), layouts
    assert {(k[0], k[5]) for k in geometries if not k[1] and not k[6]} >= \
        {(lay, h) for lay in ("LHBNC", "BHLNC") for h in (HEADS, 2 * HEADS)}, sorted(geometries)
    assert shared >= 2, shared
    assert any(k[1] for k in geometries) and any(not k[1] for k in geometries), geometries.keys()
    print("OK done", flush=True)


if __name__ == "__main__":
    main()
