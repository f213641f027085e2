"""Holding back the new requests of sessions the daemon's pressure controller paused.

:class:`SessionHold` subscribes to the daemon's session events (``events.session_endpoint``,
by default ``ipc://<the daemon's socket dir>/session-events.ipc``; the wire format is in
docs/events.md) and keeps which sessions are paused. An engine adapter asks
:meth:`SessionHold.holds` before admitting a new request of a session: while the session is
paused the answer is yes, until a ``session_resume`` event arrives or the request has
waited ``hold_ms`` (a bound of its own, in case a resume is never heard: the daemon
restarted, or this subscriber missed it). The daemon's forced-resume cap bounds every
pause as well.

Events are read, not taken: every engine instance subscribes with its own view, and the
engines' advice streams and ``/v1/sessions/advice`` keep every decision. A ZMQ subscriber
only hears what is published after it connected, so a session paused before the adapter
started is not held. Polls never block: :meth:`holds` drains what arrived and answers.
"""

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

#: The topic the daemon publishes session events under.
TOPIC = b"kvtier.sessions"
#: Paused sessions remembered at most (the oldest are forgotten first).
MAX_PAUSED = 65536
#: Messages read per poll at most, so one call stays short.
MAX_PER_POLL = 4096
#: Default bound on how long one request is held, in ms: the daemon's default
#: forced-resume cap (``policy.forced_resume_ms``), so no hold ends before it would.
DEFAULT_HOLD_MS = 30 * 60 * 1000


def default_endpoint(socket):
    """The daemon's default session event endpoint for a daemon on ``socket``, if that
    endpoint exists (``events.session_endpoint = "ipc"``, the default), else None."""
    path = Path(os.fspath(socket)).parent / "session-events.ipc"
    return f"ipc://{path}" if path.exists() else None


def _decode(payload):
    try:
        import msgspec

        return msgspec.msgpack.decode(payload)
    except ImportError:
        import msgpack

        return msgpack.unpackb(payload, raw=False)


class SessionHold:
    """Paused sessions, from the daemon's session events; see the module docs."""

    def __init__(self, endpoint, hold_ms=DEFAULT_HOLD_MS):
        import zmq

        self.hold_ms = int(hold_ms)
        if self.hold_ms < 0:
            raise ValueError(f"session_hold_ms must be 0 or more, not {hold_ms}")
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.connect(endpoint)
        self.endpoint = endpoint
        #: session id -> monotonic time it was paused (insertion order: oldest first).
        self.paused = {}
        #: request id -> monotonic time it was first held.
        self._held = {}
        #: The last event sequence seen, and events this subscriber missed (gaps).
        self.last_seq = 0
        self.missed = 0

    def poll(self):
        """Reads the events that arrived, without blocking."""
        zmq = self._zmq
        for _ in range(MAX_PER_POLL):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue
            try:
                ev = _decode(frames[2])
                kind, session, seq = ev["type"], ev["session_id"], int(ev["seq"])
            except (ValueError, KeyError, TypeError) as e:
                logger.warning("kvtier: an undecodable session event skipped: %s", e)
                continue
            if self.last_seq and seq > self.last_seq + 1:
                self.missed += seq - self.last_seq - 1
            self.last_seq = max(self.last_seq, seq)
            if kind == "session_pause":
                self.paused.pop(session, None)
                self.paused[session] = time.monotonic()
                while len(self.paused) > MAX_PAUSED:
                    self.paused.pop(next(iter(self.paused)))
            elif kind == "session_resume":
                self.paused.pop(session, None)

    def holds(self, request_id, session):
        """Whether the new request ``request_id`` of ``session`` should wait: its session
        is paused and the request has waited less than ``hold_ms``."""
        self.poll()
        if not session or self.hold_ms == 0 or session not in self.paused:
            self._held.pop(request_id, None)
            return False
        now = time.monotonic()
        since = self._held.setdefault(request_id, now)
        if (now - since) * 1000 >= self.hold_ms:
            # Kept (until forget) so a request asked about again is not held again.
            if since > 0:
                logger.warning("kvtier: request %s of paused session %s admitted after %d ms held",
                               request_id, session, self.hold_ms)
                self._held[request_id] = 0.0
            return False
        return True

    def forget(self, request_id):
        """The request finished or was aborted."""
        self._held.pop(request_id, None)

    def close(self):
        self._sub.close(0)
