"""kill -9 of the publisher mid-transfer: nothing partial is staged; a restart is followed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from subscriber_ext import StagedVersion, WeightSubscriber
from tests.transport.procs import Child, det_weights, digests, free_port, pace_replies, wait_until

pytestmark = pytest.mark.timeout(150)

SMALL = [("w", "float32", [512, 1024]), ("b", "bfloat16", [1024]), ("s", "int64", [])]
BIG = [("big", "float32", [75, 1 << 20])]  # 300 MiB


def throttle(sub: WeightSubscriber, seconds: float) -> None:
    """Slow the subscriber down per chunk so a kill reliably lands mid-transfer."""
    pace_replies(sub._client, seconds)


def test_publisher_kill9_mid_transfer_then_restart_on_same_endpoint(
    spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber],
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = spawn("publisher", endpoint=endpoint, seed=1, chunk_size=1 << 20,
                  heartbeat_interval=0.2)
    old_id = first.event("ready", timeout=60)["publisher_id"]

    delivered: list[tuple[str, int]] = []
    lock = threading.Lock()

    def on_version(staged: StagedVersion) -> None:
        with lock:
            delivered.append((staged.publisher_id, staged.version))

    sub = make_sub(endpoint, on_version=on_version, request_timeout=1.0,
                   window_bytes=1 << 20, chunks_per_request=1)
    throttle(sub, 0.02)

    first.request("publish", version=1, spec=SMALL)
    v1 = sub.wait_for_version(1, timeout=60)
    assert v1.publisher_id == old_id
    assert digests(v1.items()) == digests(det_weights(1, 1, SMALL).items())

    first.request("publish", version=2, spec=BIG)
    wait_until(lambda: sub.status()["fetching_version"] == 2
               and sub.status()["fetching_fraction"] > 0, 60, "version 2 to be in flight")
    first.kill9()
    assert first.proc.returncode == -9
    status = sub.status()
    assert status["fetching_version"] == 2 and status["fetching_fraction"] < 1, status

    # with the publisher gone, the subscriber holds on to v1 and never stages a partial v2
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        latest = sub.latest()
        assert latest is not None and (latest.publisher_id, latest.version) == (old_id, 1)
        time.sleep(0.05)
    assert digests(v1.items()) == digests(det_weights(1, 1, SMALL).items())  # still intact

    second = spawn("publisher", endpoint=endpoint, seed=2, chunk_size=1 << 20,
                   heartbeat_interval=0.2)
    ready = second.event("ready", timeout=60)
    new_id = ready["publisher_id"]
    assert new_id != old_id and ready["endpoint"] == endpoint
    second.request("publish", version=1, spec=SMALL)  # numbering restarts with the instance

    staged = wait_until(
        lambda: (s := sub.latest()) is not None and s.publisher_id == new_id and s,
        60, "the subscriber to follow the restarted publisher",
    )
    assert staged.version == 1
    assert digests(staged.items()) == digests(det_weights(2, 1, SMALL).items())
    with lock:
        assert (old_id, 2) not in delivered
        assert delivered[0] == (old_id, 1) and delivered[-1] == (new_id, 1)
    assert sub.status()["staged_version"] == 1
