"""kvtier: the engine side of the per-node KV-cache tier manager.

``kvtier.Client`` connects one engine rank to a running ``kvtier serve`` through the C ABI
of the ``libkvtier.so`` shipped inside this package. The engine integrations import their
engine only when used: ``kvtier.vllm.KvtierConnector`` (vLLM 0.33 KV connector) and
``kvtier.sglang.KvtierStorage`` (SGLang 0.5.23 HiCache storage backend).
"""

from ._capi import (
    ADVICE_EVICT_FIRST,
    ADVICE_OFFLOAD,
    ADVICE_PAUSE,
    ADVICE_READY_TO_LOAD,
    ADVICE_RESUME,
    HINT_DEMOTE,
    HINT_PIN,
    HINT_PREFETCH,
    HINT_RETAIN,
    HINT_SHARE,
    LOAD_BEST_EFFORT,
    LOAD_TIMEOUT,
    LOAD_WAIT_COMPLETE,
    PART_K,
    PART_LATENT,
    PART_V,
    TARGET_PAGES,
    TARGET_PREFIX,
    TARGET_SESSION,
    TIER_DEVICE,
    TIER_HOST,
    TIER_POOL,
    library_path,
)
from ._version import __version__
from .client import Client, Layout, PrefixHit, StoreReceipt, TicketStatus, default_socket, pack_hashes
from .errors import (
    ClosedError,
    DaemonTimeoutError,
    DeviceError,
    InvalidArgumentError,
    KvtierError,
    LayoutError,
    RecoveringError,
    RemoteError,
    UnavailableError,
    UnsupportedError,
    UntrustedError,
)

__all__ = [
    "Client", "Layout", "PrefixHit", "StoreReceipt", "TicketStatus", "default_socket", "pack_hashes", "library_path",
    "KvtierError", "ClosedError", "DaemonTimeoutError", "DeviceError", "InvalidArgumentError", "LayoutError",
    "RecoveringError", "RemoteError", "UnavailableError", "UnsupportedError", "UntrustedError", "__version__",
    "HINT_DEMOTE", "HINT_PIN", "HINT_PREFETCH", "HINT_RETAIN", "HINT_SHARE", "LOAD_BEST_EFFORT", "LOAD_TIMEOUT",
    "LOAD_WAIT_COMPLETE", "PART_K", "PART_LATENT", "PART_V", "TARGET_PAGES", "TARGET_PREFIX", "TARGET_SESSION",
    "TIER_DEVICE", "TIER_HOST", "TIER_POOL",
    "ADVICE_EVICT_FIRST", "ADVICE_OFFLOAD", "ADVICE_READY_TO_LOAD", "ADVICE_PAUSE", "ADVICE_RESUME",
]
