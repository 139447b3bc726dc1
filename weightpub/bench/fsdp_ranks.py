"""FSDP2 trainer ranks on CPU: gloo processes holding a ``fully_shard`` model.

Why: the FSDP harnesses (``fsdp_streaming.py`` here, ``tests/transport/shard_procs.py``
and ``test_sharded.py``) each start ``world_size`` spawned ranks, join a gloo group,
build the same model with every block ``fully_shard``-ed, talk to the parent over a
pipe and leave together; this module is that setup, once. ``FsdpRanks`` (the parent)
spawns the ranks; each runs ``body(Rank, *args)`` inside the group, and
``sharded_publisher`` gives every rank its ``ShardedPublisher`` (rank 0's coordinator
address handed to the others over the group).

The model (``ModelShape``) is decoder-shaped and seeded block by block, so any
process can rebuild the expected bytes one block at a time (``expected_tensors``).
A rank talks in tuples, ``(kind, *values)``; an exception in ``body`` is sent as
``("error", traceback)`` and the rank exits 1. ``timeout`` bounds gloo's
collectives too (``init_process_group(timeout=)``): a collective with a dead peer
raises within it rather than waiting forever.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from weightpub_wire.collective_group import scoped_environment
from weightpub_wire.dtypes import parse_dtype
from weightpub_wire.errors import ConfigError

if TYPE_CHECKING:
    from publisher.sharded_publisher import ShardedPublisher

__all__ = ["FsdpRanks", "ModelShape", "Rank", "RankBody", "build_block", "expected_tensors",
           "fsdp_model", "local_bytes", "model_bytes", "resident_bytes", "sharded_publisher"]

#: what a rank runs inside its group: ``body(Rank, *args)``
RankBody = Callable[..., None]


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
        return parse_dtype(self.dtype, field="ModelShape.dtype", error=ConfigError)


@dataclass(frozen=True, slots=True)
class Rank:
    """What a rank's ``body`` gets: its place, its model, its pipe to the parent."""

    rank: int
    world_size: int
    model: torch.nn.Module
    conn: Any
    start_rss: int  # resident bytes once the group was up, before the model was built


class _Block(torch.nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(shape.hidden, dtype=shape.torch_dtype)
        self.proj = torch.nn.Linear(shape.hidden, shape.hidden, bias=False,
                                    dtype=shape.torch_dtype)


class _Model(torch.nn.Module):
    """Built one block at a time, each sharded (``shard``) before the next exists."""

    def __init__(self, shape: ModelShape, shard: Callable[[torch.nn.Module], Any] | None = None,
                 ) -> None:
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


def model_bytes(shape: ModelShape) -> int:
    """The whole model's bytes (from its shapes: nothing is built)."""
    item = torch.empty((), dtype=shape.torch_dtype).element_size()
    h = shape.hidden
    return item * (2 * shape.vocab * h + shape.layers * (h * h + 2 * h))


def fsdp_model(shape: ModelShape, mesh: Any) -> torch.nn.Module:
    """``shape`` with every block and then the root ``fully_shard``-ed over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    model = _Model(shape, shard=lambda block: fully_shard(block, mesh=mesh))
    fully_shard(model, mesh=mesh)
    return model


def local_bytes(model: torch.nn.Module) -> int:
    """The bytes of the parameters this rank holds (its FSDP shards)."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's ``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def sharded_publisher(rank: Rank, **keywords: Any) -> ShardedPublisher:
    """This rank's ``ShardedPublisher``: rank 0 runs the coordinator (announcing on any
    free port) and hands its collect address to the other ranks over the group."""
    import torch.distributed as dist

    from publisher.sharded_publisher import ShardedPublisher

    world = rank.world_size
    first = ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=world,
                             coordinator="tcp://127.0.0.1:0",
                             announce_endpoint="tcp://127.0.0.1:0",
                             **keywords) if rank.rank == 0 else None
    collect = [None if first is None or first.coordinator is None
               else first.coordinator.collect_endpoint]
    dist.broadcast_object_list(collect, src=0)
    return first or ShardedPublisher("tcp://127.0.0.1:0", rank=rank.rank, world_size=world,
                                     coordinator=str(collect[0]), **keywords)


