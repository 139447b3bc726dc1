"""Per-rank memory while publishing an FSDP2 model: two gloo ranks on CPU, one subscriber.

Why: ``publish()`` gathers sharded (DTensor) weights one layer group at a time
(``publisher/sources/streamed_copy.py``) so that no rank materializes the whole
model. This harness shows it from outside the code under test: each rank
process reads its own peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` just before the publish) beyond the resident set at
that moment. Rank 0 publishes (its snapshot, one version's bytes, is subtracted:
it is the version, not a gather), rank 1 runs ``gather_full_tensors``; the
calling process subscribes and checks every tensor bit for bit against the
model rebuilt one block at a time.

The children run with ``MALLOC_MMAP_THRESHOLD_`` fixed (128 KiB by default):
glibc otherwise raises its threshold after the first large free and keeps later
freed tensors in its heap, resident, so the resident set would count memory the
next gather reuses rather than memory held. ``benchmarks/fsdp_streaming.py``
runs it at >= 1 GiB; ``tests/transport/test_streamed_sources.py`` at a few MiB.

Sharded (``run_sharded``): every one of N ranks publishes its own shard through a
``ShardedPublisher`` (each keeps about 1/N of the model) and the subscriber here
receives the union, bit for bit, for two versions (a +1 'training step' between).
Each rank reports its peak resident set (``VmHWM``, reset just before each
publish, read once the subscriber has the version) over its resident set at start
(group up, model not yet built) minus its FSDP parameter shards: what publishing
costs beyond the source, as a multiple of its shard. The ranks and the model are
``fsdp_ranks.py``'s.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from publisher.sharding.shard_coordinator import SHARD_PAD
from publisher.sources.layer_grouping import layer_groups
from weightpub.bench.fsdp_ranks import (
    FsdpRanks,
    ModelShape,
    Rank,
    build_block,
    expected_tensors,
    local_bytes,
    resident_bytes,
    sharded_publisher,
)

__all__ = ["ModelShape", "RankFigures", "ShardRankFigures", "ShardedRun", "StreamingRun",
           "build_block", "expected_tensors", "run_sharded", "run_streaming"]


@dataclass(frozen=True, slots=True)
class RankFigures:
    """One rank's peak resident bytes beyond its resident set just before the publish."""

    rank: int
    peak_extra_bytes: int  # rank 0: beyond its snapshot too
    snapshot_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class StreamingRun:
    ranks: list[RankFigures]
    model_bytes: int
    largest_group_bytes: int
    verified_tensors: int

    def row(self) -> dict[str, Any]:
        """The figures as multiples of the largest group and of the model."""
        out: dict[str, Any] = {"model_mib": round(self.model_bytes / 2**20, 1),
                               "largest_group_mib": round(self.largest_group_bytes / 2**20, 1),
                               "verified_tensors": self.verified_tensors}
        for r in self.ranks:
            out[f"rank{r.rank}_extra_mib"] = round(r.peak_extra_bytes / 2**20, 1)
            out[f"rank{r.rank}_x_group"] = round(r.peak_extra_bytes / self.largest_group_bytes, 2)
            out[f"rank{r.rank}_x_model"] = round(r.peak_extra_bytes / self.model_bytes, 3)
            out[f"rank{r.rank}_seconds"] = round(r.seconds, 2)
        return out


def _rank(r: Rank, timeout: float) -> None:
    """One trainer rank of two: rank 0 publishes, rank 1 gathers."""
    import torch.distributed as dist

    from publisher import WeightPublisher, gather_full_tensors

    pub = WeightPublisher("tcp://127.0.0.1:0", keep_versions=1) if r.rank == 0 else None
    if pub is not None:
        r.conn.send(("endpoint", pub.endpoint))
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    base = resident_bytes()
    start = time.perf_counter()
    if pub is not None:
        version = pub.publish(r.model)
    else:
        gather_full_tensors(r.model)
    seconds = time.perf_counter() - start
    peak = resident_bytes("VmHWM")
    snapshot = 0
    if pub is not None:
        pub.wait_announced(version, timeout)
        snapshot = pub.manifest(version).total_bytes
    r.conn.send(("figures", RankFigures(r.rank, peak - base - snapshot, snapshot, seconds)))
    if pub is not None:
        pub.wait_for_subscribers(version, 1, applied=False, timeout=timeout)
        r.conn.send(("served", version))
        pub.close()


