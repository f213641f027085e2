"""``KvtierConnector``: kvtier as a vLLM 0.33 KV connector (``KVConnectorBase_V1``).

Load it with::

    --kv-transfer-config '{"kv_connector":"KvtierConnector","kv_connector_module_path":"kvtier.vllm","kv_role":"kv_both"}'

and optionally ``"kv_connector_extra_config": {...}`` with the keys of :data:`EXTRA_KEYS`.

Scheduler side: ``get_num_new_matched_tokens`` looks the request's ``block_hashes`` up in
kvtier (one page per vLLM block) and offers the hit beyond vLLM's own prefix cache, always
leaving the prompt's last token to compute (when kvtier holds every block of a
block-aligned prompt, all blocks load and only that token is computed, into the last
block; see ``whole_prompt_hit``); the load is asynchronous (the request waits in
``WAITING_FOR_REMOTE_KVS``) when part of the hit sits in the pool, which the daemon must
first bring to host, or when ``load_async`` is set. ``update_state_after_alloc`` pins the
hit to the blocks vLLM allocated, ``build_connector_meta`` hands the step's loads and the
newly full blocks to save to the workers (only blocks new to kvtier: the leading pages its
lookup found in kvtier, whether vLLM's own prefix cache or a load supplied them, are never
sent again), ``request_finished`` forgets the request, and
``take_events`` returns vLLM's own ``BlockStored`` events for the blocks sent to kvtier.

Worker side: ``register_kv_caches`` registers vLLM's KV tensors themselves with the daemon
(host tensors on CPU, CUDA tensors through the device registration with the current
stream), so kvtier copies pages straight between them and its host arena.
``start_load_kv`` loads whole pages (every layer at once; ``wait_for_layer_load`` has
nothing left to wait for), in a background thread for asynchronous loads, reported by
``get_finished``; ``wait_for_save`` stores the step's full blocks after the forward pass
wrote them (``save_kv_layer`` has no per-layer work). Blocks a load could not fill are
reported by ``get_block_ids_with_load_errors``.

Stored pages carry their token ids (block ``i`` holds ``all_token_ids[i * block_size:
(i + 1) * block_size]``) and their parent, so the daemon's ``BlockStored`` events can be
indexed by token-aware routers such as Dynamo's.

Sessions: a request's ``session_id`` is announced to kvtier, stored pages are tagged
with it, and ``request_finished`` reports the request's end (prompt page hashes and
token counts) to the session. vLLM's ``Request`` has no parent-session field, so no
parent is passed. A new request of a session the daemon's pressure controller paused waits
in vLLM's queue (``get_num_new_matched_tokens`` answers ``None``, which vLLM's scheduler
takes as "ask again next step") until the daemon resumes the session or
``session_hold_ms`` passes; the connector hears pauses and resumes on the daemon's session
events (:mod:`kvtier.session_hold`), so several vLLM instances on one model each see them,
and requests already running are never stopped. Router hints (``Request.kv_hints``, Dynamo's ``KvHintsEnvelope``) are
passed to the daemon once per request; ``kv.fetch`` block hashes that are the request's
own blocks as KV events name them (64-bit integers) are rewritten to the full hashes
kvtier keys the pages under. The daemon's report per envelope is kept in
``kv_hint_reports``.
"""

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from . import _capi
from . import tensors as _tensors
from .client import Client, Layout, default_socket, dtype_name
from .session_hold import DEFAULT_HOLD_MS, SessionHold, default_endpoint
from .errors import KvtierError, LayoutError, UnavailableError
from .link import Link

logger = logging.getLogger(__name__)

#: ``kv_connector_extra_config`` keys: the daemon's socket (default: as ``kvtier serve``),
#: this engine's instance name, the model name pages are keyed under (default: the served
#: model name), every call's timeout, and whether loads are always asynchronous.
#: ``session_events`` is the daemon's session event endpoint (default: its ``ipc`` socket
#: beside the daemon's socket, when that exists; ``""`` turns holding off) and
#: ``session_hold_ms`` the longest a request of a paused session waits (0: never held).
#: ``whole_prompt_hit`` (default on): a request whose every block kvtier holds loads them
#: all and computes only its last token; off, the hit ends at the last whole block before
#: that token (as vLLM's own prefix cache), which vLLM then computes.
EXTRA_KEYS = ("socket", "instance", "model", "timeout_ms", "load_async", "session_events", "session_hold_ms",
              "whole_prompt_hit")
