"""A trainer rank of a ``ShardedPublisher`` in its own process (``test_sharded.py``).

Run through ``python -m tests.transport.procs shard_rank '<json args>'``. The rank
publishes ``det_weights(seed, version, spec)`` of its own ``spec`` on command, so
the test can recompute every byte; rank 0 also runs the coordinator and says
where subscribers and the other ranks dial it. ``die_serving: V`` makes the rank
SIGKILL itself when it is about to send its first chunk of version V; ``no_slices``
makes it drop slice requests, as a rank from before issue 30 does; ``nixl`` offers
its shard for one-sided NIXL reads (``test_nixl_sharded.py``); ``stream`` serves it on
a plain-TCP stream port of its own (``test_stream_sharded.py``).
"""

from __future__ import annotations

import os
import resource
import threading
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
    if args.get("die_serving"):
        _die_serving(int(args["die_serving"]))
    start_rss = _peak_rss()
    pub = ShardedPublisher(
        args.get("endpoint", "tcp://127.0.0.1:0"), rank=args["rank"],
        world_size=args["world_size"], coordinator=args.get("coordinator", "tcp://127.0.0.1:0"),
        announce_endpoint=args.get("announce_endpoint"), chunk_size=args["chunk_size"],
        shard_timeout=args.get("shard_timeout", 30.0), heartbeat_interval=0.2,
        nixl=bool(args.get("nixl", False)), stream=bool(args.get("stream", False)))
    if args.get("no_slices"):
        pub.shard._server.slice_serving.handle = lambda *a: None  # type: ignore[method-assign]
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
                  bytes_sent=pub.shard.data_stats()["bytes_sent_full"],
                  slice_bytes_sent=pub.shard.data_stats()["bytes_sent_slices"],
                  nixl=pub.shard.nixl_status(),
                  stream=pub.shard.stream_status(),
                  shard_total=pub.shard.manifest(pub.latest_version).total_bytes
                  if pub.latest_version else 0,
                  announced=None if coordinator is None else coordinator.latest_version,
                  dropped=None if coordinator is None else coordinator.dropped_versions,
                  last_error=None if coordinator is None else coordinator.last_error)
    pub.close()


def _die_serving(version: int) -> None:
    """A real kill -9 of this rank as it is about to send its first chunk of ``version``
    (or a later one): a subscriber is fetching it and none has a byte of this shard."""
    import signal

    from publisher.serving import connection_credit

    send = connection_credit.PeerTable._send_chunk

    def dying(self: Any, peer: Any, header: Any, *rest: Any) -> bool | None:
        if header.version >= version:
            os.kill(os.getpid(), signal.SIGKILL)
        return send(self, peer, header, *rest)

    connection_credit.PeerTable._send_chunk = dying  # type: ignore[method-assign, assignment]


#: DTensors beside the FSDP2 model (name: shape, dtype, placement), built on its mesh:
#: rows uneven over 4 ranks (2, 2, 2, 1), fewer rows than ranks (1, 1, 1, 0), replicated,
#: and a Shard(1), which takes the ``full_tensor()`` path (every rank gathers it)
FSDP_EXTRAS: dict[str, tuple[tuple[int, ...], str, str]] = {
    "extra.uneven": ((7, 5), "float32", "shard0"),
    "extra.short": ((3, 4), "int32", "shard0"),
    "extra.replicated": ((6, 3), "bfloat16", "replicate"),
    "extra.by_column": ((4, 10), "float32", "shard1"),
}


def fsdp_extra_tensors() -> dict[str, Any]:
    """``FSDP_EXTRAS`` as whole tensors, the same in every process."""
    import torch

    from weightpub_wire.dtypes import dtype_from_name

    out: dict[str, Any] = {}
    for index, (name, (shape, dtype, _)) in enumerate(FSDP_EXTRAS.items()):
        values = torch.arange(1, 1 + torch.Size(shape).numel()) * (index + 3)
        out[name] = values.reshape(shape).to(dtype_from_name(dtype))
    return out


