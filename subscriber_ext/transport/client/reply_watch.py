"""Notices a DEALER that stopped getting replies while the client waits for them.

Why: ZeroMQ redials a connection that dropped or timed out, but not one that
ended in a protocol error. One corrupted byte on the wire (a flipped flag or an
impossible frame length from a bad middlebox) is such an error: the DEALER's
session ends for good, every send is refused (no pipe left), and nothing says
so, while the SUB socket's heartbeats keep the publisher looking alive. So the
client counts from the moment it wanted a reply: after ``SILENT_TIMEOUTS``
request timeouts with no frame back, it dials the endpoint anew
(``ClientSockets.watch_replies``).
"""

from __future__ import annotations

__all__ = ["SILENT_TIMEOUTS", "ReplyWatch"]

#: request timeouts without any reply, while the client waits for one, before redialling
SILENT_TIMEOUTS = 3


class ReplyWatch:
    """When the wait for the publisher's replies began, and how often it ran too long."""

    def __init__(self) -> None:
        self.waiting_since: float | None = None
        self.refused = False  # the last send found no connection to queue on
        self.redials = 0

    def sent(self, now: float, *, queued: bool) -> None:
        """A message went out (``queued``) or was refused: a reply is now due."""
        if self.waiting_since is None:
            self.waiting_since = now
        self.refused = not queued

    def heard(self, now: float) -> None:
        """A frame came back: the connection works; count again from here."""
        if self.waiting_since is not None:
            self.waiting_since = now

    def idle(self) -> None:
        """Nothing is asked: silence is expected."""
        self.waiting_since = None

    def stalled(self, now: float, request_timeout: float) -> bool:
        """True once per ``SILENT_TIMEOUTS`` request timeouts without a reply."""
        if self.waiting_since is None or \
                now - self.waiting_since < SILENT_TIMEOUTS * request_timeout:
            return False
        self.waiting_since = now
        self.redials += 1
        return True
