"""The stream path through a relay (issue 29): ``stream: true`` upstream (the relay
receives on the trainer's stream port) and downstream (it serves its copy on a stream
port of its own), cut-through and store-and-forward.

The relay runs in this process (real sockets, real threads). What must hold: versions
reach the subscriber behind the relay bit-exact with every byte on a stream at both hops
(no chunk frame from the trainer or the relay), counted on both sides of each hop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.procs import det_weights, digests
from weightpub.deployment_config import RelayConfig
from weightpub.relay import Relay

pytestmark = pytest.mark.timeout(90)

SEED = 13
SPEC = [("w", "float32", [512, 256]), ("b", "int32", [50_000]), ("e", "uint8", [3_333])]
CHUNK = 64 << 10


@pytest.mark.parametrize("cut_through", [True, False], ids=["cut-through", "store-forward"])
def test_both_hops_of_a_relay_stream_bit_exact(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        cut_through: bool) -> None:
    pub = make_pub(chunk_size=CHUNK, stream=True)
    relay = closing(Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": pub.endpoint, "stream": True, "request_timeout": 5.0},
        "cut_through": cut_through,
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "heartbeat_interval": 0.2,
                       "stream": True}})))
    down = closing(WeightSubscriber(relay.endpoint, stream=True, request_timeout=5.0))
    total = 0
    for version in (1, 2):
        weights = det_weights(SEED, version, SPEC)
        pub.publish(weights, version=version)
        staged = down.wait_for_version(version, timeout=60)
        assert staged.publisher_id == relay.publisher.publisher_id
        assert digests(staged.items()) == digests(weights.items())
        assert staged.data_path == "stream"
        total += staged.total_bytes
        staged.release()
    upstream, downstream = relay.subscriber.status()["stream"], down.status()["stream"]
    assert upstream["fallbacks"] == 0 and downstream["fallbacks"] == 0, (upstream, downstream)
    assert upstream["bytes_received"] == downstream["bytes_received"] == total
    for publisher in (pub, relay.publisher):  # the trainer, then the relay: no chunk frame
        assert publisher.data_stats()["bytes_sent_full"] == 0
        counters = sent_counters(publisher, total)
        assert counters["bytes_sent"] == total, counters
        assert counters["accepted"] == 1 and counters["refused"] == counters["cut"] == 0


def sent_counters(publisher: WeightPublisher, total: int) -> dict[str, Any]:
    """The stream counters once ``total`` bytes are counted sent, or after 10 s: a
    connection's thread adds a batch once ``sendmsg`` returns, which can be after the
    subscriber staged it."""
    deadline = time.monotonic() + 10
    while True:
        counters = publisher.stream_status()
        assert counters is not None
        if counters["bytes_sent"] >= total or time.monotonic() > deadline:
            return counters
        time.sleep(0.01)
