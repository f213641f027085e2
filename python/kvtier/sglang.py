"""``KvtierStorage``: kvtier as an SGLang 0.5.23 HiCache storage backend.

Load it through SGLang's dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name":"kvtier","module_path":"kvtier.sglang","class_name":"KvtierStorage","interface_v1":1}'

``interface_v1: 1`` makes SGLang call the zero-copy batch API (``batch_exists``,
``batch_get_v1``, ``batch_set_v1``) with ``page_size`` host-pool token indices per key.
:meth:`KvtierStorage.register_mem_pool_host` registers SGLang's host pool tensors
themselves with the daemon (``kvtier_register_host_tensors``), so kvtier copies each page
straight between the host pool and its arena: no staging buffer, no extra copy. MHA and
MLA host pools in the ``page_first`` (SGLang's default), ``page_first_direct`` and
``layer_first`` host layouts are registered (:func:`host_pool_views`). SGLang starts
without its daemon: the backend logs one warning, finds and moves nothing (SGLang computes
locally) and connects, registering the host pool, when the daemon appears
(:class:`kvtier.link.Link`). Other
configuration comes from the same extra config (keys :data:`EXTRA_KEYS`).

Pages SGLang writes are shared: after each ``batch_set_v1`` the backend asks the daemon to
copy them to its pool (a Share hint), as HiCache's own Mooncake backend puts every page in
the store. With ``kvtier serve --pool-kind mooncake`` another SGLang instance on another node's
daemon then finds them (``batch_exists``) and loads them. ``"share": false`` keeps pages on
this node's host tier until the daemon's own policy moves them.

The legacy per-page API (``get``/``set``/``batch_get``/``batch_set``, used when
``interface_v1`` is off) moves flat pages through a one-page staging region, one extra
copy per page.
"""

import hashlib
import logging

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from . import _capi
from . import tensors as _tensors
from .client import Client, Layout
from .errors import KvtierError, LayoutError
from .link import Link

logger = logging.getLogger(__name__)

#: Keys of ``storage_config.extra_config``: SGLang's own dynamic-backend keys, then kvtier's
#: (the daemon's socket, this engine's instance name, the model name pages are keyed under,
#: every call's timeout, whether stored pages are shared to the daemon's pool).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
EXTRA_KEYS = SGLANG_KEYS + ("socket", "instance", "model", "timeout_ms", "share")


def _session(extra_info):
    """The session SGLang names in ``extra_info.extra_info["session_id"]`` (as its Mooncake
    linker does), else none. (SGLang's storage API carries no token ids, so pages are
    stored without them; the daemon's events then hold no tokens and no parent.)"""
    extra = getattr(extra_info, "extra_info", None)
    session = extra.get("session_id") if isinstance(extra, dict) else None
    return session if isinstance(session, str) else ""


def page_hash(key):
    """A HiCache key as a kvtier page hash: SGLang's hex digests as their bytes (8 to 32),
    any other key through BLAKE2b-256."""
    if isinstance(key, bytes):
        return key if 8 <= len(key) <= 32 else hashlib.blake2b(key, digest_size=32).digest()
    if 16 <= len(key) <= 64 and len(key) % 2 == 0:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.blake2b(key.encode(), digest_size=32).digest()


#: SGLang host pool layouts (``--hicache-mem-layout``) KvtierStorage registers.
HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _layout_error(msg):
    return LayoutError(_capi.ERR_LAYOUT, msg, "layout")


