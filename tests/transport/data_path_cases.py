"""What the data-path tests share (``test_nixl_path``, ``test_stream_path``): one small
three-tensor version served by a publisher child process, and a subscriber here."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.client import stream_source
from tests.transport.procs import Child, det_weights, digests, wait_until

SPEC = [("w", "float32", [1024, 1024]), ("b", "int32", [300_000]), ("e", "uint8", [12_345])]
CHUNK = 1 << 20


def start_publisher(spawn: Callable[..., Child], **args: Any) -> tuple[Child, str]:
    """A publisher child (seed 7, 1 MiB chunks) and its endpoint."""
    child = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=7, chunk_size=CHUNK, **args)
    return child, child.event("ready", timeout=60)["endpoint"]


def publish(child: Child, version: int) -> None:
    child.request("publish", timeout=60, version=version, spec=SPEC)


def child_stats(child: Child) -> dict[str, Any]:
    return child.request("stats")


def subscriber(closing: Callable[[Any], Any], endpoint: str, **options: Any
               ) -> WeightSubscriber:
    """A subscriber closed at the test's end, with a 3 s request timeout unless given."""
    return closing(WeightSubscriber(endpoint, **{"request_timeout": 3.0, **options}))


def exact(staged: Any, version: int) -> bool:
    """Whether ``staged`` holds version ``version`` of ``SPEC`` bit for bit."""
    return digests(staged.items()) == digests(det_weights(7, version, SPEC).items())


def pace_stream_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream source reads at most a chunk per look, one look per 0.2 s: a version of
    tens of MiB takes seconds, so a kill lands in it."""
    read = stream_source.StreamSource._read

    def paced(self: stream_source.StreamSource) -> None:
        time.sleep(0.2)
        read(self)

    monkeypatch.setattr(stream_source, "_READ_BUDGET", CHUNK)
    monkeypatch.setattr(stream_source.StreamSource, "_read", paced)


def kill_mid_stream_stages_nothing(pub: Child, sub: WeightSubscriber, spec: Any) -> None:
    """Publish ``spec`` as version 1, kill -9 the publisher once a chunk's worth came over
    the (paced) stream: nothing is ever staged, the fallback named."""
    pub.send(cmd="publish", id="1", version=1, spec=spec)
    wait_until(lambda: sub.status()["stream"]["bytes_received"] >= CHUNK, 60,
               "a first chunk's worth over the stream")
    pub.kill9()
    fraction = sub.status()["fetching_fraction"]
    assert fraction is not None and fraction < 1.0  # killed mid-version
    wait_until(lambda: sub.status()["stream"]["fallbacks"] >= 1, 60,
               "the dead stream noticed")
    time.sleep(3)  # the fallback to frames of a dead publisher plays out
    assert sub.latest() is None  # nothing partial was ever staged
    status = sub.status()
    assert status["staged_version"] == 0, status
    assert set(status["stream"]["fallback_causes"]) <= {"closed", "timeout"}, status
