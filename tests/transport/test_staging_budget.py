"""The host-memory budget for staging: refuse what never fits, wait for what fits later.

Bytes are counted by a TCP relay in front of the publisher, so "refused before
allocating" is checked from outside: a refused version is never fetched.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import StagedVersion, WeightSubscriber
from subscriber_ext.transport.staging.memory_budget import derive_staging_budget
from tests.transport.byte_relay import ByteRelay
from tests.transport.procs import as_bytes, det_weights, drift_weights, spec_bytes, wait_until
from weightpub_wire.buffers import BufferPool
from weightpub_wire.errors import ConfigError, StagingBudgetError
from weightpub_wire.host_memory import available_memory

pytestmark = pytest.mark.timeout(60)

SEED = 5
SPEC = [("w", "float32", [256, 1024]), ("b", "float32", [1024])]  # about 1 MiB
BIG = [*SPEC, ("extra", "float32", [256, 1024])]  # about 2 MiB
SIZE = spec_bytes(SPEC)
BUDGET = SIZE * 3 // 2  # one version, not two


@pytest.fixture
def relay(make_pub: Callable[..., WeightPublisher]) -> Iterator[tuple[WeightPublisher, ByteRelay]]:
    pub = make_pub(chunk_size=256 << 10)
    relay = ByteRelay.in_front_of(pub.endpoint)
    yield pub, relay
    relay.close()


def _same_w(staged: StagedVersion, version: int) -> bool:
    want = det_weights(SEED, version, SPEC)["w"]
    return torch.equal(as_bytes(staged.tensors["w"]), as_bytes(want))


def test_pool_counts_live_buffers_against_the_budget() -> None:
    pool = BufferPool(max_buffers=2, budget_bytes=1000, pinned=False)
    with pytest.raises(StagingBudgetError, match="more than the budget of 1000 bytes"):
        pool.room_for(1001)
    first = pool.take(600)
    assert pool.held_bytes == 600 and not pool.room_for(600)  # fits once `first` comes back
    with pytest.raises(StagingBudgetError):
        pool.take(600)
    pool.give(first)
    assert pool.held_bytes == 600  # kept for reuse, still counted
    assert pool.room_for(900)  # ... and dropped to make room for a bigger one
    assert pool.held_bytes == 0
    second = pool.take(900)
    assert pool.held_bytes == 900
    pool.forget(second.data_ptr())  # never coming back: no longer ours to count
    assert pool.held_bytes == 0


@pytest.mark.parametrize("budget", [0, -5, 1.5, True, "8GiB"])
def test_bad_budget_is_a_config_error_naming_the_option(budget: object) -> None:
    with pytest.raises(ConfigError, match="staging_budget_bytes"):
        WeightSubscriber("tcp://127.0.0.1:1", staging_budget_bytes=budget)  # type: ignore[arg-type]


def test_derived_budget_is_half_of_what_is_available() -> None:
    available = available_memory()
    assert 0 < available
    assert abs(derive_staging_budget() - available // 2) <= available // 10  # moves a little


def test_version_above_the_budget_is_refused_before_it_is_fetched(
    relay: tuple[WeightPublisher, ByteRelay], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub, counter = relay
    sub = make_sub(counter.endpoint, staging_budget_bytes=BUDGET, report_interval=0.2)
    pub.publish(det_weights(SEED, 1, SPEC))
    sub.wait_for_version(1, timeout=20).release()
    fetched = counter.bytes_down
    assert fetched >= SIZE

    big = pub.publish(det_weights(SEED, 2, BIG))
    wait_until(lambda: sub.status()["refused"], 20, "the refusal")
    status = sub.status()
    assert status["refused"].startswith("StagingBudgetError: version 2 refused before allocating")
    assert "staging_budget_bytes" in status["refused"] and status["last_error"] == \
        status["refused"]
    report = wait_until(lambda: [r for r in pub.fleet() if r.last_error], 20, "the report")[0]
    assert "StagingBudgetError" in report.last_error and report.staged_version == 1
    assert counter.bytes_down - fetched < 64 << 10  # not one chunk of it was fetched
    assert sub.latest().version == 1 and status["staging_bytes"] <= BUDGET
    assert big == 2

    pub.publish(det_weights(SEED, 3, SPEC))  # the next one that fits is staged as usual
    staged = sub.wait_for_version(3, timeout=20)
    assert _same_w(staged, 3)
    assert sub.status()["refused"] is None and sub.status()["last_error"] is None


def test_version_that_fits_once_a_held_one_is_released_waits_for_it(
    relay: tuple[WeightPublisher, ByteRelay], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub, counter = relay
    sub = make_sub(counter.endpoint, staging_budget_bytes=BUDGET)
    pub.publish(det_weights(SEED, 1, SPEC))
    held = sub.wait_for_version(1, timeout=20)
    fetched = counter.bytes_down

    pub.publish(det_weights(SEED, 2, SPEC))
    wait_until(lambda: sub.status()["waiting_for_memory"] == 2, 20, "version 2 to wait")
    assert counter.bytes_down - fetched < 64 << 10 and sub.status()["refused"] is None
    held.release()
    staged = sub.wait_for_version(2, timeout=20)
    assert _same_w(staged, 2)
    assert sub.status()["staging_bytes"] <= BUDGET


def test_a_version_dropped_without_release_stops_counting(
    relay: tuple[WeightPublisher, ByteRelay], make_sub: Callable[..., WeightSubscriber],
) -> None:
    """Versions nobody releases: each is freed (and uncounted) once a newer one replaces it
    as the subscriber's latest, so a budget of 2.5 versions takes any number of them."""
    pub, counter = relay
    budget = SIZE * 5 // 2
    sub = make_sub(counter.endpoint, staging_budget_bytes=budget)
    for version in (1, 2, 3, 4):
        pub.publish(det_weights(SEED, version, SPEC))
        staged = sub.wait_for_version(version, timeout=20)
        assert _same_w(staged, version)
        del staged
        gc.collect()
        assert sub.status()["staging_bytes"] <= budget


@pytest.mark.parametrize(("budget_versions", "deltas"), [(1.5, 0), (2.5, 1)])
def test_the_delta_base_is_given_up_when_only_it_stands_in_the_way(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
    budget_versions: float, deltas: int,
) -> None:
    """A subscriber keeps its newest version as the delta base. With room for the base and
    the next version, the next one arrives as a delta; with room for one version only, the
    base is dropped and the next version is fetched in full instead of waiting forever."""
    pub = make_pub(chunk_size=64 << 10, delta_anchor_every=4)
    sub = make_sub(pub.endpoint, staging_budget_bytes=int(SIZE * budget_versions))
    pub.publish(drift_weights(SEED, 1, SPEC))
    sub.wait_for_version(1, timeout=20).release()
    pub.publish(drift_weights(SEED, 2, SPEC))
    staged = sub.wait_for_version(2, timeout=20)
    want = drift_weights(SEED, 2, SPEC)
    assert all(torch.equal(as_bytes(staged.tensors[k]), as_bytes(v)) for k, v in want.items())
    status = sub.status()
    assert status["versions_delta"] == deltas and status["versions_full"] == 2 - deltas
    assert status["staging_bytes"] <= int(SIZE * budget_versions)
