"""Python exceptions for kvtier's C ABI codes.

Every failed call raises a :class:`KvtierError` subclass that carries the stable integer
``code`` of ``include/kvtier.h``, its ``name`` (``"unavailable"``, ``"closed"``, ...) and
the library's message, so callers can branch on the class or on the code.
"""

from . import _capi


class KvtierError(Exception):
    """A failed kvtier call: ``code`` is a ``KVTIER_ERR_*`` value."""

    def __init__(self, code, message, name=None):
        self.code = code
        self.name = name or _name(code)
        self.message = message
        super().__init__(f"[{self.name} {code}] {message}")


class InvalidArgumentError(KvtierError, ValueError):
    """Bad arguments: a null, an empty batch, mismatched lengths, a bad enum."""


class LayoutError(InvalidArgumentError):
    """Tensors or a layout that do not match what the client connected with."""


class UnavailableError(KvtierError, ConnectionError):
    """The daemon is not reachable at the socket (not running, restarting, gone)."""


class DaemonTimeoutError(KvtierError, TimeoutError):
    """The daemon did not answer in time."""


class ClosedError(KvtierError):
    """The client handle was closed already."""


class DeviceError(KvtierError):
    """A copy into or out of the registered KV memory failed."""


class UnsupportedError(KvtierError):
    """This libkvtier was built without a feature the call needs (``cuda``)."""


class UntrustedError(KvtierError, PermissionError):
    """The process serving the socket, or the arena file it named, belongs to another uid
    than the daemon's expected one (the message names both): someone may be posing as the
    daemon. Pass ``daemon_uid=`` when the daemon really runs as another user."""


class RemoteError(KvtierError):
    """The daemon refused the request; ``daemon_code`` is its own error code."""

    @property
    def daemon_code(self):
        return _capi.ERR_REMOTE_BASE - self.code


class RecoveringError(RemoteError, UnavailableError):
    """The daemon is up but rebuilding its index after a restart (its code 15,
    ``recovering``); it serves again shortly, so retry. Raised instead of a refused
    connection while the daemon recovers."""


# The daemon's own code for "recovering", as the C ABI returns it.
ERR_RECOVERING = _capi.ERR_REMOTE_BASE - 15

_BY_CODE = {
    _capi.ERR_NULL: InvalidArgumentError,
    _capi.ERR_INVALID: InvalidArgumentError,
    _capi.ERR_EMPTY_BATCH: InvalidArgumentError,
    _capi.ERR_LENGTH_MISMATCH: InvalidArgumentError,
    _capi.ERR_UNAVAILABLE: UnavailableError,
    _capi.ERR_TIMEOUT: DaemonTimeoutError,
    _capi.ERR_DEVICE: DeviceError,
    _capi.ERR_LAYOUT: LayoutError,
    _capi.ERR_UNSUPPORTED: UnsupportedError,
    _capi.ERR_CLOSED: ClosedError,
    _capi.ERR_UNTRUSTED: UntrustedError,
}


def _name(code):
    try:
        return _capi.error_name(code)
    except ImportError:
        return "unknown"


def from_code(code, message):
    """The exception for a non-zero return code."""
    if code == ERR_RECOVERING:
        return RecoveringError(code, message)
    if code <= _capi.ERR_REMOTE_BASE:
        return RemoteError(code, message)
    return _BY_CODE.get(code, KvtierError)(code, message)


def check(code):
    """Raises the exception for ``code`` unless it is ``KVTIER_OK``."""
    if code != _capi.OK:
        raise from_code(code, _capi.last_error())
