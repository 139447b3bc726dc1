"""Wake an idle engine core when a rank can commit something new: an event, not a poll.

Why: an idle engine core blocks in ``input_queue.get()``; only something put
into that queue wakes it. Each rank that advertises a new committable version
(``shared_slots.SlotWriter.write``) sends one datagram to a Unix socket the
engine core listens on; a listener thread there turns a burst of datagrams into
one wake-up item in the engine's input queue (vLLM's own ``WAKEUP`` request,
which the engine ignores), and the patched ``get`` commits before it returns.

The socket lives in the Linux abstract namespace, named after the slot table
(no file to clean up; it goes with the engine process). Bounds: a datagram is one
byte and nothing in it is read; the listener drains whatever is queued and puts
at most one wake-up until the engine took the previous one; every wait has a
timeout, so the thread notices ``close`` within ``CHECK_S``. A stranger that
sends datagrams costs the engine a commit check (microseconds) per wake-up.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
from collections.abc import Callable

__all__ = ["CHECK_S", "WakeListener", "WakeSender", "wake_address"]

logger = logging.getLogger("weightpub.engine")

CHECK_S = 0.5  # how often the listener looks at ``close`` while nothing arrives


def wake_address(table_path: str) -> bytes:
    """The abstract socket name an engine's listener binds (``table_path``: its slot table)."""
    digest = hashlib.sha256(table_path.encode()).hexdigest()[:32]
    return b"\0weightpub-wake-" + digest.encode()


class WakeSender:
    """A rank's side: ``notify()`` after advertising; never blocks, never raises."""

    def __init__(self, address: bytes) -> None:
        self.address = address
        self.sent = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def notify(self) -> None:
        try:
            self._sock.sendto(b"w", self.address)
            self.sent += 1
        except OSError:  # no listener (yet, or any more), or its queue is full: a wake-up
            pass  # is already pending then, or nobody waits for one

    def close(self) -> None:
        self._sock.close()


class WakeListener:
    """The engine core's side: a thread that calls ``on_wake`` once per burst of datagrams.

    ``on_wake`` runs on the listener thread and must be quick (it puts one item into a
    queue). ``taken()`` re-arms it: until then further datagrams are drained and dropped.
    """

    def __init__(self, address: bytes, on_wake: Callable[[], None]) -> None:
        self.address = address
        self.wakes = 0
        self._on_wake = on_wake
        self._armed = threading.Event()
        self._armed.set()
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(address)  # OSError if another engine holds the name
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(CHECK_S)
        self._thread = threading.Thread(target=self._run, name="weightpub-idle-wake",
                                        daemon=True)
        self._thread.start()

    def taken(self) -> None:
        """The engine consumed the pending wake-up: the next datagram may wake it again."""
        self._armed.set()

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=2 * CHECK_S)
        self._sock.close()

    def _run(self) -> None:
        while not self._closed:
            try:
                self._sock.recv(64)
            except TimeoutError:
                continue
            except OSError:
                return  # closed under us
            self._drain()
            if self._armed.is_set():
                self._armed.clear()
                self.wakes += 1
                try:
                    self._on_wake()
                except Exception:  # never let a wake-up take the listener down
                    logger.exception("weightpub: idle wake-up failed")
                    self._armed.set()

    def _drain(self) -> None:
        self._sock.setblocking(False)
        try:
            for _ in range(1024):
                self._sock.recv(64)
        except OSError:
            pass  # empty (BlockingIOError) or closed
        finally:
            if not self._closed:
                self._sock.settimeout(CHECK_S)
