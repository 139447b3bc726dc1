"""Bounded waits raise WeightPubTimeout; close() is prompt and leaves no threads behind."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from publisher import ClosedError, WeightPublisher, WeightPubTimeout
from subscriber_ext import WeightSubscriber
from subscriber_ext.transport import subscriber as subscriber_module
from tests.transport.procs import det_weights, free_port, pace_replies, wait_until

pytestmark = pytest.mark.timeout(60)

# generous bounds: these check "returns at all, not after a hang", never speed
PROMPT = 10.0


@pytest.fixture
def thread_baseline() -> Iterator[set[threading.Thread]]:
    before = set(threading.enumerate())
    yield before


def leftover_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before`` that are still alive, except pyzmq's process-wide
    zero-copy garbage collector (a daemon singleton that pyzmq starts on first use)."""
    return [t for t in threading.enumerate() if t not in before and t.is_alive()
            and type(t).__name__ != "GarbageCollectorThread"]


def test_wait_for_version_without_publisher_times_out(
    thread_baseline: set[threading.Thread],
) -> None:
    sub = WeightSubscriber(f"tcp://127.0.0.1:{free_port()}")  # nobody listens there
    try:
        start = time.monotonic()
        with pytest.raises(WeightPubTimeout) as info:
            sub.wait_for_version(timeout=0.5)
        elapsed = time.monotonic() - start
        assert isinstance(info.value, TimeoutError)
        assert 0.5 <= elapsed < PROMPT
        assert "within 0.5s" in str(info.value)
        with pytest.raises(WeightPubTimeout):
            next(sub.versions(timeout=0.2))
        assert sub.status()["state"] in ("INITIAL", "SYNCING")
    finally:
        start = time.monotonic()
        sub.close()
        assert time.monotonic() - start < PROMPT
    assert leftover_threads(thread_baseline) == []
    with pytest.raises(ClosedError):
        sub.wait_for_version(timeout=1)
    sub.close()  # idempotent


def test_publisher_timeouts_and_close(thread_baseline: set[threading.Thread]) -> None:
    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2)
    try:
        with pytest.raises(WeightPubTimeout):
            pub.wait_for_subscribers(1, 1, timeout=0.3)
        with pytest.raises(WeightPubTimeout):
            pub.wait_announced(5, timeout=0.3)
    finally:
        start = time.monotonic()
        pub.close()
        assert time.monotonic() - start < PROMPT
    assert leftover_threads(thread_baseline) == []
    with pytest.raises(ClosedError):
        pub.publish({"x": det_weights(1, 1, [("x", "float32", [4])])["x"]})
    pub.close()  # idempotent


def test_close_mid_transfer_is_prompt_and_leaves_no_threads(
    thread_baseline: set[threading.Thread],
) -> None:
    """Both sides closed while a version is half way across."""
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=64 << 10, heartbeat_interval=0.2)
    sub = WeightSubscriber(pub.endpoint, window_bytes=64 << 10, chunks_per_request=1)
    pace_replies(sub._client, 0.01)
    try:
        pub.publish(det_weights(2, 1, [("w", "float32", [64, 1 << 16])]))  # 16 MiB, 256 chunks
        wait_until(lambda: (sub.status()["fetching_fraction"] or 0) > 0, 30, "a transfer")
        assert sub.latest() is None
    finally:
        start = time.monotonic()
        sub.close()
        pub.close()
        assert time.monotonic() - start < PROMPT
    assert leftover_threads(thread_baseline) == []
    # this test's own threads (a module run earlier on the same xdist worker may have left
    # one of its own behind by design, e.g. a callback that never returns)
    ours = [t for t in threading.enumerate() if t not in thread_baseline]
    assert not [t.name for t in ours if t.name.startswith("weightpub")]
    assert all(t.daemon for t in ours)


def test_close_returns_while_on_version_callback_is_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() is bounded (``CLOSE_WAIT_SECONDS``, 0.5 s here) even when a consumer's
    callback never returns."""
    monkeypatch.setattr(subscriber_module, "CLOSE_WAIT_SECONDS", 0.5)
    stuck = threading.Event()
    release = threading.Event()

    def on_version(staged: object) -> None:
        stuck.set()
        release.wait(timeout=45)

    pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2)
    sub = WeightSubscriber(pub.endpoint, on_version=on_version)
    try:
        pub.publish(det_weights(4, 1, [("w", "float32", [16])]))
        assert stuck.wait(timeout=30)
        sub.close()
        assert not release.is_set()  # close() came back with the callback still blocked
        assert sub._thread.is_alive()
    finally:
        release.set()
        pub.close()
    sub._thread.join(timeout=10)
    assert not sub._thread.is_alive()  # and the thread ends once the callback returns


def test_a_slow_link_is_not_a_lost_request() -> None:
    """A window that takes longer than ``request_timeout`` to drain through a slow link
    is still being answered: nothing is asked twice, nothing is given up (the fleet
    simulator found 16 replicas behind one 400 Mbit/s uplink abandoning versions)."""
    from tests.transport.byte_relay import ByteRelay

    chunk = 64 << 10
    weights = det_weights(7, 1, [("w", "float32", [1 << 20])])  # 4 MiB: 64 chunks
    total = 4 << 20
    with WeightPublisher("tcp://127.0.0.1:0", chunk_size=chunk) as pub:
        slow = ByteRelay.in_front_of(pub.endpoint, down_rate=total / 2.5)  # about 2.5 s
        try:
            with WeightSubscriber(slow.endpoint, request_timeout=0.5, window_bytes=total,
                                  max_chunk_retries=1) as sub:
                version = pub.publish(weights)
                sub.wait_for_version(version, timeout=30)
                assert sub.status()["last_error"] is None
            assert pub.data_stats()["bytes_sent_full"] == total  # each chunk once
        finally:
            slow.close()
