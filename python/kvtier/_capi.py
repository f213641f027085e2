"""ctypes declarations of kvtier's C ABI (``include/kvtier.h``) and the library lookup.

Nothing here holds state beyond the loaded library: :mod:`kvtier.client` builds the
Python API on top. The library is the ``libkvtier.so`` shipped inside the package; the
``KVTIER_LIB`` environment variable overrides it (a freshly built library in a checkout).
"""

import ctypes
import os
import threading
from ctypes import POINTER, Structure, c_char_p, c_int32, c_size_t, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p
from pathlib import Path

OK = 0
ERR_NULL = -1
ERR_INVALID = -2
ERR_EMPTY_BATCH = -3
ERR_LENGTH_MISMATCH = -4
ERR_UNAVAILABLE = -5
ERR_TIMEOUT = -6
ERR_PROTOCOL = -7
ERR_ARENA = -8
ERR_DEVICE = -9
ERR_LAYOUT = -10
ERR_INTERNAL = -11
ERR_BUFFER_TOO_SMALL = -12
ERR_UNSUPPORTED = -13
ERR_CLOSED = -14
ERR_UNTRUSTED = -15
ERR_REMOTE_BASE = -100

PART_K, PART_V, PART_LATENT = 0, 1, 2
TIER_DEVICE, TIER_HOST, TIER_POOL = 0, 1, 2
LOAD_BEST_EFFORT, LOAD_WAIT_COMPLETE, LOAD_TIMEOUT = 0, 1, 2
PHASE_REASONING, PHASE_ACTING, PHASE_PAUSED, PHASE_ENDED = 0, 1, 2, 3
ADVICE_EVICT_FIRST, ADVICE_OFFLOAD, ADVICE_READY_TO_LOAD, ADVICE_PAUSE, ADVICE_RESUME = 0, 1, 2, 3, 4
HINT_SHARE, HINT_PREFETCH, HINT_DEMOTE, HINT_PIN, HINT_RETAIN = 1, 2, 3, 4, 5
TARGET_PAGES, TARGET_PREFIX, TARGET_SESSION = 0, 1, 2
ATTENTION_MHA, ATTENTION_MLA = 0, 1
ORDER_LAYER_FIRST, ORDER_PAGE_FIRST = 0, 1
OUTCOMES = ("accepted", "clipped", "deferred", "ignored")

LIB_NAME = "libkvtier.so"


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
        ("dtype", c_uint32),
        ("kv_order", c_uint32),
        ("has_daemon_uid", c_uint32),
        ("daemon_uid", c_uint32),
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


_H = c_void_p
SIGNATURES = {
    "kvtier_last_error": ([], c_char_p),
    "kvtier_error_name": ([c_int32], c_char_p),
    "kvtier_default_socket": ([c_char_p, POINTER(c_size_t)], c_int32),
    "kvtier_connect": ([POINTER(ConnectOptions), POINTER(c_void_p)], c_int32),
    "kvtier_close": ([_H], c_int32),
    "kvtier_register_emulated": ([_H, c_uint32], c_int32),
    "kvtier_register_cuda": ([_H, c_uint32, c_uint32], c_int32),
    "kvtier_register_cuda_tensors": ([_H, c_uint32, POINTER(c_uint64), c_size_t, c_uint64, c_uint32, c_uint64], c_int32),
    "kvtier_register_host_tensors": ([_H, POINTER(c_uint64), c_size_t, c_uint64, c_uint32], c_int32),
    "kvtier_register_cuda_tensor_runs": ([_H, c_uint32, POINTER(c_uint64), c_size_t, c_uint64, c_uint32, c_uint32,
                                          c_uint64, c_uint64], c_int32),
    "kvtier_register_host_tensor_runs": ([_H, POINTER(c_uint64), c_size_t, c_uint64, c_uint32, c_uint32, c_uint64],
                                         c_int32),
    "kvtier_object_bytes": ([_H, POINTER(c_size_t)], c_int32),
    "kvtier_device_fill_page": ([_H, c_uint32, c_uint64], c_int32),
    "kvtier_device_page_matches": ([_H, c_uint32, c_uint64, POINTER(c_int32)], c_int32),
    "kvtier_device_write_object": ([_H, c_uint32, c_uint32, c_char_p, c_size_t], c_int32),
    "kvtier_device_read_object": ([_H, c_uint32, c_uint32, c_void_p, c_size_t], c_int32),
    "kvtier_lookup": ([_H, c_char_p, c_size_t, c_size_t, POINTER(PrefixHit)], c_int32),
    "kvtier_store": (
        [_H, c_char_p, c_size_t, c_size_t, POINTER(c_uint32), c_size_t, c_char_p, POINTER(StoreReceipt)],
        c_int32,
    ),
    "kvtier_store_tokens": (
        [_H, c_char_p, c_size_t, c_size_t, POINTER(c_uint32), c_size_t, c_char_p, c_char_p, POINTER(c_uint32),
         c_size_t, POINTER(StoreReceipt)],
        c_int32,
    ),
    "kvtier_load": (
        [_H, c_char_p, c_size_t, c_size_t, POINTER(c_uint32), c_size_t, c_uint32, c_uint32, POINTER(c_size_t)],
        c_int32,
    ),
    "kvtier_poll": ([_H, c_uint64, POINTER(TicketStatus)], c_int32),
    "kvtier_wait": ([_H, c_uint64, c_uint32, POINTER(TicketStatus)], c_int32),
    "kvtier_removed": ([_H, c_char_p, c_size_t, c_size_t], c_int32),
    "kvtier_session": ([_H, c_char_p, c_char_p, c_uint32], c_int32),
    "kvtier_request_end": ([_H, c_char_p, c_char_p, c_uint64, c_uint64, c_char_p, c_size_t, c_size_t], c_int32),
    "kvtier_hint": ([_H, POINTER(Hint), POINTER(HintOutcome)], c_int32),
    "kvtier_kv_hints": ([_H, c_char_p, c_void_p, c_size_t, POINTER(c_size_t)], c_int32),
    "kvtier_take_advice": ([_H, c_uint32, c_void_p, c_size_t, POINTER(c_size_t)], c_int32),
}

_lock = threading.Lock()
_lib = None


def library_path():
    """Where the library is loaded from: ``KVTIER_LIB``, else the packaged copy."""
    env = os.environ.get("KVTIER_LIB")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / LIB_NAME


def lib():
    """The loaded library, with every signature declared (loaded once per process)."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            if not path.is_file():
                raise ImportError(
                    f"kvtier's native library is missing at {path}: install the package with "
                    "`pip install ./python` from a kvtier checkout (it builds and ships it), "
                    "or set KVTIER_LIB to a built libkvtier.so"
                )
            loaded = ctypes.CDLL(str(path))
            for name, (args, ret) in SIGNATURES.items():
                fn = getattr(loaded, name)
                fn.argtypes = args
                fn.restype = ret
            _lib = loaded
        return _lib


def last_error():
    return lib().kvtier_last_error().decode(errors="replace")


def error_name(code):
    return lib().kvtier_error_name(code).decode()
