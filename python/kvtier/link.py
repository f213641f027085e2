"""An engine's connection to the kvtier daemon, made when the daemon is there.

Engines keep serving without kvtier: the vLLM connector (:mod:`kvtier.vllm`) and the
SGLang storage backend (:mod:`kvtier.sglang`) both hold their client through a
:class:`Link`, so an engine that starts before its daemon, or whose daemon goes away,
computes locally and connects when the daemon is back.
"""

import logging
import threading
import time

from . import _capi
from .errors import ClosedError, DaemonTimeoutError, KvtierError, UnavailableError

logger = logging.getLogger(__name__)


def daemon_down(e):
    """Whether ``e`` means the daemon is gone (not running, restarted, not answering), as
    opposed to a refusal of this call."""
    return isinstance(e, (UnavailableError, ClosedError, DaemonTimeoutError)) or e.code == _capi.ERR_PROTOCOL


class Link:
    """One client of the daemon for ``engine``'s ``what`` (log wording only).

    While no daemon answers, ``get`` returns None (the engine then finds no hits and stores
    nothing, so it computes locally), trying again at most every :data:`RETRY_S` seconds;
    the first failure logs one warning, the connection that follows one info line. A
    refusal that is not the daemon's absence (another layout under the model's name, say)
    is raised. ``lost`` drops a connection whose daemon went away, so the next use
    reconnects (and ``on_connect`` registers the engine's KV memory again)."""

    RETRY_S = 1.0

    def __init__(self, connect, engine, what, on_connect=None):
        self._connect = connect
        self._engine = engine
        self._what = what
        self._on_connect = on_connect
        self._client = None
        self._next = 0.0
        self._warned = False
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next:
                return None
            client = None
            try:
                client = self._connect()
                if self._on_connect is not None:
                    self._on_connect(client)
            except KvtierError as e:
                if client is not None:
                    client.close()
                self._next = now + self.RETRY_S
                if not daemon_down(e):
                    raise
                if not self._warned:
                    logger.warning("kvtier: no daemon for the %s %s (%s); %s computes locally and connects when the "
                                   "daemon appears", self._engine, self._what, e, self._engine)
                    self._warned = True
                return None
            if self._warned:
                logger.info("kvtier: the %s %s connected to the daemon", self._engine, self._what)
                self._warned = False
            self._client = client
            return client

    def lost(self, e):
        """Called with a failed call's error: drops the connection when the daemon is gone."""
        if not daemon_down(e):
            return
        with self._lock:
            client, self._client = self._client, None
            self._next = time.monotonic() + self.RETRY_S
            if not self._warned:
                logger.warning("kvtier: lost the daemon for the %s %s (%s); %s computes locally until it is back",
                               self._engine, self._what, e, self._engine)
                self._warned = True
        if client is not None:
            client.close()

    def close(self):
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
