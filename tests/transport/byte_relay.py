"""A byte-counting TCP relay: measures what a publisher serves from outside both ends.

Put it in front of a publisher's ROUTER port and point subscribers at the relay:
every byte the publisher sends down (chunks, replies) is counted per accepted
connection. Manifests and heartbeats travel on the PUB socket, which
subscribers reach directly, so the count is the data path (plus small replies).
``down_rate`` makes it a slow link (bytes per second toward the subscriber).
``stall(marker)`` holds everything sent down the connections whose subscriber sent
``marker`` up (its id, e.g. ``b"rank1"``, is in every report it sends), until
``resume()``: one rank of a replica cut off while the others go on.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

__all__ = ["ByteRelay"]


@dataclass
class _Link:
    down: int = 0  # publisher -> subscriber
    up: int = 0
    sockets: list[socket.socket] = field(default_factory=list)
    seen: bytes = b""  # the last bytes sent up (a marker split across two reads)
    marked: set[bytes] = field(default_factory=set)  # stall markers its subscriber sent


class ByteRelay:
    """``tcp://127.0.0.1:<port>`` forwarding to ``upstream`` ("host", port)."""

    def __init__(self, upstream: tuple[str, int], *, down_rate: float | None = None) -> None:
        self.upstream = upstream
        self.down_rate = down_rate  # bytes/s toward the subscriber (None: as fast as it goes)
        self.links: list[_Link] = []
        self._lock = threading.Lock()
        self._markers: set[bytes] = set()  # stalled: links that sent one of these up
        self._stalled: set[bytes] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @classmethod
    def in_front_of(cls, endpoint: str, *, down_rate: float | None = None) -> ByteRelay:
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        return cls((host, int(port)), down_rate=down_rate)

    @property
    def bytes_down(self) -> int:
        with self._lock:
            return sum(link.down for link in self.links)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self.links)

    def per_link_down(self) -> list[int]:
        """Bytes sent down each connection so far, in the order they were accepted."""
        with self._lock:
            return [link.down for link in self.links]

    def watch(self, marker: bytes) -> None:
        """Tag the connections whose subscriber sends ``marker`` up (before ``stall``)."""
        with self._lock:
            self._markers.add(marker)

    def stall(self, marker: bytes) -> None:
        """Hold everything down the connections tagged ``marker`` (``watch`` it first)."""
        with self._lock:
            self._markers.add(marker)
            self._stalled.add(marker)

    def resume(self) -> None:
        with self._lock:
            self._stalled.clear()

    def tagged(self, marker: bytes) -> int:
        """How many connections carried ``marker`` up."""
        with self._lock:
            return sum(1 for link in self.links if marker in link.marked)

    def _held(self, link: _Link) -> bool:
        with self._lock:
            return bool(link.marked & self._stalled) and not self._closed

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            link = _Link(sockets=[client, server])
            with self._lock:
                self.links.append(link)
            for src, dst, down in ((server, client, True), (client, server, False)):
                threading.Thread(target=self._pump, args=(src, dst, link, down),
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, link: _Link, down: bool) -> None:
        src.settimeout(None)
        started, moved = time.monotonic(), 0
        try:
            while True:
                data = src.recv(64 << 10 if down and self.down_rate else 1 << 20)
                if down and self.down_rate and data:  # a slow link: hold to the rate
                    moved += len(data)
                    ahead = moved / self.down_rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
                if not data:
                    break
                with self._lock:  # counted before forwarding: never behind what arrived
                    if down:
                        link.down += len(data)
                    else:
                        link.up += len(data)
                        window = link.seen + data
                        link.marked |= {m for m in self._markers if m in window}
                        link.seen = window[-64:]
                while down and self._held(link):
                    time.sleep(0.02)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in link.sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=2)
        self._listener.close()
        with self._lock:
            for link in self.links:
                for sock in link.sockets:
                    sock.close()
