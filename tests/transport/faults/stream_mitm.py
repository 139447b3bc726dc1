"""A man in the middle of a publisher's ports that breaks one stream reply on cue.

It listens on 127.0.0.2 at the publisher's own port numbers and forwards each to
127.0.0.1: a subscriber that dials the ROUTER at 127.0.0.2 reaches the PUB port and the
stream port (the manifest's ``stream_port``, at the ROUTER's host) through it too. The
ROUTER and PUB ports pass untouched; on the stream port the publisher's replies are
parsed (``weightpub_wire.stream_link``) and ``arm(fault, version)`` breaks the first
``OK`` reply of that version or a later one:

- ``size``: its header says one byte more than the chunk has
- ``chunk``: its header names a chunk nobody asked for
- ``swap``: its header names the neighbouring chunk (``chunk ^ 1``: most often one asked in
  the same request, of the same size: the bytes land in the wrong chunk's place)
- ``version``: its header names a version nobody asked for
- ``garbage``: its header is random bytes
- ``stall``: the header and half the payload pass, then nothing more (the connection stays
  open until the subscriber closes it)
- ``cut``: the header and half the payload pass, then both connections are reset
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading

from weightpub_wire import stream_link
from weightpub_wire.message_base import MAX_CHUNKS

__all__ = ["FAULTS", "StreamMitm"]

FAULTS = ("size", "chunk", "swap", "version", "garbage", "stall", "cut")
_REPLY = struct.Struct("<4sBB2xQQII")  # stream_link's reply header


class _Replies:
    """One stream connection's replies, publisher -> subscriber: where each header is."""

    def __init__(self, mitm: StreamMitm) -> None:
        self.mitm = mitm
        self.head = bytearray()
        self.left = 0  # payload bytes of the current reply still to pass
        self.hold: int | None = None  # of those, how many pass before ``action``
        self.action = ""

    def feed(self, data: bytes) -> tuple[bytes, str]:
        """What to forward of ``data``, and "stall" / "cut" once the fault's point is met."""
        out = bytearray()
        i = 0
        while i < len(data):
            if self.left:
                take = min(self.left, len(data) - i)
                if self.hold is not None:
                    take = min(take, self.hold)
                    self.hold -= take
                out += data[i: i + take]
                self.left -= take
                i += take
                if self.hold == 0:
                    return bytes(out), self.action
                continue
            take = min(stream_link.REPLY_BYTES - len(self.head), len(data) - i)
            self.head += data[i: i + take]
            i += take
            if len(self.head) == stream_link.REPLY_BYTES:
                out += self._header(bytes(self.head))
                self.head.clear()
        return bytes(out), ""

    def _header(self, head: bytes) -> bytes:
        magic, status, flags, req, version, chunk, size = _REPLY.unpack(head)
        self.left = size if status == stream_link.OK else 0
        fault = self.mitm.take(status, version)
        if fault == "size":
            size += 1
        elif fault == "chunk":
            chunk = MAX_CHUNKS - 1
        elif fault == "swap":
            chunk ^= 1
        elif fault == "version":
            version += 1000
        elif fault == "garbage":
            return os.urandom(len(head))
        elif fault in ("stall", "cut"):
            self.hold, self.action = self.left // 2, fault
        return _REPLY.pack(magic, status, flags, req, version, chunk, size)


class StreamMitm:
    def __init__(self, router_port: int, pub_port: int, stream_port: int) -> None:
        self.stream_port = stream_port
        self.fired: list[str] = []  # faults applied, in order
        self._armed: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._servers = [socket.create_server(("127.0.0.2", port))
                         for port in (router_port, pub_port, stream_port)]
        for server in self._servers:
            threading.Thread(target=self._accept, args=(server,), daemon=True,
                             name="test-mitm-accept").start()

    def arm(self, fault: str, version: int) -> None:
        assert fault in FAULTS, fault
        with self._lock:
            self._armed = (fault, version)

    def take(self, status: int, version: int) -> str | None:
        """The armed fault, once, for the first OK reply of its version or a later one."""
        with self._lock:
            if self._armed is None or status != stream_link.OK or version < self._armed[1]:
                return None
            fault, self._armed = self._armed[0], None
            self.fired.append(fault)
            return fault

    def _accept(self, server: socket.socket) -> None:
        port = server.getsockname()[1]
        while not self._closed.is_set():
            try:
                client, _ = server.accept()
                upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                continue
            replies = _Replies(self) if port == self.stream_port else None
            threading.Thread(target=self._link, args=(client, upstream, replies), daemon=True,
                             name="test-mitm-link").start()

    def _link(self, client: socket.socket, upstream: socket.socket,
              replies: _Replies | None) -> None:
        """Both directions of one connection on one thread (a socket another thread is
        blocked reading would not be reset by ``close``)."""
        action = ""
        try:
            while not self._closed.is_set():
                # stalled: nothing is read from the publisher any more, the other way flows
                watched = [client] if action == "stall" else [client, upstream]
                readable, _, _ = select.select(watched, [], [], 0.05)
                for src in readable:
                    data = src.recv(1 << 16)
                    if not data:
                        return
                    if src is client:
                        upstream.sendall(data)
                        continue
                    if replies is not None:
                        data, action = replies.feed(data)
                    client.sendall(data)
                    if action == "cut":
                        return
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                if action == "cut":  # RST, not FIN: torn mid-chunk
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                    struct.pack("ii", 1, 0))
                sock.close()

    def close(self) -> None:
        self._closed.set()
        for server in self._servers:
            server.close()