#: The ``medium`` of the ``BlockStored`` events: kvtier keeps pages in host memory.
MEDIUM = "CPU"
#: Envelope reports kept for inspection (the oldest are dropped).
HINT_REPORTS = 256
#: The router action whose block hashes the connector translates.
KV_FETCH = "kv.fetch"


@dataclass
class KvtierLoad:
    """Pages to load into vLLM blocks: ``hashes[i]`` into ``block_ids[i]``."""

    req_id: str
    hashes: list
    block_ids: list
    is_async: bool


@dataclass
class KvtierSave:
    """Full blocks to store: ``block_ids[i]`` holds page ``hashes[i]``."""

    req_id: str
    hashes: list
    block_ids: list
    session: str
    #: Token ids of the blocks, ``block_size`` a block.
    tokens: list = field(default_factory=list)
    #: Hash of the block before ``hashes[0]``, or None for a chain's first block.
    parent: Any = None


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """What the scheduler hands the workers for one step."""

    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


@dataclass
class _Tracked:
    request: Any
    block_ids: list = field(default_factory=list)
    saved_upto: int = 0
    hit_start: int = 0
    hit_hashes: list = field(default_factory=list)
    hit_async: bool = False
    pending_load: Any = None
    hints_sent: bool = False


def _extra(vllm_config):
    cfg = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(cfg) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"kv_connector_extra_config keys {unknown} are unknown; KvtierConnector takes {list(EXTRA_KEYS)}")
    return cfg