def run_fsdp_shard_rank(r: Any, chunk_size: int, timeout: float) -> None:
    """One FSDP2 gloo rank of a ``ShardedPublisher`` (``weightpub.bench.fsdp_ranks``).

    Every rank passes the whole sharded model plus ``FSDP_EXTRAS`` (DTensors on the
    model's mesh). Sends ``("announce", endpoint)`` (rank 0), then per ``("publish",
    version, die_after)`` command: a 'training step' (+1 on every model parameter)
    from version 2 on, the publish, and ``("shard", version, bytes held, shard total,
    counts)``, ``counts`` this publish's ``full_tensor()`` calls and point-to-point
    sends/receives (and bytes received) of the owner gathers. ``die_after`` (a number
    of gathers) makes the rank SIGKILL itself in the middle of that publish; a rank
    whose publish raises sends ``("raised", version, error, seconds, the coordinator's
    latest version or None)`` and re-raises. ``("done",)`` closes.
    """
    import time

    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from weightpub.bench.fsdp_ranks import sharded_publisher

    pub = sharded_publisher(r, chunk_size=chunk_size, shard_timeout=5.0)
    if pub.coordinator is not None:
        r.conn.send(("announce", pub.coordinator.endpoint))
    mesh = next(r.model.parameters()).device_mesh
    placements = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}
    extras = {name: distribute_tensor(tensor, mesh, [placements[FSDP_EXTRAS[name][2]]])
              for name, tensor in fsdp_extra_tensors().items()}
    counts = _count_gathers()
    while True:
        if not r.conn.poll(timeout):
            raise TimeoutError(f"rank {r.rank}: no command within {timeout}s")
        command = r.conn.recv()
        if command[0] == "done":
            break
        _, version, die_after = command
        if version > 1:
            with torch.no_grad():  # a training step: every rank changes its own shards
                for parameter in r.model.parameters():
                    parameter.add_(1.0)
        if die_after is not None:
            _die_after_gathers(die_after)
        start = time.monotonic()
        counts.clear()
        try:
            pub.publish({**r.model.state_dict(), **extras}, version=version)
            pub.wait_submitted(version, timeout)
        except Exception as exc:
            announced = None if pub.coordinator is None else pub.coordinator.latest_version
            r.conn.send(("raised", version, f"{type(exc).__name__}: {exc}",
                         time.monotonic() - start, announced))
            raise
        r.conn.send(("shard", version, pub.shard.data_stats()["host_held_bytes"],
                     pub.shard.manifest(version).total_bytes, dict(counts)))
    pub.close()


def _count_gathers() -> dict[str, int]:
    """Counts of this rank's ``full_tensor()`` gathers and owner-gather sends/receives."""
    import torch.distributed as dist

    from publisher.sources import owner_gather

    counts: dict[str, int] = {}
    full, send, irecv = owner_gather.full, dist.send, dist.irecv

    def counted(key: str, size: int = 0) -> None:
        counts[key] = counts.get(key, 0) + 1
        if size:
            counts[key + "_bytes"] = counts.get(key + "_bytes", 0) + size

    def counting_full(tensor: Any) -> Any:
        counted("full")
        return full(tensor)

    def counting_send(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        counted("sent", tensor.numel() * tensor.element_size())
        return send(tensor, *args, **kwargs)

    def counting_irecv(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        counted("received", tensor.numel() * tensor.element_size())
        return irecv(tensor, *args, **kwargs)

    owner_gather.full = counting_full
    dist.send, dist.irecv = counting_send, counting_irecv
    return counts


def _die_after_gathers(count: int) -> None:
    """A real kill -9 of this rank between two gathers: after ``count`` more of them
    (``owner_gather.take``: one tensor's collective, whichever path it goes)."""
    import signal

    from publisher.sources import owner_gather

    take, gathers = owner_gather.take, [0]

    def dying(tensor: Any, owner: int, meshes: Any) -> Any:
        gathers[0] += 1
        if gathers[0] > count:
            os.kill(os.getpid(), signal.SIGKILL)
        return take(tensor, owner, meshes)

    owner_gather.take = dying
