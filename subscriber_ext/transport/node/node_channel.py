"""The node channel: how the local ranks of one replica share one subscription.

One Unix stream socket per follower rank, in the Linux *abstract* namespace
(no file to clean up: the name disappears with the process that bound it).
The first local rank to bind the node's name owns the subscription; every
other rank connects to it. Both ends check that the peer runs as the same user
(``SO_PEERCRED``): an abstract socket has no file permissions.

Frames: a 4-byte big-endian length, then one msgpack map (``msgspec``, typed
and bounded like the wire protocol). An ``Offer`` of a buffer the follower has
not mapped yet carries the buffer's memfd as ``SCM_RIGHTS`` ancillary data::

    follower -> owner   hello {rank, pid} | release {share} | applied {version, error}
    owner -> follower   welcome {rank, pid, subscriber_id}
                      | offer {share, segment, segment_bytes, manifest, attempt} [+ fd]
                      | partial {attempt, ready, cancelled, [segment, manifest]} [+ fd]
                      | forget {segment} | status {fields, ranks}

A ``partial`` tells a follower which tensors of a version still arriving are
final (``transport/staging/progress.py``): the first one of an attempt carries the
manifest (and the memfd when new to the follower), each one the indices of the
tensors that became final since the last.
"""

from __future__ import annotations

import array
import errno
import hashlib
import os
import select
import socket
import struct
import threading
from collections import deque
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError

__all__ = [
    "Applied",
    "Channel",
    "Forget",
    "Hello",
    "Offer",
    "Partial",
    "Release",
    "Status",
    "Welcome",
    "bind_node",
    "connect_node",
    "node_address",
]

SEND_TIMEOUT_S = 5.0
_LENGTH = struct.Struct(">I")
_RECV_BYTES = 1 << 20
Count = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
RankNo = Annotated[int, Meta(ge=0, le=1 << 20)]
Scalar = str | int | float | bool | None


class _NodeMessage(msgspec.Struct, frozen=True, tag_field="t", kw_only=True):
    pass


class Hello(_NodeMessage, tag="hello", frozen=True, kw_only=True):
    rank: RankNo
    pid: Count


class Welcome(_NodeMessage, tag="welcome", frozen=True, kw_only=True):
    rank: RankNo
    pid: Count
    subscriber_id: wire.Name


class Offer(_NodeMessage, tag="offer", frozen=True, kw_only=True):
    """A complete, verified version in segment ``segment``; ``fd_attached`` when new here."""

    share: Count
    segment: Count
    segment_bytes: Count
    fd_attached: bool
    manifest: wire.Manifest
    fetch_seconds: Annotated[float, Meta(ge=0.0, le=1e9)] = 0.0
    data_path: wire.DataPath = "zmq"
    attempt: Count = 0  # the reception it came from (its ``Partial`` messages)


class Partial(_NodeMessage, tag="partial", frozen=True, kw_only=True):
    """A version still arriving: the tensors (indices) that became final since the last.

    The first message of an ``attempt`` names the segment and carries the manifest;
    ``cancelled``: the reception was given up, drop what was built from it.
    """

    attempt: Count
    ready: Annotated[tuple[Count, ...], Meta(max_length=wire.MAX_TENSORS)] = ()
    cancelled: bool = False
    segment: Count = 0
    segment_bytes: Count = 0
    fd_attached: bool = False
    manifest: wire.Manifest | None = None


class Release(_NodeMessage, tag="release", frozen=True, kw_only=True):
    share: Count


class Forget(_NodeMessage, tag="forget", frozen=True, kw_only=True):
    segment: Count


class Applied(_NodeMessage, tag="applied", frozen=True, kw_only=True):
    version: Count
    error: wire.ErrorText | None = None