def total_kv_heads(per_rank, tp_size, vllm_config=None):
    """The model's KV heads, which kvtier's layout counts (vLLM's specs and tensors hold
    one rank's share): the model config's count where it agrees with the rank's share
    (heads replicated over more ranks than there are heads included), else share x TP."""
    try:
        total = vllm_config.model_config.get_total_num_kv_heads()
    except Exception:  # noqa: BLE001 - no model config (tests building the layout alone)
        total = None
    if total and max(1, total // tp_size) == per_rank:
        return total
    return per_rank * tp_size


#: vLLM's KV cache layouts (``KVCacheLayout``, logical ``[L, B, H, N, C]``) and the order
#: of the bytes of one block of one layer read as kvtier copies it. In ``LHBNC``/``BHLNC``
#: (heads outside blocks) a block is one run per head; read in head order the runs are the
#: same block's bytes in ``LBHNC``, so those pages are ``packed-hnd`` too and shared with
#: ``LBHNC`` engines (``kvtier.tensors.packed_views``). The legacy names ``NHD``/``HND``
#: are vLLM's aliases of ``LBNHC``/``LBHNC``.
VLLM_LAYOUTS = {"LBHNC": "packed-hnd", "BLHNC": "packed-hnd", "LHBNC": "packed-hnd", "BHLNC": "packed-hnd",
                "LBNHC": "packed-nhd", "BLNHC": "packed-nhd", "HND": "packed-hnd", "NHD": "packed-nhd"}
#: vLLM ``cache_dtype`` values that name the stored KV dtype (its tensors hold fp8 as uint8).
FP8_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def vllm_kv_layout(kv_cache_config, vllm_config=None):
    """The name of the KV cache layout vLLM resolved (``KVCacheConfig.kv_cache_layout``,
    else ``CacheConfig.kv_cache_layout``), or None for a vLLM without packed 4-D views
    (its K and V tensors are split, 5-D)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None and vllm_config is not None:
        name = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    return getattr(name, "name", name)


def kv_order_of(kv_cache_config, vllm_config=None, mla=False):
    """kvtier's ``kv_order`` for vLLM's resolved layout: ``packed-hnd``/``packed-nhd`` for
    the 4-D K|V views, ``nhd`` for split 5-D tensors (no layout resolved) and for MLA (one
    latent head: no K|V packing, the same bytes in either order)."""
    name = vllm_kv_layout(kv_cache_config, vllm_config)
    if name is None or mla:
        return "nhd"
    order = VLLM_LAYOUTS.get(str(name).upper())
    if order is None:
        raise LayoutError(_capi.ERR_LAYOUT, f"vLLM's KV cache layout {name} is not one kvtier knows; kvtier "
                          f"addresses {sorted(VLLM_LAYOUTS)} (set VLLM_KV_CACHE_LAYOUT to one of them)", "layout")
    return order


def kv_dtype(torch_dtype, vllm_config=None):
    """kvtier's dtype name of vLLM's KV cache: its ``cache_dtype`` when that names an fp8
    format (the tensors then hold bytes), else the tensors' dtype."""
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    if isinstance(cache_dtype, str) and cache_dtype in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[cache_dtype]
    return dtype_name(torch_dtype)


def kv_groups(spec):
    """Whether an MHA spec's page is vLLM's K/V-group packing (``num_head_slots`` 2, each
    slot one of K and V for all heads: ``[2, block_size, heads x head_dim]`` a block, as
    ROCm's attention backends customize it): its halves are K and V themselves, tokens
    outside heads, the bytes of split ``nhd`` pages. Any other head-slot packing (packed
    fp4 with scales) is refused with a ``LayoutError``."""
    slots = getattr(spec, "num_head_slots", None)
    if slots is None or isinstance(spec, MLAAttentionSpec):
        return False
    group = spec.num_kv_heads * spec.head_size * torch.empty((), dtype=spec.dtype).element_size()
    if slots == 2 and getattr(spec, "state_content_bytes", None) == group:
        return True
    raise LayoutError(_capi.ERR_LAYOUT, f"vLLM's KV cache spec packs {slots} head slots of "
                      f"{getattr(spec, 'state_content_bytes', None)} bytes a token; kvtier addresses one slot per "
                      "KV head, or K and V as two slots", "layout")


def layout_of(kv_cache_config, tp_size=1, vllm_config=None):
    """The kvtier layout of vLLM's KV cache config: one page per block, every attention
    layer of one full-attention group, in the dtype and byte order vLLM keeps them in."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise LayoutError(_capi.ERR_LAYOUT, f"KvtierConnector handles one full-attention KV cache group, not {kinds}",
                          "layout")
    spec = groups[0].kv_cache_spec
    mla = isinstance(spec, MLAAttentionSpec)
    head_v = getattr(spec, "head_size_v", None)
    if not mla and head_v not in (None, spec.head_size):
        raise LayoutError(_capi.ERR_LAYOUT, f"K heads of {spec.head_size} and V heads of {head_v} dims: kvtier's pages "
                          "hold K and V of one head size", "layout")
    return Layout(
        layers=len(groups[0].layer_names),
        kv_heads=1 if mla else total_kv_heads(spec.num_kv_heads, tp_size, vllm_config),
        head_dim=spec.head_size,
        dtype_bytes=torch.empty((), dtype=spec.dtype).element_size(),
        page_tokens=spec.block_size,
        mla=mla,
        dtype=kv_dtype(spec.dtype, vllm_config),
        kv_order="nhd" if kv_groups(spec) else kv_order_of(kv_cache_config, vllm_config, mla),
    )


def _tp():
    """(rank, size) of this worker's tensor-parallel group; (0, 1) when none is set up
    (a connector driven outside vLLM's worker processes)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError, ImportError):
        return 0, 1


def _layer_index(name):
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return extract_layer_index(name)
    except (AssertionError, ValueError):
        return name


def _full_hashes(doc, block_hashes):
    """``doc`` (an envelope as JSON values) with the ``kv.fetch`` block hashes that are
    event hashes of ``block_hashes`` replaced by those blocks' full hashes in hex."""
    if not isinstance(doc, dict) or not isinstance(doc.get("actions"), list):
        return doc  # malformed: the daemon says how
    # kvtier's events and vLLM's own both name a block by its hash's last 8 bytes.
    by_event = {int.from_bytes(bytes(h)[-8:], "big"): bytes(h).hex() for h in block_hashes}
    actions = []
    for action in doc["actions"]:
        payload = action.get("payload") if isinstance(action, dict) else None
        if isinstance(payload, dict) and action.get("action_type") == KV_FETCH and \
                isinstance(payload.get("block_hashes"), list):
            hashes = [by_event.get(h & 0xFFFF_FFFF_FFFF_FFFF, h) if isinstance(h, int) and not isinstance(h, bool)
                      else h for h in payload["block_hashes"]]
            action = {**action, "payload": {**payload, "block_hashes": hashes}}
        actions.append(action)
    return {**doc, "actions": actions}


class KvtierConnector(KVConnectorBase_V1):
    """kvtier behind vLLM's KV connector interface (both roles)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = _extra(vllm_config)
        self._socket = cfg.get("socket")
        model_cfg = vllm_config.model_config
        self._model = cfg.get("model") or getattr(model_cfg, "served_model_name", None) or model_cfg.model
        if isinstance(self._model, (list, tuple)):
            self._model = self._model[0]
        self._instance = cfg.get("instance") or vllm_config.kv_transfer_config.engine_id or "vllm"
        self._timeout_ms = int(cfg.get("timeout_ms", 10000))
        self._load_async = bool(cfg.get("load_async", False))
        self._whole_prompt_hit = cfg.get("whole_prompt_hit", True)
        if not isinstance(self._whole_prompt_hit, bool):
            raise ValueError(f"kv_connector_extra_config whole_prompt_hit is {self._whole_prompt_hit!r}; "
                             "KvtierConnector takes true or false")
        self._block_size = vllm_config.cache_config.block_size
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._layout = (layout_of(kv_cache_config, self._tp_size, vllm_config)
                        if kv_cache_config is not None else None)
        self._link = None
        #: ``(request_id, report)`` of the envelopes passed to the daemon, newest last.
        self.kv_hint_reports = deque(maxlen=HINT_REPORTS)
        if role == KVConnectorRole.SCHEDULER:
            # A page kvtier cannot load (its daemon went away between lookup and load) is
            # recomputed, never the request's error: vLLM's scheduler reads the policy
            # right after building this connector.
            transfer = vllm_config.kv_transfer_config
            if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
                logger.info("kvtier: kv_load_failure_policy set to 'recompute': a block kvtier cannot load is computed")
                transfer.kv_load_failure_policy = "recompute"
            # The scheduler only looks pages up; it registers no memory.
            self._link = Link(lambda: self._connect(self._layout, f"{self._instance}-scheduler", 0), "vLLM", "scheduler")
            self._link.get()
            self._tracked = {}
            self._sessions = set()
            self._events = []
            self._hold = self._session_hold(cfg)
        else:
            self._pages = 0
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-load")
            self._lock = threading.Lock()
            self._async = {}
            self._load_errors = set()

    def _session_hold(self, cfg):
        """Subscribes to the daemon's session events, so new requests of paused sessions
        wait (see :mod:`kvtier.session_hold`); None when there is no endpoint."""
        hold_ms = int(cfg.get("session_hold_ms", DEFAULT_HOLD_MS))
        endpoint = cfg.get("session_events")
        if endpoint is None:
            endpoint = default_endpoint(self._socket or default_socket())
        if not endpoint or hold_ms == 0:
            logger.info("kvtier: new requests of paused sessions are not held (no session event endpoint)")
            return None
        return SessionHold(endpoint, hold_ms)

    def _call(self, what, fn, default):
        """``fn(client)``, or ``default`` when no daemon is connected or the call fails
        (logged; a daemon that went away is reconnected later)."""
        try:
            client = self._link.get() if self._link is not None else None
        except KvtierError as e:
            # A daemon that came back refusing this engine (another layout under its
            # model name): vLLM keeps serving, computing locally.
            logger.warning("kvtier refused the connection for a %s: %s", what, e)
            return default
        if client is None:
            return default
        try:
            return fn(client)
        except KvtierError as e:
            logger.warning("kvtier %s failed: %s", what, e)
            self._link.lost(e)
            return default

    def _connect(self, layout, instance, tp_rank):
        return Client(layout, socket=self._socket, instance=instance, model=str(self._model), tp_rank=tp_rank,
                      tp_size=self._tp_size, timeout_ms=self._timeout_ms)

    # ==============================
    # Scheduler side
    # ==============================
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        # A new request of a session the daemon paused waits: None asks vLLM's scheduler
        # to keep it waiting and ask again next step (KVConnectorBase_V1's contract). It is
        # asked before the session is announced: reporting it reasoning would resume it.
        session = getattr(request, "session_id", None)
        if self._hold is not None and self._hold.holds(request.request_id, session):
            return None, False
        self._note_session(request)
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        if not tracked.hints_sent:
            tracked.hints_sent = True
            self._forward_kv_hints(request)
        # The request's full blocks are looked up even where vLLM's own prefix cache holds
        # them: the pages kvtier already holds are never stored again (_plan_save starts
        # after them), which a vLLM prefix hit or a block just loaded from kvtier would
        # otherwise be.
        full = min(len(request.block_hashes), request.num_tokens // self._block_size)
        if full == 0:
            return 0, False
        hashes = [bytes(h) for h in request.block_hashes[:full]]
        hit = self._call("lookup (computing locally)", lambda c: c.lookup(hashes), None)
        if hit is None:
            return 0, False
        held = min(hit.device + hit.host + hit.pool, full)
        tracked.saved_upto = max(tracked.saved_upto, held)
        start = num_computed_tokens // self._block_size
        # The last token is always computed, so vLLM can sample the next one. When kvtier
        # holds every block of a block-aligned request (the whole prompt), all of them
        # load and the hit counts all tokens but that one, which vLLM computes into the
        # last loaded block (as LMCache's connector does); otherwise the hit is whole
        # blocks ending before the last token.
        whole = self._whole_prompt_hit and held == full and full * self._block_size == request.num_tokens
        pages = held if whole else min(held, (request.num_tokens - 1) // self._block_size)
        if pages <= start:
            return 0, False
        tracked.hit_start = start
        tracked.hit_hashes = hashes[start:pages]
        tracked.hit_async = self._load_async or hit.pool > 0
        return (pages - start) * self._block_size - (1 if whole else 0), tracked.hit_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        if num_external_tokens <= 0 or not tracked.hit_hashes:
            return
        # A whole-prompt hit ends one token short of its last block: that block loads too.
        n = -(-num_external_tokens // self._block_size)
        block_ids = list(blocks.get_block_ids()[0])
        ids = block_ids[tracked.hit_start:tracked.hit_start + n]
        hashes = tracked.hit_hashes[:n]
        tracked.hit_hashes = []
        tracked.saved_upto = max(tracked.saved_upto, tracked.hit_start + len(ids))
        tracked.pending_load = KvtierLoad(request.request_id, hashes, ids, tracked.hit_async)

    def build_connector_meta(self, scheduler_output):
        meta = KvtierConnectorMetadata()
        for tracked in self._tracked.values():
            if tracked.pending_load is not None:
                meta.loads.append(tracked.pending_load)
                tracked.pending_load = None
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan_save(meta, tracked, new.num_computed_tokens + steps.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            self._plan_save(meta, tracked, cached.num_computed_tokens[i] + steps.get(req_id, 0))
        return meta

    def _plan_save(self, meta, tracked, computed_after_step):
        request = tracked.request
        full = min(computed_after_step // self._block_size, len(request.block_hashes), len(tracked.block_ids))
        if full <= tracked.saved_upto:
            return
        lo, hi = tracked.saved_upto, full
        hashes = [bytes(h) for h in request.block_hashes[lo:hi]]
        tokens = list(request.all_token_ids[lo * self._block_size:hi * self._block_size])
        meta.saves.append(KvtierSave(request.request_id, hashes, tracked.block_ids[lo:hi],
                                     getattr(request, "session_id", None) or "", tokens,
                                     bytes(request.block_hashes[lo - 1]) if lo > 0 else None))
        tracked.saved_upto = full
        parent = maybe_convert_block_hash(request.block_hashes[lo - 1]) if lo > 0 else None
        self._events.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in request.block_hashes[lo:hi]],
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=self._block_size,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
            session_id=getattr(request, "session_id", None),
        ))

    def request_finished(self, request, block_ids):
        # Saves run inside the step (wait_for_save) before blocks can be freed, so vLLM may
        # free them at once.
        self._tracked.pop(request.request_id, None)
        if self._hold is not None:
            self._hold.forget(request.request_id)
        session = getattr(request, "session_id", None)
        # The prompt's full blocks (block_hashes also covers full blocks of the output).
        prompt = request.block_hashes[:request.num_prompt_tokens // self._block_size]
        if session and prompt:
            self._call(f"end of a request of session {session}",
                       lambda c: c.request_end(session, [bytes(h) for h in prompt], request.num_prompt_tokens,
                                               request.num_output_tokens), None)
        return False, None

    def take_events(self):
        events, self._events = self._events, []
        return events

    def _note_session(self, request):
        session = getattr(request, "session_id", None)
        if session and session not in self._sessions:
            if self._call(f"announcing session {session}", lambda c: c.session(session, None, "reasoning") or True,
                          False):
                self._sessions.add(session)

    def _forward_kv_hints(self, request):
        """Passes ``request.kv_hints`` (Dynamo's ``KvHintsEnvelope``) to the daemon and keeps
        its report. A router names blocks by their KV-event hash, a 64-bit integer (the
        last 8 bytes of the block hash, in kvtier's events as in vLLM's own), while
        kvtier keys vLLM's pages by the full hash: integers that are this request's
        own blocks become the full hashes (hex); others pass unchanged (the daemon reports
        pages it does not hold)."""
        envelope = getattr(request, "kv_hints", None)
        if envelope is None:
            return
        try:
            doc = envelope if isinstance(envelope, dict) else msgspec.to_builtins(envelope)
            doc = _full_hashes(doc, request.block_hashes)
            client = self._link.get()
            if client is None:
                raise UnavailableError(_capi.ERR_UNAVAILABLE, "no kvtier daemon connected")
            try:
                report = client.kv_hints(doc)
            except KvtierError as e:
                self._link.lost(e)
                raise
        except (KvtierError, TypeError, ValueError) as e:
            # A hint is advice: a bad one costs the prefetch, never the request.
            logger.warning("kvtier did not take the KV hints of a request: %s", e)
            report = {"error": str(e)}
        self.kv_hint_reports.append((request.request_id, report))

    # ==============================
    # Worker side
    # ==============================
    def register_kv_caches(self, kv_caches):
        """Registers vLLM's KV tensors: the 4-D packed K|V views of vLLM's KV cache layouts
        (``[blocks, heads, block_size, K + V dims]``, MLA ``[blocks, 1, block_size,
        latent]``), or the split 5-D ``[2, blocks, ...]``/``[blocks, 2, ...]`` and 3-D MLA
        tensors of earlier vLLMs. The layout comes from the tensors (shape, strides, dtype)
        and must equal the one of vLLM's KV cache config (block size, heads, head size,
        dtype, byte order, block count); a mismatch is refused naming both sides. With no
        daemon yet, vLLM runs on and the tensors register when it appears."""
        names = sorted(kv_caches, key=_layer_index)
        tensors = [kv_caches[n] for n in names]
        t0 = tensors[0]
        # The rank from vLLM's process group; the size from the parallel config, which the
        # scheduler side used too.
        tp_rank = _tp()[0]
        dtype = kv_dtype(t0.dtype, self._vllm_config)
        if t0.dim() == 4:
            mla = (self._layout.mla if self._layout is not None
                   else bool(getattr(self._vllm_config.model_config, "use_mla", False)))
            order = _tensors.packed_order(t0)
            if order is None:
                raise LayoutError(_capi.ERR_LAYOUT, f"KV cache {names[0]} has shape {tuple(t0.shape)} and strides "
                                  f"{t0.stride()}: one block of one layer is neither one contiguous run nor one run "
                                  "per head", "layout")
            heads, block, content = t0.shape[1], t0.shape[2], t0.shape[3]
            groups = self._kv_cache_config is not None and not mla and \
                kv_groups(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec)
            if groups:
                # [blocks, 2, block_size, heads x head_dim]: K and V slots.
                spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
                heads, head_dim, kv_order = spec.num_kv_heads, spec.head_size, "nhd"
            else:
                head_dim, kv_order = (content, "nhd") if mla else (content // 2, f"packed-{order}")
            layout = Layout(layers=len(tensors), kv_heads=1 if mla else total_kv_heads(heads, self._tp_size,
                                                                                          self._vllm_config),
                            head_dim=head_dim, dtype_bytes=t0.element_size(), page_tokens=block, mla=mla,
                            dtype=dtype, kv_order=kv_order)
            self._check_layout(layout, names[0], t0)
            addresses = _tensors.packed_views(layout, tensors, heads, kv_groups=groups)
        else:
            ks, vs = [], []
            for name, t in zip(names, tensors):
                if t.dim() == 5 and t.shape[0] == 2:  # [2, blocks, block_size, heads, dim]
                    ks.append(t[0])
                    vs.append(t[1])
                elif t.dim() == 5 and t.shape[1] == 2:  # [blocks, 2, block_size, heads, dim]
                    ks.append(t[:, 0])
                    vs.append(t[:, 1])
                elif t.dim() == 3:  # MLA: [blocks, block_size, latent]
                    ks.append(t.unsqueeze(2))
                else:
                    raise LayoutError(_capi.ERR_LAYOUT, f"KV cache {name} has shape {tuple(t.shape)}, which kvtier does "
                                      "not address (vLLM's 4-D [blocks, heads, block_size, K+V dims], "
                                      "[2, blocks, block, heads, dim], [blocks, 2, ...] or MLA [blocks, block, dim])",
                                      "layout")
            k0 = ks[0]
            s = k0.stride()
            order = "hnd" if (k0.shape[2] > 1 and s[2] == k0.shape[1] * s[1]) else "nhd"
            heads = 1 if not vs else total_kv_heads(k0.shape[2], self._tp_size, self._vllm_config)
            layout = Layout(layers=len(ks), kv_heads=heads, head_dim=k0.shape[3], dtype_bytes=k0.element_size(),
                            page_tokens=k0.shape[1], mla=not vs, dtype=dtype, kv_order=order)
            self._check_layout(layout, names[0], k0)
            addresses = _tensors.page_views(layout, [ks, vs] if vs else [ks])
        stream = torch.cuda.current_stream(t0.device).cuda_stream if t0.is_cuda else 0
        self._pages = addresses[2]
        self._kv_caches = kv_caches  # kvtier copies into them; keep them referenced

        def connect():
            return self._connect(layout, self._instance, tp_rank)

        def register(client):
            ptrs, stride, pages, device, *runs = addresses
            _tensors.register_addresses(client, ptrs, stride, pages, device, stream, *runs)

        self._link = Link(connect, "vLLM", f"worker (TP rank {tp_rank})", register)
        self._link.get()

    def _check_layout(self, layout, name, t):
        """Refuses KV tensors that disagree with vLLM's KV cache config, naming both."""
        if self._layout is not None and layout != self._layout:
            raise LayoutError(_capi.ERR_LAYOUT, f"KV cache {name} ({tuple(t.shape)}, {t.dtype}) gives {layout}; vLLM's "
                              f"KV cache config gives {self._layout}", "layout")
        blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if blocks is not None and t.shape[0] != blocks:
            raise LayoutError(_capi.ERR_LAYOUT, f"KV cache {name} has {t.shape[0]} blocks; vLLM's KV cache config has "
                              f"{blocks} (kernel blocks smaller than vLLM's block size are not addressed)", "layout")

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        for load in meta.loads:
            if load.is_async:
                with self._lock:
                    self._async[load.req_id] = self._pool.submit(self._load, load)
            else:
                self._load(load)

    def _load(self, load):
        # A failed load (the daemon gone since the lookup) leaves its blocks to be computed:
        # they are reported by get_block_ids_with_load_errors, and the scheduler connector
        # set kv_load_failure_policy to "recompute".
        # Each call waits (up to the call's timeout) for the next page the daemon is still
        # staging from the pool, and loads the leading pages on host. An asynchronous
        # load, off vLLM's step, asks again for the rest while each call brings pages: a
        # slow pool read then costs time, not a recomputation of the pages it had not
        # staged yet. A synchronous load (every page was on host at the lookup) asks once.
        n = 0
        while n < len(load.hashes):
            got = self._call(f"load of {len(load.hashes) - n} pages",
                             lambda c, n=n: c.load(load.hashes[n:], load.block_ids[n:], _capi.LOAD_WAIT_COMPLETE), 0)
            n += got
            if got == 0 or not load.is_async:
                break
        if n < len(load.block_ids):
            with self._lock:
                self._load_errors.update(load.block_ids[n:])
        return n

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        for save in meta.saves:
            # A dropped save is a future cache miss, never a wrong answer.
            self._call(f"store of {len(save.hashes)} pages",
                       lambda c, save=save: c.store(save.hashes, save.block_ids, save.session,
                                                    tokens=save.tokens or None, parent=save.parent), None)

    def get_finished(self, finished_req_ids):
        with self._lock:
            done = {r for r, f in self._async.items() if f.done()}
            for r in done:
                del self._async[r]
        return None, (done or None)

    def get_block_ids_with_load_errors(self):
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        if self._role != KVConnectorRole.SCHEDULER:
            self._pool.shutdown(wait=True)
        elif self._hold is not None:
            self._hold.close()
        if self._link is not None:
            self._link.close()