def host_pool_views(host, tp_size=1):
    """kvtier's :class:`~kvtier.client.Layout` for an SGLang host pool, and the pool's
    memory as :func:`kvtier.tensors.register` takes it: ``parts[p][l]`` per (part, layer)
    of ``[pages, page_size, heads, head_dim]``, or, for ``page_first``, ``parts[p]`` one
    ``[pages, page_size, layers, heads, head_dim]`` tensor per part.

    The host layout fixes the byte order of a page's objects, and the order is part of
    the page's layout: ``layer_first`` and ``page_first_direct`` hold each (part, layer)
    of a page as one run, so objects are layer-first ``[layer][token][head][dim]``;
    ``page_first`` holds a whole page of a part as ``[token][layer][head][dim]``, which
    kvtier registers as page-first objects and copies as one run. MHA pools
    (``MHATokenToKVPoolHost``: K and V) and MLA pools (``MLATokenToKVPoolHost``: one
    latent of ``kv_lora_rank + qk_rope_head_dim``) are both registered."""
    kind = getattr(host, "layout", None)
    if kind not in HOST_LAYOUTS:
        raise _layout_error(f"host pool layout {kind!r}: KvtierStorage registers {list(HOST_LAYOUTS)} "
                            "(--hicache-mem-layout)")
    kv = getattr(host, "kv_buffer", None)
    if kv is None:
        raise _layout_error(f"{type(host).__name__} holds no kv_buffer (a dummy host pool); nothing to register")
    ps, layers = host.page_size, host.layer_num
    pages = host.size // ps
    mla = isinstance(host, MLATokenToKVPoolHost)
    if mla:
        heads, dim, kparts = 1, host.kv_cache_dim, [kv]
        rank_heads = 1
    else:
        if getattr(host, "head_dim", None) != getattr(host, "v_head_dim", None):
            raise _layout_error(f"{type(host).__name__}: K head size {getattr(host, 'head_dim', None)} differs from "
                                f"V head size {getattr(host, 'v_head_dim', None)}; KvtierStorage registers MHA pools "
                                "with equal K and V head sizes, or MLA pools")
        heads, dim, kparts = host.head_num, host.head_dim, [kv[0], kv[1]]
        # kvtier's layout counts the model's KV heads; the host pool holds this rank's share.
        rank_heads = heads * tp_size
    layout = Layout(layers=layers, kv_heads=rank_heads, head_dim=dim, dtype_bytes=host.dtype.itemsize,
                    page_tokens=ps, mla=mla, page_first=kind == "page_first", dtype=host.dtype)
    if kind == "layer_first":
        # [layers, tokens, heads, dim] per part: a (part, layer) page is page_size tokens.
        parts = [[t[l][:pages * ps].view(pages, ps, heads, dim) for l in range(layers)] for t in kparts]
    elif kind == "page_first_direct":
        # [pages, layers, page_size, heads, dim] per part: the layer's run inside the page.
        parts = [[t[:pages, l] for l in range(layers)] for t in kparts]
    else:
        # [tokens, layers, heads, dim] per part: one page of a part is a whole object.
        parts = [t[:pages * ps].view(pages, ps, layers, heads, dim) for t in kparts]
    return layout, parts