class Status(_NodeMessage, tag="status", frozen=True, kw_only=True):
    """The owner's subscription status, as the follower's ``status()`` shows it."""

    fields: Annotated[dict[Annotated[str, Meta(max_length=64)], Scalar], Meta(max_length=64)]
    ranks: Annotated[tuple[RankNo, ...], Meta(max_length=wire.MAX_REPORTED_RANKS)]


NodeMessage = Hello | Welcome | Offer | Partial | Release | Forget | Applied | Status
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(NodeMessage)


def node_address(key: str) -> bytes:
    """The abstract socket name of a replica's node channel (``key``: replica + endpoint)."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return b"\0weightpub-node-" + digest.encode()


def _check_peer(sock: socket.socket) -> None:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise ProtocolError(f"node channel: peer runs as uid {uid}, not {os.getuid()}")


def bind_node(address: bytes) -> socket.socket | None:
    """Listen on ``address``; None when another local rank already owns it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    sock.listen(64)
    return sock


def connect_node(address: bytes, timeout: float) -> socket.socket | None:
    """Connect to the owner of ``address``; None when nobody listens (yet, or any more)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
        _check_peer(sock)
    except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


class Channel:
    """One end of a node connection: framed typed messages, descriptors alongside.

    ``send`` may be called from any thread (one lock, ``SEND_TIMEOUT_S``); ``receive``
    only from the one thread that reads this channel.
    """

    def __init__(self, sock: socket.socket, *, check_peer: bool = True) -> None:
        if check_peer:
            _check_peer(sock)
        sock.settimeout(SEND_TIMEOUT_S)
        self.sock = sock
        self._send_lock = threading.Lock()
        self._inbox = bytearray()
        self._fds: deque[int] = deque()
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: _NodeMessage, fd: int | None = None) -> None:
        """Send one message (raises ``OSError`` when the peer is gone or stuck)."""
        body = _ENCODER.encode(message)
        if len(body) > wire.MAX_CONTROL_BYTES:
            raise ProtocolError(f"node message of {len(body)} bytes is too large")
        frame = _LENGTH.pack(len(body)) + body
        with self._send_lock:
            if fd is None:
                self.sock.sendall(frame)
                return
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            sent = self.sock.sendmsg([frame], rights)
            if sent < len(frame):
                self.sock.sendall(frame[sent:])

    def receive(self, wait: float) -> list[tuple[Any, int | None]] | None:
        """Messages complete after one read (each with its descriptor, if it carried one).

        Returns [] when nothing arrived within ``wait`` and None once the peer closed.
        Raises ``ProtocolError`` on a malformed frame (the caller drops the peer).
        """
        if not select.select([self.sock], [], [], wait)[0]:
            return []
        try:
            data, ancdata, flags, _ = self.sock.recvmsg(
                _RECV_BYTES, socket.CMSG_SPACE(4 * array.array("i").itemsize))
        except (ConnectionResetError, TimeoutError):
            return None
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("node channel: descriptors were truncated")
        if not data:
            return None
        self._inbox += data
        return self._frames()

    def _frames(self) -> list[tuple[Any, int | None]]:
        out: list[tuple[Any, int | None]] = []
        while len(self._inbox) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._inbox)
            if size > wire.MAX_CONTROL_BYTES:
                raise ProtocolError(f"node channel: frame of {size} bytes announced")
            if len(self._inbox) < _LENGTH.size + size:
                break
            body = bytes(self._inbox[_LENGTH.size: _LENGTH.size + size])
            del self._inbox[: _LENGTH.size + size]
            try:
                message = _DECODER.decode(body)
            except msgspec.MsgspecError as exc:
                raise ProtocolError(f"node channel: bad message ({exc})") from exc
            fd = None
            if isinstance(message, (Offer, Partial)) and message.fd_attached:
                if not self._fds:
                    raise ProtocolError("node channel: an offer came without its descriptor")
                fd = self._fds.popleft()
            out.append((message, fd))
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        while self._fds:
            os.close(self._fds.popleft())
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
