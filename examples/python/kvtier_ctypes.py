"""kvtier_ctypes: a ctypes wrapper of kvtier's C ABI (include/kvtier.h).

Needs only the standard library and the built ``libkvtier.so`` (``cargo build`` makes it;
point ``KVTIER_LIB`` at it, or pass ``lib_path``). Every failed call raises
:class:`KvtierError` carrying the stable code of ``kvtier.h`` and the library's message.
Page hashes are ``bytes`` of 8 to 32 bytes, or ``int`` block hashes (packed as 8-byte
big-endian, the same page as a Rust ``PageHash::from_u64``).
"""

import ctypes
import os
from ctypes import POINTER, Structure, byref, c_char_p, c_int32, c_size_t, c_uint8, c_uint16, c_uint32, c_uint64

OK = 0
ERR_NULL = -1
ERR_INVALID = -2
ERR_EMPTY_BATCH = -3
ERR_LENGTH_MISMATCH = -4
ERR_UNAVAILABLE = -5
ERR_TIMEOUT = -6
ERR_DEVICE = -9
ERR_UNSUPPORTED = -13
ERR_REMOTE_BASE = -100

PART_K, PART_V, PART_LATENT = 0, 1, 2
TIER_DEVICE, TIER_HOST, TIER_POOL = 0, 1, 2
LOAD_BEST_EFFORT, LOAD_WAIT_COMPLETE, LOAD_TIMEOUT = 0, 1, 2
PHASE_REASONING, PHASE_ACTING, PHASE_PAUSED, PHASE_ENDED = 0, 1, 2, 3
HINT_SHARE, HINT_PREFETCH, HINT_DEMOTE, HINT_PIN, HINT_RETAIN = 1, 2, 3, 4, 5
TARGET_PAGES, TARGET_PREFIX, TARGET_SESSION = 0, 1, 2
OUTCOMES = ("accepted", "clipped", "deferred", "ignored")


class KvtierError(Exception):
    """A failed kvtier call: ``code`` is a KVTIER_ERR_* value."""

    def __init__(self, code, message):
        super().__init__(f"[code {code}] {message}")
        self.code = code
        self.message = message


