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


def test_replies_are_the_snapshots_own_bytes_and_a_non_reader_cannot_hold_the_next_version(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    """A peer that asks for a whole version and never reads: ZeroMQ holds the version's
    chunks, sent from the snapshot itself (no scratch, nothing beyond the budget's room),
    and the next version, copied over that snapshot, waits only until the serving thread
    cuts the non-reader (``overwrite_grace``); then it is staged bit for bit."""
    chunk = 256 << 10
    snapshot = 16 << 20
    room = 2 << 20  # the budget beside one snapshot
    # ZMTP heartbeats would drop the non-reader after 3 intervals: make that 15 s here
    pub = make_pub(host_budget_bytes=snapshot + room, chunk_size=chunk, heartbeat_interval=5.0)
    weights = {"w": torch.ones(snapshot // 4)}
    pub.wait_announced(pub.publish(weights), timeout=20)
    manifest = pub.manifest(1)
    claims = pub._store.claims(pub._store.get(1).buffer)  # type: ignore[union-attr]
    ctx: zmq.Context = zmq.Context()
    reader = RawPeer(ctx, pub.endpoint, rcvhwm=1)  # asks for everything, never reads
    try:
        chunks = tuple(range(len(manifest.checksums)))
        for start in range(0, len(chunks), 16):
            reader.send(wire.FetchRequest(req=start + 1, publisher_id=manifest.publisher_id,
                                          version=1, chunks=chunks[start:start + 16]))
        wait_until(lambda: pub.data_stats()["send_queued_bytes"] > 4 * room, 10,
                   "the whole version handed to ZeroMQ")
        time.sleep(0.3)
        stats = pub.data_stats()
        assert stats["reply_scratch_bytes"] == 0, stats  # no copy: the snapshot's own bytes
        assert claims.sends_in_flight > 0  # counted in the buffer's claims while held
        assert stats["host_held_bytes"] == snapshot
        begun = time.monotonic()
        second = {"w": torch.full((snapshot // 4,), 2.0)}
        assert pub.publish(second) == 2  # over the same buffer, once the sends are gone
        sub = make_sub(pub.endpoint)
        staged = sub.wait_for_version(2, timeout=30)
        waited = time.monotonic() - begun
        assert _same(dict(staged.items()), second)
        assert pub._server.peers is not None and pub._server.peers.cut_peers >= 1
        assert waited < 15, waited  # overwrite_grace (2 s), not stall_timeout (30 s)
        wait_until(lambda: claims.sends_in_flight == 0, 10, "the cut peer's frames freed")
        staged.release()
        assert pub.data_stats()["host_held_bytes"] == snapshot
    finally:
        reader.close()
        ctx.destroy(linger=0)


def test_serving_a_version_allocates_no_reply_scratch(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    """Protocol 3 copied each chunk behind its header into scratch, once per subscriber;
    now a chunk's payload is the snapshot's memory and no scratch is ever taken."""
    pub = make_pub(chunk_size=256 << 10)
    taken: list[int] = []
    wait_until(lambda: pub._server.peers is not None, 10, "the serving thread")
    peers = pub._server.peers
    assert peers is not None
    original = peers.scratch.take
    peers.scratch.take = lambda n: taken.append(n) or original(n)  # type: ignore[method-assign]
    subs = [make_sub(pub.endpoint) for _ in range(2)]
    weights = det_weights(SEED, 1, BIG)
    pub.publish(weights)
    for sub in subs:
        staged = sub.wait_for_version(1, timeout=20)
        assert _same(dict(staged.items()), weights)
        staged.release()
    assert pub.data_stats()["bytes_sent_full"] >= 2 * spec_bytes(BIG)
    wait_until(lambda: pub.data_stats()["send_queued_bytes"] == 0, 10, "replies sent")
    assert taken == [] and pub.data_stats()["reply_scratch_bytes"] == 0
