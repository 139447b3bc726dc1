"""The publisher's host budget: a version that cannot fit is refused before it is allocated.

Real sockets: a subscriber keeps fetching from the publisher while ``publish()``
refuses, and what it stages afterwards is checked byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import zmq

from publisher import WeightPublisher
from publisher.publisher_config import PublisherConfig
from publisher.store.host_budget import DEFAULT_FRACTION
from subscriber_ext import WeightSubscriber
from tests.transport.faults.tools import RawPeer
from tests.transport.procs import as_bytes, det_weights, spec_bytes, wait_until
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ConfigError, StagingBudgetError
from weightpub_wire.host_memory import available_memory

pytestmark = pytest.mark.timeout(60)

SEED = 11
SPEC = [("w", "float32", [256, 1024]), ("b", "float32", [1024])]  # about 1 MiB
BIG = [*SPEC, ("extra", "float32", [512, 1024])]  # about 3 MiB
SIZE = spec_bytes(SPEC)


def _same(staged_tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(as_bytes(staged_tensors[name]), as_bytes(tensor))
               for name, tensor in weights.items())  # bit for bit (NaN patterns included)


def test_a_version_larger_than_the_budget_is_refused_and_the_old_one_stays_served(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    budget = SIZE * 5 // 2
    pub = make_pub(host_budget_bytes=budget, chunk_size=256 << 10)
    first = det_weights(SEED, 1, SPEC)
    assert pub.publish(first) == 1
    pub.wait_announced(1)
    held = pub.data_stats()["host_held_bytes"]

    with pytest.raises(StagingBudgetError) as refused:
        pub.publish(det_weights(SEED, 2, BIG))
    text = str(refused.value)
    assert "host_budget_bytes" in text and str(budget) in text
    assert str(spec_bytes(BIG)) in text  # the bytes the version needed
    assert pub.data_stats()["host_held_bytes"] == held  # nothing was allocated
    assert pub.latest_version == 1

    # a subscriber that starts now still gets version 1, bit for bit
    staged = make_sub(pub.endpoint).wait_for_version(1, timeout=20)
    assert staged.version == 1 and _same(staged.tensors, first)
    staged.release()

    # and the next version that fits takes the number the refused one did not use
    second = det_weights(SEED, 3, SPEC)
    assert pub.publish(second) == 2
    sub = make_sub(pub.endpoint)
    staged = sub.wait_for_version(2, timeout=20)
    assert _same(staged.tensors, second)
    staged.release()


def test_a_version_that_fits_alone_but_not_beside_the_kept_ones_names_keep_versions(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    # room for one version and a half: keep_versions=2 holds two snapshots whole
    pub = make_pub(host_budget_bytes=SIZE * 3 // 2, keep_versions=2)
    sub = make_sub(pub.endpoint)
    pub.publish(det_weights(SEED, 1, SPEC))
    sub.wait_for_version(1, timeout=20).release()
    with pytest.raises(StagingBudgetError, match=r"keep_versions=2.*host_budget_bytes"
                       r"|host_budget_bytes.*keep_versions=2"):
        pub.publish(det_weights(SEED, 2, SPEC))
    assert pub.latest_version == 1
    staged = make_sub(pub.endpoint).wait_for_version(1, timeout=20)
    assert _same(staged.tensors, det_weights(SEED, 1, SPEC))
    staged.release()

    # with keep_versions=1 (the default) the same budget serves every version: each
    # one is copied over the previous one's snapshot
    lean = make_pub(host_budget_bytes=SIZE * 3 // 2)
    lean_sub = make_sub(lean.endpoint)
    for version in (1, 2, 3, 4):
        lean.publish(det_weights(SEED, version, SPEC))
        staged = lean_sub.wait_for_version(version, timeout=20)
        assert _same(staged.tensors, det_weights(SEED, version, SPEC))
        staged.release()
    assert lean.data_stats()["host_held_bytes"] <= SIZE


@pytest.mark.parametrize("budget", [0, -1, 1.5, True])
def test_bad_host_budget_is_a_config_error_naming_the_option(budget: object) -> None:
    with pytest.raises(ConfigError, match="host_budget_bytes"):
        WeightPublisher("tcp://127.0.0.1:0", host_budget_bytes=budget)  # type: ignore[arg-type]


def test_the_derived_budget_is_a_share_of_what_is_available(
    make_pub: Callable[..., WeightPublisher],
) -> None:
    available = available_memory()
    budget = make_pub().data_stats()["host_budget_bytes"]
    assert abs(budget - available * DEFAULT_FRACTION) <= available // 10  # moves a little


def test_the_yaml_key_reaches_the_publisher() -> None:
    config = PublisherConfig(endpoint="tcp://127.0.0.1:0", host_budget_bytes=SIZE * 3)
    with WeightPublisher.from_config(config) as pub:
        assert pub.data_stats()["host_budget_bytes"] == SIZE * 3
        with pytest.raises(StagingBudgetError, match="host_budget_bytes"):
            pub.publish(det_weights(SEED, 1, BIG + [("more", "float32", [256, 1024])]))


def test_reply_scratch_stays_within_what_the_snapshots_leave_of_the_budget(
    make_pub: Callable[..., WeightPublisher],
) -> None:
    chunk = 256 << 10
    snapshot = 16 << 20
    room = 2 << 20  # the budget beside one snapshot
    pub = make_pub(host_budget_bytes=snapshot + room, chunk_size=chunk)
    weights = {"w": torch.ones(snapshot // 4)}
    pub.wait_announced(pub.publish(weights), timeout=20)
    manifest = pub.manifest(1)
    ctx: zmq.Context = zmq.Context()
    reader = RawPeer(ctx, pub.endpoint, rcvhwm=1)  # asks for everything, never reads
    try:
        chunks = tuple(range(len(manifest.checksums)))
        for start in range(0, len(chunks), 16):
            reader.send(wire.FetchRequest(req=start + 1, publisher_id=manifest.publisher_id,
                                          version=1, chunks=chunks[start:start + 16]))
        peak = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            peak = max(peak, int(pub.data_stats()["send_queued_bytes"]))
            time.sleep(0.01)
        assert 0 < peak <= room + chunk + 64, peak  # scratch within the budget's room
        # the snapshot buffer is reused by the next version: nothing else needs the room
        assert pub.publish({"w": torch.full((snapshot // 4,), 2.0)}) == 2
    finally:
        reader.close()
        ctx.destroy(linger=0)


def test_idle_reply_scratch_is_dropped_when_the_next_version_is_published(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    """Send buffers kept for reuse after a version was served would sit beside the next
    snapshot (up to each subscriber's window): a publish drops them."""
    pub = make_pub(chunk_size=256 << 10)
    sub = make_sub(pub.endpoint)
    pub.publish(det_weights(SEED, 1, BIG))
    sub.wait_for_version(1, timeout=20).release()
    sub.close()
    wait_until(lambda: pub.data_stats()["send_queued_bytes"] == 0, 10, "replies sent")
    assert pub.data_stats()["reply_scratch_bytes"] > 0  # idle, kept for the next version
    pub.publish(det_weights(SEED, 2, BIG))
    assert pub.data_stats()["reply_scratch_bytes"] == 0