class ConnectOptions(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("socket", c_char_p),
        ("instance", c_char_p),
        ("model", c_char_p),
        ("lora", c_char_p),
        ("salt", c_char_p),
        ("tp_rank", c_uint16),
        ("tp_size", c_uint16),
        ("pp_rank", c_uint16),
        ("pp_size", c_uint16),
        ("dp_rank", c_uint16),
        ("layers", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype_bytes", c_uint32),
        ("page_tokens", c_uint32),
        ("attention", c_uint32),
        ("byte_order", c_uint32),
        ("timeout_ms", c_uint32),
    ]


class PrefixHit(Structure):
    _fields_ = [("device", c_uint64), ("host", c_uint64), ("pool", c_uint64)]


class StoreReceipt(Structure):
    _fields_ = [("ticket", c_uint64), ("written", c_uint64), ("complete", c_uint32)]


class TicketStatus(Structure):
    _fields_ = [("complete", c_uint32), ("total", c_uint32), ("failed", c_uint32)]


class Hint(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("kind", c_uint32),
        ("target", c_uint32),
        ("hashes", POINTER(c_uint8)),
        ("hash_len", c_size_t),
        ("count", c_size_t),
        ("session", c_char_p),
        ("tier", c_uint32),
        ("priority", c_int32),
        ("ttl_ms", c_uint64),
        ("deadline_ms", c_uint64),
    ]


class HintOutcome(Structure):
    _fields_ = [("outcome", c_uint32), ("reason", c_uint32), ("applied", c_uint64), ("requested", c_uint64)]


_SIGNATURES = {
    "kvtier_last_error": ([], c_char_p),
    "kvtier_error_name": ([c_int32], c_char_p),
    "kvtier_connect": ([POINTER(ConnectOptions), POINTER(ctypes.c_void_p)], c_int32),
    "kvtier_close": ([ctypes.c_void_p], c_int32),
    "kvtier_register_emulated": ([ctypes.c_void_p, c_uint32], c_int32),
    "kvtier_register_cuda": ([ctypes.c_void_p, c_uint32, c_uint32], c_int32),
    "kvtier_register_cuda_tensors": (
        [ctypes.c_void_p, c_uint32, POINTER(c_uint64), c_size_t, c_uint64, c_uint32, c_uint64],
        c_int32,
    ),
    "kvtier_object_bytes": ([ctypes.c_void_p, POINTER(c_size_t)], c_int32),
    "kvtier_device_fill_page": ([ctypes.c_void_p, c_uint32, c_uint64], c_int32),
    "kvtier_device_page_matches": ([ctypes.c_void_p, c_uint32, c_uint64, POINTER(c_int32)], c_int32),
    "kvtier_device_write_object": ([ctypes.c_void_p, c_uint32, c_uint32, ctypes.c_char_p, c_size_t], c_int32),
    "kvtier_device_read_object": ([ctypes.c_void_p, c_uint32, c_uint32, ctypes.c_void_p, c_size_t], c_int32),
    "kvtier_lookup": ([ctypes.c_void_p, ctypes.c_char_p, c_size_t, c_size_t, POINTER(PrefixHit)], c_int32),
    "kvtier_store": (
        [ctypes.c_void_p, ctypes.c_char_p, c_size_t, c_size_t, POINTER(c_uint32), c_size_t, c_char_p,
         POINTER(StoreReceipt)],
        c_int32,
    ),
    "kvtier_load": (
        [ctypes.c_void_p, ctypes.c_char_p, c_size_t, c_size_t, POINTER(c_uint32), c_size_t, c_uint32, c_uint32,
         POINTER(c_size_t)],
        c_int32,
    ),
    "kvtier_poll": ([ctypes.c_void_p, c_uint64, POINTER(TicketStatus)], c_int32),
    "kvtier_wait": ([ctypes.c_void_p, c_uint64, c_uint32, POINTER(TicketStatus)], c_int32),
    "kvtier_removed": ([ctypes.c_void_p, ctypes.c_char_p, c_size_t, c_size_t], c_int32),
    "kvtier_session": ([ctypes.c_void_p, c_char_p, c_char_p, c_uint32], c_int32),
    "kvtier_hint": ([ctypes.c_void_p, POINTER(Hint), POINTER(HintOutcome)], c_int32),
}


def load_library(lib_path=None):
    """Loads libkvtier.so and declares every function's signature."""
    path = lib_path or os.environ.get("KVTIER_LIB") or "libkvtier.so"
    lib = ctypes.CDLL(path)
    for name, (args, ret) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ret
    return lib


def pack_hashes(hashes):
    """A batch of hashes as (bytes, hash_len, count); all hashes must have one length."""
    raw = [h.to_bytes(8, "big") if isinstance(h, int) else bytes(h) for h in hashes]
    hash_len = len(raw[0]) if raw else 8
    if any(len(r) != hash_len for r in raw):
        raise ValueError("all hashes of a batch must have the same length")
    return b"".join(raw), hash_len, len(raw)


class Client:
    """One engine rank connected to the kvtier daemon."""

    def __init__(self, lib, socket, instance, model, tp_rank=0, tp_size=1, layout=(4, 4, 16, 2, 4),
                 timeout_ms=10000, pp_rank=0, pp_size=1):
        self.lib = lib
        layers, kv_heads, head_dim, dtype_bytes, page_tokens = layout
        opts = ConnectOptions(
            ctypes.sizeof(ConnectOptions), os.fsencode(socket), instance.encode(), model.encode(), None, None,
            tp_rank, tp_size, pp_rank, pp_size, 0, layers, kv_heads, head_dim, dtype_bytes, page_tokens,
            0, 0, timeout_ms,
        )
        self.handle = ctypes.c_void_p()
        self._check(lib.kvtier_connect(byref(opts), byref(self.handle)))

    def _check(self, rc):
        if rc != OK:
            raise KvtierError(rc, self.lib.kvtier_last_error().decode(errors="replace"))

    def close(self):
        if self.handle:
            self._check(self.lib.kvtier_close(self.handle))
            self.handle = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def register_emulated(self, pages):
        self._check(self.lib.kvtier_register_emulated(self.handle, pages))

    def register_cuda(self, ordinal, pages):
        self._check(self.lib.kvtier_register_cuda(self.handle, ordinal, pages))

    def register_cuda_tensors(self, ordinal, ptrs, page_stride, pages, stream=0):
        """Registers the engine's own KV tensors (device addresses, see kvtier.h and
        ``kvtier_torch.py``, which builds them from torch tensors)."""
        arr = (c_uint64 * len(ptrs))(*ptrs)
        self._check(self.lib.kvtier_register_cuda_tensors(
            self.handle, ordinal, arr, len(ptrs), page_stride, pages, stream))

    def object_bytes(self):
        n = c_size_t()
        self._check(self.lib.kvtier_object_bytes(self.handle, byref(n)))
        return n.value

    def fill_page(self, slot, seed):
        self._check(self.lib.kvtier_device_fill_page(self.handle, slot, seed))

    def page_matches(self, slot, seed):
        m = c_int32()
        self._check(self.lib.kvtier_device_page_matches(self.handle, slot, seed, byref(m)))
        return bool(m.value)

    def write_object(self, slot, part, data):
        self._check(self.lib.kvtier_device_write_object(self.handle, slot, part, bytes(data), len(data)))

    def read_object(self, slot, part):
        buf = ctypes.create_string_buffer(self.object_bytes())
        self._check(self.lib.kvtier_device_read_object(self.handle, slot, part, buf, len(buf)))
        return buf.raw

    def lookup(self, hashes):
        raw, hl, n = pack_hashes(hashes)
        hit = PrefixHit()
        self._check(self.lib.kvtier_lookup(self.handle, raw, hl, n, byref(hit)))
        return hit.device, hit.host, hit.pool

    def store(self, hashes, slots, session=""):
        raw, hl, n = pack_hashes(hashes)
        arr = (c_uint32 * len(slots))(*slots)
        r = StoreReceipt()
        self._check(self.lib.kvtier_store(self.handle, raw, hl, n, arr, len(slots), session.encode(), byref(r)))
        return r.ticket, r.written, r.complete

    def load(self, hashes, slots, wait=LOAD_WAIT_COMPLETE, wait_ms=0):
        raw, hl, n = pack_hashes(hashes)
        arr = (c_uint32 * len(slots))(*slots)
        loaded = c_size_t()
        self._check(self.lib.kvtier_load(self.handle, raw, hl, n, arr, len(slots), wait, wait_ms, byref(loaded)))
        return loaded.value

    def poll(self, ticket):
        t = TicketStatus()
        self._check(self.lib.kvtier_poll(self.handle, ticket, byref(t)))
        return t.complete, t.total, t.failed

    def wait(self, ticket, timeout_ms=5000):
        t = TicketStatus()
        self._check(self.lib.kvtier_wait(self.handle, ticket, timeout_ms, byref(t)))
        return t.complete, t.total, t.failed

    def removed(self, hashes):
        raw, hl, n = pack_hashes(hashes)
        self._check(self.lib.kvtier_removed(self.handle, raw, hl, n))

    def session(self, session_id, parent=None, phase=PHASE_REASONING):
        self._check(self.lib.kvtier_session(self.handle, session_id.encode(),
                                            parent.encode() if parent else None, phase))

    def hint(self, kind, hashes=(), target=TARGET_PAGES, session=None, tier=TIER_HOST, priority=0, ttl_ms=1000,
             deadline_ms=0):
        """Sends a hint; returns (outcome name, applied pages, reason code)."""
        raw, hl, n = pack_hashes(list(hashes)) if hashes else (b"", 8, 0)
        buf = (c_uint8 * max(len(raw), 1)).from_buffer_copy(raw or b"\0")
        h = Hint(ctypes.sizeof(Hint), kind, target, buf, hl, n, session.encode() if session else None, tier,
                 priority, ttl_ms, deadline_ms)
        o = HintOutcome()
        self._check(self.lib.kvtier_hint(self.handle, byref(h), byref(o)))
        return OUTCOMES[o.outcome], o.applied, o.reason
