"""A trainer rank of a ``ShardedPublisher`` in its own process (``test_sharded.py``).

Run through ``python -m tests.transport.procs shard_rank '<json args>'``. The rank
publishes ``det_weights(seed, version, spec)`` of its own ``spec`` on command, so
the test can recompute every byte; rank 0 also runs the coordinator and says
where subscribers and the other ranks dial it.
"""

from __future__ import annotations

import os
import resource
import threading
import traceback
from typing import Any

from tests.transport.procs import _commands, _emit, det_weights, spec_bytes


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Sampler:
    """The highest RSS seen while it runs (sampled every 2 ms): a publish's own peak."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss())


def run_shard_rank(args: dict[str, Any]) -> None:
    from publisher.sharded_publisher import ShardedPublisher

    spec = [(name, dtype, tuple(shape)) for name, dtype, shape in args["spec"]]
    start_rss = _peak_rss()
    pub = ShardedPublisher(
        args.get("endpoint", "tcp://127.0.0.1:0"), rank=args["rank"],
        world_size=args["world_size"], coordinator=args.get("coordinator", "tcp://127.0.0.1:0"),
        announce_endpoint=args.get("announce_endpoint"), chunk_size=args["chunk_size"],
        shard_timeout=args.get("shard_timeout", 30.0), heartbeat_interval=0.2)
    coordinator = pub.coordinator
    _emit(event="ready", endpoint=pub.endpoint,
          announce=None if coordinator is None else coordinator.endpoint,
          collect=None if coordinator is None else coordinator.collect_endpoint)
    commands = _commands()
    growth = 0  # the largest publish's peak RSS over the RSS with its source held
    while True:
        command = commands.get()
        name = command.get("cmd")
        if name == "exit":
            break
        if name == "publish":
            version = int(command["version"])
            weights = det_weights(args["seed"], version, spec)
            before = _rss()
            sampler = _Sampler()
            pub.publish(weights, version=version)
            pub.wait_submitted(version, timeout=30)
            growth = max(growth, sampler.stop() - before)
            del weights
            _emit(event="published", id=command.get("id"), version=version)
        elif name == "status":
            _emit(event="status", id=command.get("id"), peak_rss=_peak_rss(),
                  start_rss=start_rss, publish_growth=growth, shard_bytes=spec_bytes(spec),
                  held_bytes=pub.shard.data_stats()["host_held_bytes"],
                  announced=None if coordinator is None else coordinator.latest_version,
                  dropped=None if coordinator is None else coordinator.dropped_versions,
                  last_error=None if coordinator is None else coordinator.last_error)
    pub.close()


def run_fsdp_shard_rank(rank: int, store: str, conn: Any, shape: Any, chunk_size: int,
                        timeout: float) -> None:
    """One FSDP2 gloo rank (of two) of a ``ShardedPublisher``, in a ``spawn`` process.

    Every rank passes the whole sharded model; rank 0 also runs the coordinator and
    hands its collect address to rank 1 over the process group. Sends
    ``("announce", endpoint)`` (rank 0), then ``("shard", bytes held, shard total)``
    for version 1, waits for ``"more"``, adds 1 to every parameter, publishes
    version 2 the same way and closes on ``"done"`` (``test_sharded.py``).
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from publisher.sharded_publisher import ShardedPublisher
    from weightpub.bench.fsdp_streaming import build_block

    code = 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout))
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = torch.nn.Module()
        model.embed = build_block(shape, "embed")
        model.layers = torch.nn.ModuleList()
        for index in range(shape.layers):
            block = build_block(shape, index)
            fully_shard(block, mesh=mesh)
            model.layers.append(block)
        model.head = build_block(shape, "head")
        fully_shard(model, mesh=mesh)
        first = ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=2,
                                 coordinator="tcp://127.0.0.1:0",
                                 announce_endpoint="tcp://127.0.0.1:0",
                                 chunk_size=chunk_size) if rank == 0 else None
        collect = [None if first is None or first.coordinator is None
                   else first.coordinator.collect_endpoint]
        dist.broadcast_object_list(collect, src=0)
        pub = first or ShardedPublisher("tcp://127.0.0.1:0", rank=rank, world_size=2,
                                        coordinator=str(collect[0]), chunk_size=chunk_size)
        if pub.coordinator is not None:
            conn.send(("announce", pub.coordinator.endpoint))
        for version in (1, 2):
            if version > 1:
                with torch.no_grad():  # a training step: every rank changes its own shards
                    for parameter in model.parameters():
                        parameter.add_(1.0)
            pub.publish(model, version=version)
            pub.wait_submitted(version, timeout)
            conn.send(("shard", pub.shard.data_stats()["host_held_bytes"],
                       pub.shard.manifest(version).total_bytes))
            if not conn.poll(timeout) or conn.recv() != ("more" if version == 1 else "done"):
                raise TimeoutError(f"rank {rank}: no go-ahead after version {version}")
        pub.close()
        dist.barrier()  # leave together: gloo aborts a rank whose peer left first
    except BaseException:
        code = 1
        conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()
        conn.close()
    os._exit(code)  # skip torch's teardown (see weightpub/bench/fsdp_streaming.py)
