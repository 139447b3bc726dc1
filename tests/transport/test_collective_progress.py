"""A version that arrives by broadcast is shown while it arrives, as fetched ones are.

The collective receiver feeds each verified bucket to the subscriber's progress feed
(on the subscriber thread), so a replica prepares layers while the buckets arrive and
its commit is a swap: the partials name the same reception (``attempt``) as the
staged version they lead to, and their tensors grow bucket by bucket.
"""

from __future__ import annotations

import time

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.procs import wait_until

pytestmark = pytest.mark.timeout(120)


def test_broadcast_buckets_reach_on_progress_before_the_version_is_staged() -> None:
    weights = {f"layer{i}": torch.randn(64, 1024) for i in range(8)}  # 8 x 256 KiB
    events: list[tuple[str, int, int, int]] = []  # (kind, version, attempt, ready tensors)
    with WeightPublisher("tcp://127.0.0.1:0", collective="gloo", chunk_size=64 << 10,
                         collective_bucket_bytes=256 << 10, collective_timeout=5.0) as pub, \
            WeightSubscriber(
                pub.endpoint, collective=True,
                on_progress=lambda p: events.append(
                    ("partial", p.version, p.attempt, -1 if p.cancelled else p.ready_count())),
                on_version=lambda s: events.append(("staged", s.version, s.attempt, 0))
            ) as sub:
        wait_until(lambda: sub.status()["collective"]["receiver"] == "member", 30,
                   "the node in the publisher's group", interval=0.1)
        for _ in range(3):
            for tensor in weights.values():
                tensor.add_(1.0)
            version = pub.publish(weights)
            sub.wait_for_version(version, timeout=30)
            assert sub.status()["data_path"] in (None, "gloo")
        time.sleep(0.2)
        assert sub.status()["collective"]["rounds"] >= 3
    for version in (1, 2, 3):
        mine = [e for e in events if e[1] == version]
        assert mine and mine[-1][0] == "staged", mine
        partials = [e for e in mine if e[0] == "partial"]
        assert len(partials) >= 4, mine  # one per bucket but the last (the staged one follows)
        assert all(p[2] == mine[-1][2] for p in partials), mine  # the same reception
        ready = [p[3] for p in partials]
        assert ready == sorted(ready) and ready[0] > 0 and ready[-1] < len(weights), mine
