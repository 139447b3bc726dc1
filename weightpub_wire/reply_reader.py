"""Replies to a fetch on a DEALER of its own (a peer's, a trainer rank's): chunk or error.

A subscriber asks peers (``subscriber_ext/transport/peers``) and the ranks of a
sharded trainer (``client/shard_links.py``) for chunks on one DEALER each; every
such DEALER gets what a publisher's would: chunk replies (``chunk_frame``: inline,
or a header whose payload is the next message) and ``error`` replies.
``read_replies`` is the one loop that drains such a socket: a bounded batch per
call (the subscriber's thread has other sockets to serve), each reply decoded,
the rest of a malformed or multi-frame reply dropped through the caller's
``discard_rest`` (the client counts what it reads), and each outcome handed to
the caller, which decides what it means for that source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError

__all__ = ["decode_reply", "read_replies"]


def decode_reply(frame: zmq.Frame, more: int, limits: wire.Limits,
                 others: tuple[type, ...] = ()) -> Any:
    """A reply a publisher's DEALER would accept: a one-frame chunk
    (``weightpub_wire.chunk_frame``), an ``error`` or one of ``others`` (message types the
    caller asked for, e.g. a stream token); ``ProtocolError`` otherwise."""
    if chunk_frame.is_chunk(frame.buffer):
        header = chunk_frame.parse(frame.buffer)
        if more:
            raise ProtocolError(f"chunk {header.chunk}: more frames follow a one-frame reply")
        return header
    expect = (wire.ErrorReply, *others)
    message = wire.decode(frame.buffer, expect=expect, limits=limits)
    if not isinstance(message, expect):  # pragma: no cover
        raise ProtocolError("message.t: expected chunk or error")
    return message


def read_replies(sock: zmq.Socket, limits: wire.Limits, *, most: int,
                 pairing: chunk_frame.PayloadPairing,
                 discard_rest: Callable[[int, zmq.Socket], None],
                 on_chunk: Callable[[chunk_frame.ChunkHeader, zmq.Frame], None],
                 on_error: Callable[[wire.ErrorReply], None],
                 on_bad: Callable[[ProtocolError], None],
                 others: tuple[type, ...] = (),
                 on_other: Callable[[Any], None] | None = None) -> None:
    """Read up to ``most`` replies waiting on ``sock`` (never blocks).

    ``on_chunk(header, frame)``: a chunk (its payload still in ``frame``: behind the
    header, or the whole frame after a ``FOLLOWS`` header, ``chunk_frame.payload``);
    ``pairing``: this socket's header whose payload message is due;
    ``on_error(reply)``: an ``error`` reply; ``on_bad(exc)``: a reply that does not
    decode. ``discard_rest(more, sock)`` drops what follows the first frame.
    ``on_other(message)``: a message of one of ``others``."""
    for _ in range(most):
        try:
            first = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        more = int(sock.getsockopt(zmq.RCVMORE))
        if pairing.due is not None:
            try:
                header = pairing.take(first.buffer, more)
            except ProtocolError as exc:
                discard_rest(more, sock)
                on_bad(exc)
                continue
            on_chunk(header, first)
            continue
        try:
            message = decode_reply(first, more, limits, others)
        except ProtocolError as exc:
            discard_rest(more, sock)
            on_bad(exc)
            continue
        if isinstance(message, chunk_frame.ChunkHeader):
            if message.follows:
                pairing.expect(message)
            else:
                on_chunk(message, first)
            continue
        discard_rest(more, sock)
        if isinstance(message, wire.ErrorReply):
            on_error(message)
        elif on_other is not None:
            on_other(message)