def _verify(staged: Any, shape: ModelShape, steps: int = 0) -> int:
    """Check every received tensor against the model after ``steps`` +1 steps; the number
    checked."""
    verified = 0
    for name, want in expected_tensors(shape):
        for _ in range(steps):  # as the ranks did: one add at a time
            want = want + 1.0
        got = staged.tensors[name]
        if got.dtype != want.dtype or not torch.equal(got, want):
            raise AssertionError(f"{name}: received bytes differ from the model")
        verified += 1
    if verified != len(staged.tensors):
        raise AssertionError(f"received {len(staged.tensors)} tensors, the model has {verified}")
    return verified


def _mmap_env(threshold: int | None) -> dict[str, str]:
    return {} if threshold is None else {"MALLOC_MMAP_THRESHOLD_": str(threshold)}


def run_streaming(shape: ModelShape, *, timeout: float = 120.0,
                  malloc_mmap_threshold: int | None = 128 << 10) -> StreamingRun:
    """Two FSDP2 ranks publish ``shape`` once; a subscriber here checks every byte."""
    from subscriber_ext import WeightSubscriber

    with FsdpRanks(_rank, 2, shape, timeout, timeout=timeout,
                   env=_mmap_env(malloc_mmap_threshold)) as ranks:
        (endpoint,) = ranks.expect(0, "endpoint")
        with WeightSubscriber(endpoint, report_interval=0.2) as sub:
            figures: list[RankFigures] = [ranks.expect(rank, "figures")[0] for rank in (0, 1)]
            staged = sub.wait_for_version(1, timeout=timeout)
            verified = _verify(staged, shape)
            sizes = {n: t.numel() * t.element_size() for n, t in staged.tensors.items()}
            staged.release()
            ranks.expect(0, "served")
        codes = ranks.close()
    if codes != [0, 0]:
        raise RuntimeError(f"rank exit codes {codes}: {ranks.errors}")
    groups = layer_groups(list(sizes))
    return StreamingRun(ranks=figures, model_bytes=sum(sizes.values()),
                        largest_group_bytes=max(sum(sizes[n] for n in g) for g in groups),
                        verified_tensors=verified)


# -- sharded: every rank publishes its own shard (ShardedPublisher) ---------------------------
@dataclass(frozen=True, slots=True)
class ShardRankFigures:
    """One sharded rank's resident bytes: at its start, holding its FSDP source, at peak."""

    rank: int
    start_rss: int  # the group up, before the model was built
    source_bytes: int  # its FSDP parameter shards
    base_rss: int  # just before the first publish (model built)
    peaks: tuple[int, ...]  # VmHWM per version: publish, submit, serve (reset in between)
    submitted_peaks: tuple[int, ...]  # VmHWM per version once submitted, before serving
    shard_bytes: int  # its shard of the union (tensors it owns)
    held_bytes: int  # its snapshot (shard + pad to a chunk)
    seconds: tuple[float, ...]  # publish() per version


@dataclass(frozen=True, slots=True)
class ShardedRun:
    ranks: list[ShardRankFigures]
    model_bytes: int
    verified_tensors: int

    def row(self) -> dict[str, Any]:
        """Per rank: peak over its start beyond its source, as a multiple of its shard."""
        out: dict[str, Any] = {"world_size": len(self.ranks),
                               "model_mib": round(self.model_bytes / 2**20, 1),
                               "verified_tensors": self.verified_tensors}
        for r in self.ranks:
            over = max(r.peaks) - r.start_rss - r.source_bytes
            out[f"rank{r.rank}_shard_mib"] = round(r.shard_bytes / 2**20, 1)
            out[f"rank{r.rank}_shard_x_model"] = round(r.shard_bytes / self.model_bytes, 3)
            out[f"rank{r.rank}_over_start_mib"] = round(over / 2**20, 1)
            out[f"rank{r.rank}_x_shard"] = round(over / r.shard_bytes, 2)
            out[f"rank{r.rank}_built_over_source_mib"] = round(
                (r.base_rss - r.start_rss - r.source_bytes) / 2**20, 1)
            out[f"rank{r.rank}_publish_x_shard"] = [
                round((peak - r.base_rss) / r.shard_bytes, 2) for peak in r.peaks]
            out[f"rank{r.rank}_submitted_x_shard"] = [
                round((peak - r.base_rss) / r.shard_bytes, 2) for peak in r.submitted_peaks]
            out[f"rank{r.rank}_seconds"] = [round(t, 2) for t in r.seconds]
        return out