class KvtierStorage(HiCacheStorage):
    """A HiCache storage backend whose pages live in kvtier's tiers (host arena, pool)."""

    def __init__(self, storage_config, kwargs=None):
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"extra config keys {unknown} are unknown; KvtierStorage takes {list(EXTRA_KEYS)}")
        self.storage_config = storage_config
        self._socket = extra.get("socket")
        self._instance = extra.get("instance") or f"sglang-dp{storage_config.dp_rank}"
        self._model = extra.get("model") or storage_config.model_name or "model"
        self._timeout_ms = int(extra.get("timeout_ms", 10000))
        share = extra.get("share", True)
        if not isinstance(share, bool):
            raise ValueError(f"extra config 'share' is {share!r}; it takes true or false")
        self._share = share
        self._link = None
        self._staging = None
        self.layout = None
        self.mem_pool_host = None
        self.page_size = None

    # -- memory ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        host = mem_pool_host
        layout, parts = host_pool_views(host, self.storage_config.tp_size)
        cfg = self.storage_config

        def connect():
            return Client(layout, socket=self._socket, instance=self._instance, model=str(self._model),
                          tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
                          dp_rank=cfg.dp_rank, timeout_ms=self._timeout_ms)

        self.layout = layout
        self.page_size = host.page_size
        # SGLang starts without its daemon (one warning; its storage then finds no hits and
        # stores nothing, so SGLang computes locally) and the host pool registers when the
        # daemon appears. A daemon that refuses the pool (another layout under the model's
        # name) stops the start-up here.
        self._link = Link(connect, "SGLang", f"storage backend (TP rank {cfg.tp_rank})",
                          lambda c: _tensors.register(c, parts))
        self._link.get()

    def _client(self):
        """The connected client, or None while no daemon is there (the link logs it once)
        or no host pool is registered yet."""
        return self._link.get() if self._link is not None else None

    def _failed(self, what, e):
        logger.warning("kvtier %s failed: %s", what, e)
        if self._link is not None:
            self._link.lost(e)

    def _slots(self, keys, host_indices):
        ps = self.page_size
        if host_indices.numel() != len(keys) * ps:
            raise LayoutError(_capi.ERR_LAYOUT, f"{host_indices.numel()} host indices for {len(keys)} keys of "
                              f"{ps} tokens", "layout")
        first = host_indices.reshape(len(keys), ps)[:, 0].tolist()
        if any(i % ps for i in first):
            raise LayoutError(_capi.ERR_LAYOUT, "host indices do not start on page boundaries", "layout")
        return [i // ps for i in first]

    # -- the v1 batch API ----------------------------------------------------------------------
    def batch_exists(self, keys, extra_info=None):
        """Leading keys held anywhere kvtier can load from: its host arena, the pool (pages
        the daemon brings back to host on load), or a registered region."""
        if not keys:
            return 0
        client = self._client()
        if client is None:
            return 0
        try:
            hit = client.lookup([page_hash(k) for k in keys])
        except KvtierError as e:
            self._failed("lookup", e)
            return 0
        return min(len(keys), hit.device + hit.host + hit.pool)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        if not keys:
            return []
        client = self._client()
        if client is None:
            return [False] * len(keys)
        try:
            hashes = [page_hash(k) for k in keys]
            client.store(hashes, self._slots(keys, host_indices), _session(extra_info))
        except KvtierError as e:
            self._failed(f"store of {len(keys)} pages", e)
            return [False] * len(keys)
        self._share_pages(client, hashes)
        return [True] * len(keys)

    def _share_pages(self, client, hashes):
        """Asks the daemon to copy stored pages to its pool. A page is complete only once
        every TP rank stored its part, so each rank asks after its own store; the last one
        finds the page complete. The pages are stored either way: a refused share is
        logged, never a failed set."""
        if not self._share:
            return
        try:
            outcome = client.hint(_capi.HINT_SHARE, hashes)
            logger.debug("kvtier share of %d pages: %s", len(hashes), outcome)
        except KvtierError as e:
            logger.warning("kvtier share of %d pages failed: %s", len(hashes), e)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        if not keys:
            return []
        client = self._client()
        if client is None:
            return [False] * len(keys)
        try:
            n = client.load([page_hash(k) for k in keys], self._slots(keys, host_indices), _capi.LOAD_WAIT_COMPLETE)
        except KvtierError as e:
            self._failed(f"load of {len(keys)} pages", e)
            n = 0
        return [True] * n + [False] * (len(keys) - n)

    def exists(self, key):
        return self.batch_exists([key]) == 1

    # -- the legacy per-page API (flat pages through a one-page staging region) -----------------
    def _stage(self):
        if self._staging is None:
            if self._link is None:
                raise KvtierError(_capi.ERR_INVALID, "no host pool is registered (register_mem_pool_host)", "invalid")
            cfg = self.storage_config
            self._staging = Client(self.layout, socket=self._socket, instance=f"{self._instance}-staging",
                                   model=str(self._model), tp_rank=cfg.tp_rank, tp_size=cfg.tp_size,
                                   pp_rank=cfg.pp_rank, pp_size=cfg.pp_size, dp_rank=cfg.dp_rank,
                                   timeout_ms=self._timeout_ms)
            self._staging.register_emulated(1)
        return self._staging

    def _flat_parts(self):
        """The parts of a flat page, in order: K then V, or the MLA latent."""
        return (_capi.PART_LATENT,) if self.layout.mla else (_capi.PART_K, _capi.PART_V)

    def set(self, key, value=None, target_location=None, target_sizes=None):
        """Stores one flat page as SGLang's ``get_data_page`` returns it (K then V, or the
        MLA latent, each in the host layout's order)."""
        if value is None:
            return False
        try:
            s = self._stage()
            raw = value.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
            parts = self._flat_parts()
            size = len(raw) // len(parts)
            for i, part in enumerate(parts):
                s.write_object(0, part, raw[i * size:(i + 1) * size])
            s.store([page_hash(key)], [0])
            self._share_pages(s, [page_hash(key)])
            return True
        except KvtierError as e:
            logger.warning("kvtier set failed: %s", e)
            return False

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return all(self.set(k, v) for k, v in zip(keys, values or [None] * len(keys)))

    def get(self, key, target_location=None, target_sizes=None):
        """Loads one flat page into ``target_location`` (a flat tensor of the page's size);
        returns it, or None when kvtier does not hold the key."""
        try:
            s = self._stage()
            if s.load([page_hash(key)], [0], _capi.LOAD_WAIT_COMPLETE) != 1:
                return None
            raw = b"".join(s.read_object(0, part) for part in self._flat_parts())
        except KvtierError as e:
            logger.warning("kvtier get failed: %s", e)
            return None
        page = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if target_location is None:
            return page.view(self.mem_pool_host.dtype)
        target_location.view(torch.uint8).copy_(page)
        return target_location

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        targets = target_locations or [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def clear(self):
        """kvtier's tiers are shared with other engines; a backend never clears them."""

    def close(self):
        if self._link is not None:
            self._link.close()
        if self._staging is not None:
            self._staging.close()
