"""A raw client of a publisher's stream port, for hostile input: its tokens are asked over
a real DEALER (as a subscriber's are), every byte it sends is the test's own."""

from __future__ import annotations

import socket

import zmq

from tests.transport.faults.tools import RawPeer
from weightpub_wire import protocol as wire
from weightpub_wire import stream_link

__all__ = ["StreamClient", "closed", "read_exact", "read_reply"]


class StreamClient:
    def __init__(self, ctx: zmq.Context, endpoint: str, port: int) -> None:
        self.ctx, self.endpoint, self.port = ctx, endpoint, port

    def token(self) -> bytes:
        """A fresh one-time token from the publisher's ROUTER."""
        peer = RawPeer(self.ctx, self.endpoint)
        try:
            peer.send(wire.encode(stream_link.StreamTokenRequest(req=1)))
            reply = wire.decode(peer.recv()[0],
                                expect=(stream_link.StreamToken, wire.ErrorReply))
        finally:
            peer.close()
        assert isinstance(reply, stream_link.StreamToken), reply
        return reply.token

    def connect(self, hello: bytes | None = None, rcvbuf: int | None = None
                ) -> socket.socket:
        """A connection to the port (a small ``rcvbuf``: a reader that takes little),
        ``hello`` sent on it; every wait on it bounded by 10 s."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(10)
        sock.connect(("127.0.0.1", self.port))
        if hello is not None:
            sock.sendall(hello)
        return sock

    def accepted(self, token: bytes | None = None, rcvbuf: int | None = None
                 ) -> socket.socket:
        """A connection whose hello (with ``token``, or a fresh one) was accepted."""
        sock = self.connect(stream_link.hello(token or self.token()), rcvbuf)
        assert read_reply(sock).status == stream_link.ACCEPTED
        return sock


def read_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        piece = sock.recv(nbytes - len(data))
        assert piece, f"closed after {len(data)} of {nbytes} bytes"
        data += piece
    return bytes(data)


def read_reply(sock: socket.socket) -> stream_link.StreamReply:
    return stream_link.parse_reply(read_exact(sock, stream_link.REPLY_BYTES))


def closed(sock: socket.socket) -> None:
    """The publisher closed the connection (bounded by the socket's timeout); closes it."""
    try:
        assert sock.recv(1 << 16) == b"", "the connection still sends"
    except ConnectionResetError:
        pass
    finally:
        sock.close()
