"""A DEALER connection that ends mid-transfer (ZeroMQ dials again on its own).

Why: the ROUTER knows the new connection under a new identity, so whatever the old
one had asked (deferred chunks, a header whose payload had not come) is never
answered there. The client must ask again as soon as it is connected anew, not after
``request_timeout``, and must not take the new connection's first chunk header for
the payload the old one owed (two ``ProtocolError``s a chunk: the e2e stall of
docs/benchmarks.md, "House third pass").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.procs import det_weights, wait_until
from weightpub_wire.sockets import cut_connection

pytestmark = pytest.mark.timeout(120)

# 16 MiB: 16 chunks of 1 MiB
SPEC: list[tuple[str, str, tuple[int, ...]]] = [("w", "float32", (4096, 1024))]
TIMEOUT = 60.0  # far beyond the wait below: a re-ask only after it would fail the test


def test_a_connection_cut_mid_chunk_is_asked_again_at_once(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(chunk_size=1 << 20)
    sub = make_sub(pub.endpoint, request_timeout=TIMEOUT)
    client = sub._client
    guard = pub._server.guard
    assert guard is not None
    cut = threading.Event()
    receive = client.on_dealer

    def on_dealer() -> None:  # after the first chunk header: end the connection under it
        receive()
        if client.sockets.pairing.due is not None and not cut.is_set():
            for fd in list(guard._conns):
                conn = guard._conns.get(fd)
                if conn is not None and conn.kind == "router":
                    cut_connection(fd, conn.peer)
            cut.set()

    client.on_dealer = on_dealer  # type: ignore[method-assign]
    version = pub.publish(det_weights(7, 1, SPEC))
    wait_until(cut.is_set, 30, "a chunk header read")
    staged = wait_until(sub.latest, TIMEOUT / 2, "the version staged after the cut")
    assert staged.version == version
    assert sub.status()["reconnects"] >= 1
    assert client.report.bad_messages == 0  # no header taken for the payload of another
