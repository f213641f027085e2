"""One engine rank connected to a running ``kvtier serve``, over the C ABI.

:class:`Client` is the low-level client the vLLM connector and the SGLang backend use: it
owns one C handle, raises :mod:`kvtier.errors` exceptions carrying the C code, closes
idempotently (``close()`` twice is fine; any other call after it raises
:class:`~kvtier.errors.ClosedError`, answered by the library itself, never a crash), and is
a context manager. Page hashes are ``bytes`` of 8 to 32 bytes, or ``int`` block hashes
(packed 8-byte big-endian, like Rust's ``PageHash::from_u64``).
"""

import ctypes
import json
import os
from collections import namedtuple
from ctypes import byref, c_int32, c_size_t, c_uint8, c_uint32, c_uint64
from dataclasses import dataclass
from pathlib import Path

from . import _capi
from .errors import InvalidArgumentError, UnavailableError, check, from_code

PrefixHit = namedtuple("PrefixHit", "device host pool")
StoreReceipt = namedtuple("StoreReceipt", "ticket written complete")
TicketStatus = namedtuple("TicketStatus", "complete total failed")
HintOutcome = namedtuple("HintOutcome", "outcome applied requested reason")

#: Room for an envelope's report: 64 actions (the daemon's limit) of ids and endpoints of
#: up to 512 bytes fit many times over. The report cannot be fetched again after the
#: envelope is applied, so it is sized once, generously.
_REPORT_CAP = 1 << 20

_PHASES = {"reasoning": 0, "acting": 1, "paused": 2, "ended": 3}


def default_socket():
    """The daemon's default socket, as ``kvtier serve`` picks it (the library's own answer,
    ``kvtier_default_socket``): ``KVTIER_SOCKET`` when set, else ``kvtier.sock`` in
    ``$XDG_RUNTIME_DIR/kvtier``, else in ``/run/user/<uid>/kvtier`` when that is this user's
    private directory, else in ``./.kvtier``."""
    lib = _capi.lib()
    need = c_size_t(0)
    lib.kvtier_default_socket(None, byref(need))
    buf = ctypes.create_string_buffer(need.value)
    check(lib.kvtier_default_socket(buf, byref(need)))
    return Path(os.fsdecode(buf.value))


#: kvtier's dtype names (``KVTIER_DTYPE_*`` order) and the other names each is known by
#: (torch's, numpy's).
DTYPES = {
    None: (),
    "f16": ("float16", "half"),
    "bf16": ("bfloat16",),
    "f32": ("float32", "float"),
    "fp8_e4m3": ("float8_e4m3fn", "float8_e4m3"),
    "fp8_e5m2": ("float8_e5m2",),
    "u8": ("uint8",),
}
#: Orders of the bytes inside one page of one (part, layer) (``KVTIER_KV_ORDER_*`` order).
KV_ORDERS = ("nhd", "hnd", "packed-nhd", "packed-hnd")


def dtype_name(dtype):
    """kvtier's name of ``dtype``: one of :data:`DTYPES`' keys, from that name, torch's or
    numpy's name, or a torch or numpy dtype; None stays None (unspecified)."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    for key, aliases in DTYPES.items():
        if key is not None and (name == key or name in aliases):
            return key
    raise InvalidArgumentError(_capi.ERR_INVALID, f"dtype {dtype!r} is not one kvtier keys pages by "
                               f"({[k for k in DTYPES if k]})", "invalid")


@dataclass(frozen=True)
class Layout:
    """The KV geometry of one model as kvtier sees it: a page is ``page_tokens`` tokens of
    ``layers`` x (K and V, or one MLA latent) x ``kv_heads`` x ``head_dim`` elements of
    ``dtype_bytes`` bytes.

    ``dtype`` (``"bf16"``, ``"f16"``, a torch dtype, ...; see :func:`dtype_name`) and
    ``kv_order`` (:data:`KV_ORDERS`) are part of a page's identity: pages written under one
    are never offered to an engine with another. ``dtype=None`` gives only the width."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    page_tokens: int
    mla: bool = False
    page_first: bool = False
    dtype: object = None
    kv_order: str = "nhd"

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.kv_order not in KV_ORDERS:
            raise InvalidArgumentError(_capi.ERR_INVALID, f"kv_order {self.kv_order!r} is not one of {KV_ORDERS}",
                                       "invalid")

    @property
    def parts(self):
        return 1 if self.mla else 2

    @property
    def run_bytes(self):
        """Bytes of one page of one (part, layer)."""
        return self.page_tokens * self.kv_heads * self.head_dim * self.dtype_bytes


