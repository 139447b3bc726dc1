"""Three subscriber processes at once; the publisher sees all three on the back-channel."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from publisher import WeightPublisher
from tests.transport.procs import Child, det_weights, digests, wait_until

pytestmark = pytest.mark.timeout(120)

SEED = 33
SPEC = [("embed", "bfloat16", [1000, 256]), ("proj", "float32", [256, 300]),
        ("norm", "float32", [256]), ("step", "int64", [])]
N = 3


def test_three_subscriber_processes_get_every_version(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
) -> None:
    pub = make_pub(chunk_size=128 << 10)
    subs = [spawn("subscriber", endpoint=pub.endpoint, mark_applied=True,
                  options={"report_interval": 0.2}) for _ in range(3)]
    ids = {child.event("ready", timeout=60)["subscriber_id"] for child in subs}
    assert len(ids) == 3
    wait_until(lambda: len(pub.fleet()) == 3, 30, "three subscribers to report in")

    for version in range(1, N + 1):
        assert pub.publish(det_weights(SEED, version, SPEC)) == version
        expected = digests(det_weights(SEED, version, SPEC).items())
        for child in subs:
            got = child.event("staged", timeout=30, version=version)
            assert got["publisher_id"] == pub.publisher_id
            assert got["digests"] == expected

    done = pub.wait_for_subscribers(N, 3, timeout=30)  # applied, via mark_applied
    assert {r.subscriber_id for r in done} == ids
    fleet = pub.fleet()
    assert {r.subscriber_id for r in fleet} == ids
    assert all(r.staged_version == N and r.applied_version == N for r in fleet), fleet
    assert all(r.last_error is None for r in fleet), fleet
    for child in subs:
        staged = [e["version"] for e in child.events if e["event"] == "staged"]
        assert staged == list(range(1, N + 1))
