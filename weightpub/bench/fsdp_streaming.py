"""Per-rank memory while publishing an FSDP2 model: two gloo ranks on CPU, one subscriber.

Why: ``publish()`` gathers sharded (DTensor) weights one layer group at a time
(``publisher/streamed_sources.py``) so that no rank materializes the whole
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
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from publisher.streamed_sources import layer_groups
from weightpub_wire.collective_group import scoped_environment

__all__ = ["ModelShape", "RankFigures", "StreamingRun", "build_block", "run_streaming"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder-shaped model: embedding, ``layers`` blocks, final norm, head."""

    layers: int = 8
    hidden: int = 512
    vocab: int = 256
    dtype: str = "float32"
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype), self.dtype
        return dtype


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


class _Block(torch.nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(shape.hidden, dtype=shape.torch_dtype)
        self.proj = torch.nn.Linear(shape.hidden, shape.hidden, bias=False,
                                    dtype=shape.torch_dtype)


class _Model(torch.nn.Module):
    """Built one block at a time, each sharded (``shard``) before the next exists."""

    def __init__(self, shape: ModelShape, shard: Any = None) -> None:
        super().__init__()
        self.embed = build_block(shape, "embed")
        self.layers = torch.nn.ModuleList()
        for index in range(shape.layers):
            block = build_block(shape, index)
            if shard is not None:
                shard(block)
            self.layers.append(block)
        self.head = build_block(shape, "head")


def build_block(shape: ModelShape, which: int | str) -> torch.nn.Module:
    """One block of the model, the same on every process (seeded by its position)."""
    seed = shape.seed * 1000 + (which if isinstance(which, int) else
                                {"embed": 998, "head": 999}[which])
    torch.manual_seed(seed)
    if which == "embed":
        return torch.nn.Embedding(shape.vocab, shape.hidden, dtype=shape.torch_dtype)
    if which == "head":
        return torch.nn.Linear(shape.hidden, shape.vocab, bias=False, dtype=shape.torch_dtype)
    block = _Block(shape)
    with torch.no_grad():  # LayerNorm starts at ones/zeros: make every byte count
        block.norm.weight.normal_()
        block.norm.bias.normal_()
    return block


def expected_tensors(shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state, one block at a time (so checking holds one block)."""
    blocks: list[tuple[str, int | str]] = [("embed", "embed")]
    blocks += [(f"layers.{i}", i) for i in range(shape.layers)]
    for prefix, which in [*blocks, ("head", "head")]:
        block = build_block(shape, which)
        for name, tensor in block.state_dict().items():
            yield f"{prefix}.{name}", tensor


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(rank: int, store: str, conn: Any, shape: ModelShape, timeout: float) -> None:
    """One trainer rank: FSDP2 over two gloo ranks; rank 0 publishes, rank 1 gathers."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from publisher import WeightPublisher, gather_full_tensors

    code = 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout))
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = _Model(shape, shard=lambda block: fully_shard(block, mesh=mesh))
        fully_shard(model, mesh=mesh)
        pub = WeightPublisher("tcp://127.0.0.1:0", keep_versions=1) if rank == 0 else None
        if pub is not None:
            conn.send(("endpoint", pub.endpoint))
        gc.collect()
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        base = _status_bytes("VmRSS")
        start = time.perf_counter()
        if pub is not None:
            version = pub.publish(model)
        else:
            gather_full_tensors(model)
        seconds = time.perf_counter() - start
        peak = _status_bytes("VmHWM")
        snapshot = 0
        if pub is not None:
            pub.wait_announced(version, timeout)
            snapshot = pub.manifest(version).total_bytes
        conn.send(("figures", RankFigures(rank, peak - base - snapshot, snapshot, seconds)))
        if pub is not None:
            pub.wait_for_subscribers(version, 1, applied=False, timeout=timeout)
            conn.send(("served", version))
            pub.close()
        dist.barrier()  # leave together: gloo aborts a rank whose peer left first
    except BaseException:
        code = 1
        conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()
        conn.close()
    # skip interpreter teardown: torch's static thread pools may abort a clean exit
    # ("terminate called without an active exception"); the group is destroyed above
    os._exit(code)


def run_streaming(shape: ModelShape, *, timeout: float = 120.0,
                  malloc_mmap_threshold: int | None = 128 << 10) -> StreamingRun:
    """Two FSDP2 ranks publish ``shape`` once; a subscriber here checks every byte."""
    from subscriber_ext import WeightSubscriber

    ctx = mp.get_context("spawn")
    env = {} if malloc_mmap_threshold is None else \
        {"MALLOC_MMAP_THRESHOLD_": str(malloc_mmap_threshold)}
    with tempfile.TemporaryDirectory(prefix="wp-fsdp-") as folder:
        pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
        procs = [ctx.Process(target=_rank, args=(r, f"{folder}/store", pipes[r][1], shape,
                                                 timeout), daemon=True) for r in range(2)]
        with scoped_environment(env):
            for proc in procs:
                proc.start()
        for _, send in pipes:
            send.close()
        try:
            messages: dict[str, Any] = {}
            figures: list[RankFigures] = []

            def expect(rank: int, kind: str) -> Any:
                conn = pipes[rank][0]
                if not conn.poll(timeout):
                    raise TimeoutError(f"rank {rank}: no {kind!r} within {timeout}s")
                got, value = conn.recv()
                if got == "error":
                    raise RuntimeError(value)
                if got != kind:
                    raise RuntimeError(f"rank {rank}: expected {kind!r}, got {got!r}")
                return value

            messages["endpoint"] = expect(0, "endpoint")
            with WeightSubscriber(messages["endpoint"], report_interval=0.2) as sub:
                figures = [expect(0, "figures"), expect(1, "figures")]
                staged = sub.wait_for_version(1, timeout=timeout)
                verified = 0
                for name, want in expected_tensors(shape):
                    got = staged.tensors[name]
                    if got.dtype != want.dtype or not torch.equal(got, want):
                        raise AssertionError(f"{name}: received bytes differ from the model")
                    verified += 1
                if verified != len(staged.tensors):
                    raise AssertionError(f"received {len(staged.tensors)} tensors, "
                                         f"the model has {verified}")
                sizes = {n: t.numel() * t.element_size() for n, t in staged.tensors.items()}
                staged.release()
                expect(0, "served")
        finally:
            for proc in procs:
                proc.join(timeout)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        codes = [p.exitcode for p in procs]
        if codes != [0, 0]:
            raise RuntimeError(f"rank exit codes {codes}")
    groups = layer_groups(list(sizes))
    return StreamingRun(ranks=figures, model_bytes=sum(sizes.values()),
                        largest_group_bytes=max(sum(sizes[n] for n in g) for g in groups),
                        verified_tensors=verified)
