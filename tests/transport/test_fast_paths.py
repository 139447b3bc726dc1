"""The same-host data path (``ipc://``), the staging memory a subscriber keeps, and
the progress of a version while it arrives (``on_progress``).

Why: a replica on the trainer's host may use a Unix socket instead of loopback TCP
(``docs/benchmarks.md`` has the speeds); and a subscriber keeps its newest version
as a delta base only when its publisher serves deltas, else every version would
cost two staging buffers (and their first-touch page faults).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.progress import PartialVersion, ProgressFeed
from tests.transport.procs import Child, as_bytes, digests, roundtrip_case, scribble
from weightpub_wire.buffers import BufferPool

pytestmark = pytest.mark.timeout(90)


def test_ipc_endpoint_carries_versions_bit_exact_to_another_process(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child], tmp_path: Path,
) -> None:
    pub = make_pub(f"ipc://{tmp_path}/weights", chunk_size=4096)
    assert pub.endpoint == f"ipc://{tmp_path}/weights"
    sub = spawn("subscriber", endpoint=pub.endpoint, verify="roundtrip")
    sub.event("ready", timeout=60)
    sent = 0
    for version in (1, 2):
        source, expected, originals = roundtrip_case(version)
        sent += sum(t.numel() * t.element_size() for t in expected.values())
        assert pub.publish(source) == version
        scribble(originals)  # the snapshot, not the caller's tensors, is what travels
        got = sub.event("staged", timeout=30, version=version)
        assert got["mismatches"] == [], got["mismatches"]
        assert got["digests"] == digests(expected.items())
    status = sub.request("status")["status"]
    assert status["state"] == "ACTIVE"
    assert status["last_error"] is None
    assert status["received_bytes"] >= sent  # tensors plus their alignment padding


def _staging_after_three_versions(make_pub: Callable[..., WeightPublisher],
                                  make_sub: Callable[..., WeightSubscriber],
                                  anchor_every: int) -> tuple[dict, int]:
    pub = make_pub(chunk_size=1 << 16, delta_anchor_every=anchor_every)
    sub = make_sub(pub.endpoint)
    weights = {"w": torch.arange(1 << 18, dtype=torch.int32)}  # 1 MiB
    for version in (1, 2, 3):
        weights["w"][version] += 1
        pub.publish(weights)
        staged = sub.wait_for_version(version, timeout=30)
        assert torch.equal(as_bytes(staged.tensors["w"]), as_bytes(weights["w"]))
        staged.release()
    return sub.status(), pub.manifest(3).total_bytes


def test_no_delta_base_is_kept_when_the_publisher_sends_no_deltas(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    status, nbytes = _staging_after_three_versions(make_pub, make_sub, anchor_every=1)
    assert status["delta_base_version"] is None
    # every version reused the one buffer released before it: one version of staging
    assert status["staging_bytes"] == nbytes


def test_a_delta_base_is_kept_when_the_publisher_announces_deltas(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    status, nbytes = _staging_after_three_versions(make_pub, make_sub, anchor_every=8)
    assert status["delta_base_version"] == 3
    assert status["versions_delta"] == 2  # versions 2 and 3 came as deltas
    assert status["staging_bytes"] == 2 * nbytes  # the base and the buffer reused next


def test_progress_names_only_final_tensors_while_a_version_arrives(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    """``on_progress`` sees the version grow; every tensor it calls ready already holds
    the published bytes (checked inside the callback), and the staged version carries
    the same attempt."""
    weights = {f"layer{i}.w": torch.full((64, 1024), i, dtype=torch.int32) for i in range(12)}
    seen: list[tuple[int, int, int]] = []  # (attempt, ready count, wrong bytes)
    staged_q: queue.Queue = queue.Queue()

    def on_progress(partial: PartialVersion) -> None:
        ready = partial.ready()
        wrong = sum(not torch.equal(partial.tensors[n], weights[n]) for n in ready)
        seen.append((partial.attempt, len(ready), wrong))

    pub = make_pub(chunk_size=64 << 10)  # 256 KiB tensors: four chunks each
    make_sub(pub.endpoint, on_progress=on_progress, on_version=staged_q.put,
             window_bytes=128 << 10)  # two chunks in flight: many small steps
    pub.publish(weights)
    staged = staged_q.get(timeout=30)
    assert len(seen) >= 6, seen  # the version was seen growing, tensor by tensor
    assert [c for _, c, _ in seen] == sorted(c for _, c, _ in seen)
    assert all(wrong == 0 for _, _, wrong in seen), seen
    assert {a for a, _, _ in seen} == {staged.attempt}
    assert seen[-1][1] <= len(weights)


def test_a_reception_given_up_is_cancelled_and_a_new_one_gets_a_new_attempt(
    make_pub: Callable[..., WeightPublisher],
) -> None:
    pub = make_pub(chunk_size=4096)
    pub.publish({"a": torch.zeros(2048, dtype=torch.int32), "b": torch.ones(2048,
                                                                           dtype=torch.int32)})
    pub.wait_announced(1)
    manifest = pub.manifest(1)
    calls: list[tuple[int, int, bool]] = []
    current: list[Assembly] = []  # the client's target, as the feed sees it
    feed = ProgressFeed(lambda p: calls.append((p.attempt, p.ready_count(), p.cancelled)),
                        lambda: current[-1] if current else None)
    pool = BufferPool()
    first = Assembly(manifest, pool)
    assert first.order[:2] == [0, 1]  # "a" and "b" are both big: layout order among them
    current.append(first)
    feed.target_started(manifest)
    no_bytes = memoryview(b"")
    first.missing.discard(0)  # 4 KiB of 16: no tensor complete yet
    feed.chunk_verified(manifest, 0, no_bytes)
    assert calls == []
    first.missing.discard(1)  # "a" (8 KiB) is final
    feed.chunk_verified(manifest, 1, no_bytes)
    attempt = calls[-1][0]
    assert calls == [(attempt, 1, False)] and first.attempt == attempt
    feed.target_dropped(manifest)  # conflated or failed: whatever was built from it goes
    assert calls[-1] == (attempt, 1, True)
    first.abandon()
    second = Assembly(manifest, pool)  # the same version again, maybe in the same buffer
    current.append(second)
    feed.target_started(manifest)
    second.missing.difference_update({2, 3})  # "b" first this time
    feed.chunk_verified(manifest, 2, no_bytes)
    feed.chunk_verified(manifest, 3, no_bytes)
    assert calls[-1][0] != attempt and calls[-1][1:] == (1, False)
    second.missing.clear()  # complete: no partial, the staged version itself follows
    feed.chunk_verified(manifest, 0, no_bytes)
    assert len(calls) == 3
    staged = second.finish()  # the staged version carries the attempt its partials had
    feed.target_completed(manifest)
    assert staged.attempt == calls[-1][0]
    staged.release()


def test_the_largest_tensors_travel_first_and_are_copied_first() -> None:
    """The subscriber fetches, and the publisher copies, the largest tensors first (an
    untied lm_head at the end of the layout must not be the last thing to prepare)."""
    from publisher.store.snapshot import copy_in_priority_order, plan_snapshot
    from weightpub_wire.chunk_order import priority_chunks

    weights = {"embed": torch.ones(4096, dtype=torch.int32)}  # 16 KiB: big
    weights |= {f"layers.{i}.w": torch.full((256,), i, dtype=torch.int32) for i in range(8)}
    weights |= {"norm": torch.ones(16, dtype=torch.int32),
                "head": torch.full((8192,), 7, dtype=torch.int32)}  # 32 KiB, last: big
    snapshot, pairs = plan_snapshot(weights, BufferPool())
    copy_in_priority_order(snapshot, pairs, chunk_size=4096)
    assert snapshot.pending is not None and not any(snapshot.pending)  # every chunk final
    assert torch.equal(snapshot.buffer[-8192 * 4:].view(torch.int32), weights["head"])
    offsets = {e.name: e.offset for e in snapshot.entries}
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=4096)
    try:
        pub.publish(weights)
        pub.wait_announced(1)
        manifest = pub.manifest(1)
    finally:
        pub.close()
    order = priority_chunks(manifest)
    head_first = offsets["head"] // 4096
    assert (offsets["layers.0.w"], head_first, manifest.num_chunks) == (16384, 6, 15)
    assert order == [0, 1, 2, 3] + list(range(6, 15)) + [4, 5]  # embed, head, the rest
