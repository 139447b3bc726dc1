"""A socket monitor closed while its socket lives on must not block the context's I/O thread.

libzmq 4.3.5 sends monitor events with a blocking send from the I/O thread: with the
monitor's PAIR closed and the socket still emitting events (a DEALER retrying a gone
peer: ``CONNECT_RETRIED`` every 100 ms; a ROUTER accepting), that thread blocked for
good and every socket of the context went deaf. CI: a TP=2 replica never heard a
sharded trainer restarted with four ranks (its links to the two gone ranks were closed
monitor first while retrying). ``close_monitor`` stops the events first.
"""

from __future__ import annotations

import socket
import time

import pytest
import zmq

from publisher.serving.connections import ConnectionGuard, GuardLimits
from weightpub_wire.monitor import close_monitor, read_events
from weightpub_wire.monitored_dealer import LINK_EVENTS, MonitoredDealer

pytestmark = pytest.mark.timeout(60)


def _dead_endpoint() -> str:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    return f"tcp://127.0.0.1:{port}"


def _context_still_works(ctx: zmq.Context) -> bool:
    """A fresh DEALER and ROUTER of ``ctx`` exchange a message (needs its I/O thread)."""
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"ping")
        return bool(router.poll(10_000))
    finally:
        dealer.close(linger=0)
        router.close(linger=0)


def test_a_monitor_closed_before_its_retrying_socket_leaves_the_context_working() -> None:
    ctx = zmq.Context()
    dealer = MonitoredDealer(ctx, _dead_endpoint(), hooks=(), handshake_timeout=1.0,
                             max_message_bytes=1 << 20, events=LINK_EVENTS)
    retried = False
    deadline = time.monotonic() + 20
    while not retried and time.monotonic() < deadline:  # events flow: it retries the peer
        dealer.monitor.poll(200)
        retried = any(e.event == zmq.EVENT_CONNECT_RETRIED for e in read_events(dealer.monitor))
    assert retried
    close_monitor(dealer.sock, dealer.monitor)
    time.sleep(0.5)  # the socket retries on, several times, with its monitor gone
    works = _context_still_works(ctx)
    dealer.sock.close(linger=0)
    assert works, "the context's I/O thread blocked on a closed monitor"
    ctx.term()  # (would never return with the I/O thread blocked)


def test_a_connection_guard_closed_before_its_router_leaves_the_context_working() -> None:
    """The publisher's side: a client accepted after the guard closed (an event for its
    monitor) must not block the serving context."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    guard = ConnectionGuard({"router": router}, GuardLimits())
    guard.close()
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    client.send(b"hello")  # accepted, then handshaken: events with no monitor to take them
    got = bool(router.poll(10_000))
    works = got and _context_still_works(ctx)
    client.close(linger=0)
    router.close(linger=0)
    assert works, "the context's I/O thread blocked on a closed guard monitor"
    ctx.term()
