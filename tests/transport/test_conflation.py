"""A stuck subscriber never slows the publisher, and skips straight to the newest version."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from publisher import WeightPublisher
from subscriber_ext import StagedVersion, WeightSubscriber
from tests.transport.procs import det_weights, digests, wait_until

pytestmark = pytest.mark.timeout(60)

SPEC = [("w", "float32", [128, 1024]), ("b", "bfloat16", [1024])]


def test_slow_subscriber_conflates_and_publish_never_waits(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(chunk_size=64 << 10, keep_versions=2)
    release = threading.Event()
    entered = threading.Event()
    delivered: list[int] = []

    def on_version(staged: StagedVersion) -> None:
        delivered.append(staged.version)
        entered.set()
        release.wait(timeout=30)  # stuck until the test lets go (bounded, like every wait)

    sub = make_sub(pub.endpoint, on_version=on_version)
    pub.publish(det_weights(3, 1, SPEC))
    assert entered.wait(timeout=30), "the first version never reached the callback"
    assert delivered == [1]

    # the subscriber thread is now blocked; ten publishes must all return regardless
    published: list[int] = []

    def trainer() -> None:
        for version in range(2, 12):
            published.append(pub.publish(det_weights(3, version, SPEC)))

    thread = threading.Thread(target=trainer, name="test-trainer", daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "publish() blocked on a stuck subscriber"
    assert published == list(range(2, 12))
    pub.wait_announced(11, timeout=30)
    assert delivered == [1]  # still stuck: nothing was delivered meanwhile

    release.set()
    staged = sub.wait_for_version(11, timeout=30)
    assert digests(staged.items()) == digests(det_weights(3, 11, SPEC).items())
    wait_until(lambda: delivered[-1] == 11, 10, "the callback to see version 11")
    assert delivered == sorted(set(delivered))  # in order, no repeats
    assert len(delivered) < 10, delivered  # conflated: skipped most of the 10 new versions
