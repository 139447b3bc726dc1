"""Cut-through relays: a downstream subscriber receives chunks while the relay is still
receiving the version, and gets it bit-exact (deltas downstream included).

The relay runs in this process (real sockets, real threads); its upstream receive is
paced (a sleep per chunk, as the kill matrix does) so "while" is observable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.procs import det_weights, digests, drift_weights, pace_replies, wait_until
from weightpub.deployment_config import RelayConfig
from weightpub.relay import Relay

pytestmark = pytest.mark.timeout(90)

SEED = 5
SPEC = [("a", "float32", [512, 512]), ("b", "bfloat16", [512, 1024]), ("c", "int64", [7])]
CHUNK = 64 << 10


def relay_of(pub: WeightPublisher, closing: Callable[[Any], Any], *, cut_through: bool,
             pace: float, **downstream: Any) -> Relay:
    relay = closing(Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": pub.endpoint}, "cut_through": cut_through,
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "heartbeat_interval": 0.2,
                       **downstream}})))
    pace_replies(relay.subscriber._client, pace)
    return relay


@pytest.mark.parametrize("cut_through", [True, False])
def test_downstream_receives_while_the_relay_still_receives(
    make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
    cut_through: bool,
) -> None:
    pub = make_pub(chunk_size=CHUNK)
    relay = relay_of(pub, closing, cut_through=cut_through, pace=0.02)
    down = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0))
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    overlap = []  # downstream fraction seen while the relay was still fetching version 1

    def watch() -> bool:
        upstream, downstream = relay.subscriber.status(), down.status()
        if upstream["fetching_version"] == 1 and downstream["fetching_version"] == 1:
            overlap.append(downstream["fetching_fraction"])
        return downstream["staged_version"] == 1

    wait_until(watch, 60, "version 1 downstream", interval=0.01)
    staged = down.latest()
    assert staged is not None and staged.publisher_id == relay.publisher.publisher_id
    assert digests(staged.items()) == digests(det_weights(SEED, 1, SPEC).items())
    if cut_through:  # chunks went down while the rest was still coming up
        assert max(overlap, default=0) >= 0.3, overlap
    else:  # store and forward: nothing downstream until the relay had it all
        assert overlap == []


def test_cut_through_relay_serves_deltas_downstream(
    make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
) -> None:
    pub = make_pub(chunk_size=CHUNK)
    relay = relay_of(pub, closing, cut_through=True, pace=0.0, delta_anchor_every=4)
    down = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0))
    for version in (1, 2, 3):
        pub.publish(drift_weights(SEED, version, SPEC), version=version)
        staged = down.wait_for_version(version, timeout=30)
        assert digests(staged.items()) == digests(drift_weights(SEED, version, SPEC).items())
        staged.release()
    status = down.status()
    assert status["versions_delta"] >= 1 and status["delta_fallbacks"] == 0, status
    assert relay.publisher.data_stats()["bytes_sent_delta"] > 0