def pack_hashes(hashes):
    """A batch of hashes as (bytes, hash_len, count); all hashes must have one length."""
    raw = [h.to_bytes(8, "big") if isinstance(h, int) else bytes(h) for h in hashes]
    if not raw:
        raise InvalidArgumentError(_capi.ERR_EMPTY_BATCH, "the batch names no pages", "empty_batch")
    hash_len = len(raw[0])
    if any(len(r) != hash_len for r in raw):
        raise InvalidArgumentError(_capi.ERR_INVALID, "all hashes of a batch must have the same length", "invalid")
    return b"".join(raw), hash_len, len(raw)


class Client:
    """One engine rank connected to the kvtier daemon at ``socket``.

    Before anything is sent, the process serving the socket (its ``SO_PEERCRED``) and the
    arena file it names must belong to the daemon's uid: ``daemon_uid``, else the
    ``KVTIER_DAEMON_UID`` environment variable (how an engine's connector is told), else
    this process's own uid; otherwise :class:`~kvtier.errors.UntrustedError`."""

    def __init__(self, layout, socket=None, instance="python", model="model", tp_rank=0, tp_size=1, pp_rank=0,
                 pp_size=1, dp_rank=0, lora=None, salt=None, timeout_ms=5000, daemon_uid=None):
        self._lib = _capi.lib()
        self.layout = layout
        self.socket = Path(socket) if socket else default_socket()
        if daemon_uid is None and os.environ.get("KVTIER_DAEMON_UID"):
            daemon_uid = int(os.environ["KVTIER_DAEMON_UID"])
        opts = _capi.ConnectOptions(
            ctypes.sizeof(_capi.ConnectOptions), os.fsencode(self.socket), instance.encode(), model.encode(),
            lora.encode() if lora else None, salt.encode() if salt else None,
            tp_rank, tp_size, pp_rank, pp_size, dp_rank,
            layout.layers, layout.kv_heads, layout.head_dim, layout.dtype_bytes, layout.page_tokens,
            _capi.ATTENTION_MLA if layout.mla else _capi.ATTENTION_MHA,
            _capi.ORDER_PAGE_FIRST if layout.page_first else _capi.ORDER_LAYER_FIRST,
            timeout_ms,
            list(DTYPES).index(layout.dtype),
            KV_ORDERS.index(layout.kv_order),
            0 if daemon_uid is None else 1, daemon_uid or 0,
        )
        self._handle = ctypes.c_void_p()
        self._closed = True
        rc = self._lib.kvtier_connect(byref(opts), byref(self._handle))
        if rc == _capi.ERR_UNAVAILABLE:
            raise UnavailableError(
                rc, f"no kvtier daemon answers at socket {self.socket} (is `kvtier serve` running?): "
                f"{_capi.last_error()}")
        check(rc)
        self._closed = False

    # -- lifetime ------------------------------------------------------------------------
    @property
    def closed(self):
        return self._closed

    def close(self):
        """Closes the handle; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        check(self._lib.kvtier_close(self._handle))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
            pass

    @property
    def raw_handle(self):
        """The C handle (an opaque id): a closed one still reaches the library, which
        answers ``KVTIER_ERR_CLOSED``."""
        return self._handle

    # -- memory kvtier copies into and out of --------------------------------------------
    def register_emulated(self, pages):
        check(self._lib.kvtier_register_emulated(self._handle, pages))

    def register_cuda(self, ordinal, pages):
        check(self._lib.kvtier_register_cuda(self._handle, ordinal, pages))

    def register_cuda_tensors(self, ordinal, ptrs, page_stride, pages, stream=0, runs=1, run_stride=0):
        """The engine's own KV tensors on GPU ``ordinal`` (addresses: ``include/kvtier.h``);
        ``runs`` > 1 says each page of a tensor is that many equal runs ``run_stride``
        bytes apart."""
        arr = (c_uint64 * len(ptrs))(*ptrs)
        if runs == 1:
            check(self._lib.kvtier_register_cuda_tensors(self._handle, ordinal, arr, len(ptrs), page_stride, pages,
                                                         stream))
        else:
            check(self._lib.kvtier_register_cuda_tensor_runs(self._handle, ordinal, arr, len(ptrs), page_stride,
                                                             pages, runs, run_stride, stream))

    def register_host_tensors(self, ptrs, page_stride, pages, runs=1, run_stride=0):
        """The engine's own KV tensors in host memory; kvtier copies pages straight into
        and out of them. They must stay allocated while registered. ``runs`` as for
        :meth:`register_cuda_tensors`."""
        arr = (c_uint64 * len(ptrs))(*ptrs)
        if runs == 1:
            check(self._lib.kvtier_register_host_tensors(self._handle, arr, len(ptrs), page_stride, pages))
        else:
            check(self._lib.kvtier_register_host_tensor_runs(self._handle, arr, len(ptrs), page_stride, pages, runs,
                                                             run_stride))

    def object_bytes(self):
        n = c_size_t()
        check(self._lib.kvtier_object_bytes(self._handle, byref(n)))
        return n.value

    def fill_page(self, slot, seed):
        check(self._lib.kvtier_device_fill_page(self._handle, slot, seed))

    def page_matches(self, slot, seed):
        m = c_int32()
        check(self._lib.kvtier_device_page_matches(self._handle, slot, seed, byref(m)))
        return bool(m.value)

    def write_object(self, slot, part, data):
        data = bytes(data)
        check(self._lib.kvtier_device_write_object(self._handle, slot, part, data, len(data)))

    def read_object(self, slot, part):
        buf = ctypes.create_string_buffer(self.object_bytes())
        check(self._lib.kvtier_device_read_object(self._handle, slot, part, buf, len(buf)))
        return buf.raw

    # -- pages ---------------------------------------------------------------------------
    def lookup(self, hashes):
        raw, hl, n = pack_hashes(hashes)
        hit = _capi.PrefixHit()
        check(self._lib.kvtier_lookup(self._handle, raw, hl, n, byref(hit)))
        return PrefixHit(hit.device, hit.host, hit.pool)

    def store(self, hashes, slots, session="", tokens=None, parent=None):
        """Offloads pages: ``slots[i]`` holds page ``hashes[i]`` in the registered region.

        ``tokens``, when given, are the token ids of the pages, the same count for each
        (page ``i`` holds ``tokens[i * k:(i + 1) * k]``); the daemon's ``BlockStored``
        events then carry them, which token-indexing routers (Dynamo's) need. ``parent``
        is the hash of the page before ``hashes[0]`` in its chain (same length), if any;
        the events then chain the batch to it. It goes with ``tokens`` (the daemon keeps
        a parent only with token ids)."""
        raw, hl, n = pack_hashes(hashes)
        arr = (c_uint32 * len(slots))(*slots)
        r = _capi.StoreReceipt()
        sess = (session or "").encode()
        if tokens is None:
            if parent is not None:
                raise InvalidArgumentError(_capi.ERR_INVALID, "a parent hash goes with token ids", "invalid")
            check(self._lib.kvtier_store(self._handle, raw, hl, n, arr, len(slots), sess, byref(r)))
            return StoreReceipt(r.ticket, r.written, r.complete)
        tokens = list(tokens)
        if not tokens or len(tokens) % n:
            raise InvalidArgumentError(_capi.ERR_LENGTH_MISMATCH, f"{len(tokens)} token ids do not split evenly "
                                       f"over {n} pages", "length_mismatch")
        if any(not 0 <= t < 1 << 32 for t in tokens):
            raise InvalidArgumentError(_capi.ERR_INVALID, "token ids must be in 0..2^32", "invalid")
        toks, per_page = (c_uint32 * len(tokens))(*tokens), len(tokens) // n
        parent_raw = None
        if parent is not None:
            parent_raw = parent.to_bytes(8, "big") if isinstance(parent, int) else bytes(parent)
            if len(parent_raw) != hl:
                raise InvalidArgumentError(_capi.ERR_INVALID, f"the parent hash has {len(parent_raw)} bytes, the "
                                           f"pages' hashes {hl}", "invalid")
        check(self._lib.kvtier_store_tokens(self._handle, raw, hl, n, arr, len(slots), sess, parent_raw, toks,
                                            per_page, byref(r)))
        return StoreReceipt(r.ticket, r.written, r.complete)

    def load(self, hashes, slots, wait=_capi.LOAD_WAIT_COMPLETE, wait_ms=0):
        """Loads the leading pages complete on host into ``slots``; returns how many."""
        raw, hl, n = pack_hashes(hashes)
        arr = (c_uint32 * len(slots))(*slots)
        loaded = c_size_t()
        check(self._lib.kvtier_load(self._handle, raw, hl, n, arr, len(slots), wait, wait_ms, byref(loaded)))
        return loaded.value

    def poll(self, ticket):
        t = _capi.TicketStatus()
        check(self._lib.kvtier_poll(self._handle, ticket, byref(t)))
        return TicketStatus(t.complete, t.total, t.failed)

    def wait(self, ticket, timeout_ms=5000):
        t = _capi.TicketStatus()
        check(self._lib.kvtier_wait(self._handle, ticket, timeout_ms, byref(t)))
        return TicketStatus(t.complete, t.total, t.failed)

    def removed(self, hashes):
        raw, hl, n = pack_hashes(hashes)
        check(self._lib.kvtier_removed(self._handle, raw, hl, n))

    # -- sessions and hints --------------------------------------------------------------
    def session(self, session_id, parent=None, phase="reasoning"):
        """Announces a session's phase at a tool boundary (``reasoning``, ``acting``,
        ``paused``, ``ended``); ``parent`` links a sub-agent to its parent session."""
        code = _PHASES.get(phase) if isinstance(phase, str) else phase
        if code is None:
            raise from_code(_capi.ERR_INVALID, f"phase {phase!r} is not one of {sorted(_PHASES)}")
        check(self._lib.kvtier_session(self._handle, session_id.encode(), parent.encode() if parent else None, code))

    def request_end(self, session_id, hashes, input_length=0, output_length=0, parent=None):
        """A request of session ``session_id`` ended: its prompt's page hashes (at least
        one) and token counts, never content, for the session's lineage and the daemon's
        request traces."""
        raw, hl, n = pack_hashes(hashes)
        check(self._lib.kvtier_request_end(self._handle, session_id.encode(), parent.encode() if parent else None,
                                           input_length, output_length, raw, hl, n))

    def kv_hints(self, envelope):
        """Passes on a Dynamo KvHint envelope (a ``dict`` or JSON text, as a router attached
        it to a request). ``kv.fetch@1.x`` becomes a prefetch to host; other actions and
        versions are ignored with a reason. Returns the daemon's report: ``message_id`` and
        ``actions``, each with ``action_id``, ``pages`` and ``outcome`` (``{"outcome":
        "accepted", "pages": n}``, ``{"outcome": "ignored", "reason": ...}``, ...) or
        ``error``. A malformed envelope raises :class:`~kvtier.errors.RemoteError`."""
        text = envelope if isinstance(envelope, str) else json.dumps(envelope)
        buf = ctypes.create_string_buffer(_REPORT_CAP)
        n = c_size_t()
        check(self._lib.kvtier_kv_hints(self._handle, text.encode(), buf, len(buf), byref(n)))
        return json.loads(buf.raw[:n.value])

    def take_advice(self, max_pages=4096):
        """Takes the advice the daemon holds for this rank's namespace, oldest first:
        ``{"more": bool, "advice": [...]}``, each entry a ``dict`` with ``kind``
        (``kvtier.ADVICE_*``), ``name`` (``evict_first``, ``offload``, ``ready_to_load``,
        ``pause``, ``resume``) and either ``hashes`` (hex page hashes) or ``session_id``
        (a session the daemon's pressure controller paused or let resume: stop or start
        admitting its turns). Advice is taken once, so ask from one rank; when ``more``
        is true, ask again."""
        cap = _REPORT_CAP
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = c_size_t()
            code = self._lib.kvtier_take_advice(self._handle, max_pages, buf, len(buf), byref(n))
            if code == _capi.ERR_BUFFER_TOO_SMALL:
                # Kept by the library for the next call: ask again with room for it.
                cap = n.value + 1
                continue
            check(code)
            return json.loads(buf.raw[:n.value])
        check(code)

    def hint(self, kind, hashes=(), target=_capi.TARGET_PAGES, session=None, tier=_capi.TIER_HOST, priority=0,
             ttl_ms=1000, deadline_ms=0):
        """Sends a hint (``kvtier.HINT_*``); returns its :class:`HintOutcome`."""
        hashes = list(hashes)
        raw, hl, n = pack_hashes(hashes) if hashes else (b"", 8, 0)
        buf = (c_uint8 * max(len(raw), 1)).from_buffer_copy(raw or b"\0")
        h = _capi.Hint(ctypes.sizeof(_capi.Hint), kind, target, buf, hl, n, session.encode() if session else None,
                       tier, priority, ttl_ms, deadline_ms)
        o = _capi.HintOutcome()
        check(self._lib.kvtier_hint(self._handle, byref(h), byref(o)))
        return HintOutcome(_capi.OUTCOMES[o.outcome], o.applied, o.requested, o.reason)