def _shard_rank(r: Rank, chunk_size: int, versions: int, timeout: float) -> None:
    """A rank of a ``ShardedPublisher``: publishes ``versions`` versions of its model,
    each after a 'training step' (+1 on every parameter), each served before the next."""
    import torch.distributed as dist

    pub = sharded_publisher(r, chunk_size=chunk_size, keep_versions=1)
    if pub.coordinator is not None:
        r.conn.send(("announce", pub.coordinator.endpoint))
    source = local_bytes(r.model)
    gc.collect()
    dist.barrier()
    base = resident_bytes()
    peaks: list[int] = []
    submitted: list[int] = []
    seconds: list[float] = []
    for version in range(1, versions + 1):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        if version > 1:
            with torch.no_grad():  # in place: no new memory
                for parameter in r.model.parameters():
                    parameter.add_(1.0)
        start = time.perf_counter()
        pub.publish(r.model, version=version)
        seconds.append(time.perf_counter() - start)
        pub.wait_submitted(version, timeout)
        submitted.append(resident_bytes("VmHWM"))
        r.conn.send(("submitted", version))
        if not r.conn.poll(timeout) or r.conn.recv() != ("served", version):
            raise TimeoutError(f"rank {r.rank}: version {version} not served in {timeout}s")
        peaks.append(resident_bytes("VmHWM"))
    manifest = pub.shard.manifest(versions)
    shard = sum(t.nbytes for t in manifest.tensors if t.name != SHARD_PAD)
    r.conn.send(("figures", ShardRankFigures(
        r.rank, r.start_rss, source, base, tuple(peaks), tuple(submitted), shard,
        int(pub.shard.data_stats()["host_held_bytes"]), tuple(seconds))))
    pub.close()


def run_sharded(shape: ModelShape, world_size: int, *, chunk_size: int = 1 << 20,
                versions: int = 2, timeout: float = 300.0, window_bytes: int | None = None,
                malloc_mmap_threshold: int | None = 128 << 10) -> ShardedRun:
    """``world_size`` FSDP2 ranks each publish their shard of ``shape`` (``versions``
    times); a subscriber here receives the union and checks every byte of each.
    ``window_bytes``: the subscriber's (default: its own), what a rank's reply scratch
    holds at most while serving it."""
    from subscriber_ext import WeightSubscriber

    with FsdpRanks(_shard_rank, world_size, shape, chunk_size, versions, timeout,
                   timeout=timeout, env=_mmap_env(malloc_mmap_threshold)) as ranks:
        (announce,) = ranks.expect(0, "announce")
        window: dict[str, Any] = {} if window_bytes is None else {"window_bytes": window_bytes}
        with WeightSubscriber(announce, request_timeout=5.0, **window) as sub:
            for version in range(1, versions + 1):
                for rank in range(world_size):
                    ranks.expect(rank, "submitted")
                staged = sub.wait_for_version(version, timeout=timeout)
                verified = _verify(staged, shape, steps=version - 1)
                total = sum(t.numel() * t.element_size() for t in staged.tensors.values())
                staged.release()
                del staged
                ranks.send_all(("served", version))
        figures = [ranks.expect(rank, "figures")[0] for rank in range(world_size)]
        codes = ranks.close()
    if codes != [0] * world_size:
        raise RuntimeError(f"rank exit codes {codes}: {ranks.errors}")
    return ShardedRun(ranks=figures, model_bytes=total, verified_tensors=verified)