def _rank_main(body: RankBody, rank: int, world_size: int, store: str, conn: Any,
               shape: ModelShape, timeout: float, args: tuple[Any, ...]) -> None:
    """A spawned rank: join the group, build the model, run ``body``, leave together."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    code = 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout))
    try:
        # the start: a trainer ready to build its model (libraries loaded, group up)
        for module in ("publisher.sharded_publisher", "torch.distributed.fsdp"):
            importlib.import_module(module)
        start = resident_bytes()
        model = fsdp_model(shape, init_device_mesh("cpu", (world_size,)))
        body(Rank(rank, world_size, model, conn, start), *args)
        dist.barrier()  # leave together: gloo aborts a rank whose peer left first
    except BaseException:
        code = 1
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except OSError:
            pass
    finally:
        dist.destroy_process_group()
        conn.close()
    # skip interpreter teardown: torch's static thread pools may abort a clean exit
    # ("terminate called without an active exception"); the group is destroyed above
    os._exit(code)


class FsdpRanks:
    """``world_size`` spawned FSDP2 gloo ranks, each running ``body`` on ``shape``.

    ``env``: extra environment for the ranks (e.g. ``MALLOC_MMAP_THRESHOLD_``; glibc reads
    it at a process's start, so with ``start_method="forkserver"``, a few seconds
    quicker to start where torch is preloaded, only when this starts the server).
    Every wait is bounded by ``timeout``; ``close()`` joins (or kills) the ranks and
    returns their exit codes (``errors``: what failed ranks said that was not read).
    """

    def __init__(self, body: RankBody, world_size: int, shape: ModelShape, *args: Any,
                 timeout: float = 60.0, env: dict[str, str] | None = None,
                 start_method: str = "spawn") -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.errors: list[str] = []  # ("error", traceback) messages left unread at close
        self._closed = False
        self._folder = tempfile.TemporaryDirectory(prefix="wp-fsdp-")
        ctx: Any = mp.get_context(start_method)
        if start_method == "forkserver":  # torch imported once, in the server
            ctx.set_forkserver_preload(["torch", "torch.distributed.fsdp",
                                        "publisher.sharded_publisher", __name__])
        self._pipes = [ctx.Pipe() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_rank_main, daemon=True, args=(
            body, rank, world_size, f"{self._folder.name}/store", self._pipes[rank][1], shape,
            timeout, args)) for rank in range(world_size)]
        with scoped_environment(env or {}):
            for proc in self.procs:
                proc.start()
        for _, theirs in self._pipes:
            theirs.close()

    def expect(self, rank: int, kind: str, timeout: float | None = None) -> tuple[Any, ...]:
        """The values of rank ``rank``'s next message, which must be ``kind``."""
        conn = self._pipes[rank][0]
        wait = self.timeout if timeout is None else timeout
        if not conn.poll(wait):
            raise TimeoutError(f"rank {rank}: no {kind!r} within {wait}s")
        try:
            got, *values = conn.recv()
        except EOFError:
            self.procs[rank].join(5)
            raise RuntimeError(f"rank {rank} ended (exit code {self.procs[rank].exitcode}) "
                               f"before sending {kind!r}") from None
        if got == "error" and kind != "error":
            raise RuntimeError(values[0])
        if got != kind:
            raise RuntimeError(f"rank {rank}: expected {kind!r}, got {(got, *values)!r}")
        return tuple(values)

    def send(self, rank: int, message: Any) -> None:
        self._pipes[rank][0].send(message)

    def send_all(self, message: Any) -> None:
        for rank in range(self.world_size):
            self.send(rank, message)

    def kill9(self, rank: int) -> None:
        self.procs[rank].kill()
        self.procs[rank].join(self.timeout)

    def close(self, timeout: float | None = None) -> list[int | None]:
        """Join every rank (killing one still alive after ``timeout``); their exit codes."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for ours, _ in self._pipes:
            try:
                while ours.poll(0):  # what a failed rank said last
                    message = ours.recv()
                    if message[0] == "error":
                        self.errors.append(message[1])
            except (EOFError, OSError):
                pass
            ours.close()
        self._folder.cleanup()
        self._closed = True
        return [proc.exitcode for proc in self.procs]

    def __enter__(self) -> FsdpRanks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._closed:
            self.close()

