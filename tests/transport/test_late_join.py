"""Clone pattern snapshot: a subscriber that joins late gets the newest version first."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from publisher import WeightPublisher
from tests.transport.procs import Child, det_weights, digests, wait_until

pytestmark = pytest.mark.timeout(90)

SEED = 7
SPEC = [("layer.0.weight", "float32", [64, 129]), ("layer.0.bias", "bfloat16", [129]),
        ("emb", "int8", [300, 17])]


def test_late_joiner_receives_newest_version(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
) -> None:
    pub = make_pub(chunk_size=4096, keep_versions=2)
    for version in (1, 2, 3):
        assert pub.publish(det_weights(SEED, version, SPEC)) == version
    pub.wait_announced(3, timeout=30)

    sub = spawn("subscriber", endpoint=pub.endpoint)
    first = sub.event("staged", timeout=60)
    assert first["version"] == 3
    assert first["digests"] == digests(det_weights(SEED, 3, SPEC).items())
    assert [e["version"] for e in sub.events if e["event"] == "staged"] == [3]

    # and it is now on the live feed: the next version arrives without asking
    pub.publish(det_weights(SEED, 4, SPEC))
    fourth = sub.event("staged", timeout=30, version=4)
    assert fourth["digests"] == digests(det_weights(SEED, 4, SPEC).items())


def test_subscriber_before_first_publish_gets_first_version(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., object],
) -> None:
    """The other order: subscribed to a publisher that has nothing yet (manifest None)."""
    pub = make_pub(chunk_size=4096)
    sub = make_sub(pub.endpoint)
    wait_until(lambda: sub.status()["state"] == "ACTIVE", 30, "the subscriber to sync")
    assert sub.latest() is None
    pub.publish(det_weights(SEED, 1, SPEC))
    staged = sub.wait_for_version(1, timeout=30)
    assert digests(staged.items()) == digests(det_weights(SEED, 1, SPEC).items())
