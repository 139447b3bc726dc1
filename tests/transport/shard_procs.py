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
                  bytes_sent=pub.shard.data_stats()["bytes_sent_full"],
                  shard_total=pub.shard.manifest(pub.latest_version).total_bytes
                  if pub.latest_version else 0,
                  announced=None if coordinator is None else coordinator.latest_version,
                  dropped=None if coordinator is None else coordinator.dropped_versions,
                  last_error=None if coordinator is None else coordinator.last_error)
    pub.close()


def run_fsdp_shard_rank(r: Any, chunk_size: int, timeout: float) -> None:
    """One FSDP2 gloo rank of a ``ShardedPublisher`` (``weightpub.bench.fsdp_ranks``).

    Every rank passes the whole sharded model. Sends ``("announce", endpoint)`` (rank
    0), then per ``("publish", version, die_after)`` command: a 'training step' (+1 on
    every parameter) from version 2 on, the publish, and ``("shard", version, bytes
    held, shard total)``. ``die_after`` (a number of gathers) makes the rank SIGKILL
    itself in the middle of that publish; a rank whose publish raises sends
    ``("raised", version, error, seconds, the coordinator's latest version or None)``
    and re-raises. ``("done",)`` closes.
    """
    import time

    import torch

    from weightpub.bench.fsdp_ranks import sharded_publisher

    pub = sharded_publisher(r, chunk_size=chunk_size, shard_timeout=5.0)
    if pub.coordinator is not None:
        r.conn.send(("announce", pub.coordinator.endpoint))
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
        try:
            pub.publish(r.model, version=version)
            pub.wait_submitted(version, timeout)
        except Exception as exc:
            announced = None if pub.coordinator is None else pub.coordinator.latest_version
            r.conn.send(("raised", version, f"{type(exc).__name__}: {exc}",
                         time.monotonic() - start, announced))
            raise
        r.conn.send(("shard", version, pub.shard.data_stats()["host_held_bytes"],
                     pub.shard.manifest(version).total_bytes))
    pub.close()


def _die_after_gathers(count: int) -> None:
    """A real kill -9 of this rank between two gathers: after ``count`` more of them."""
    import signal

    from publisher import streamed_sources

    full, gathers = streamed_sources._full, [0]

    def dying(tensor: Any) -> Any:
        gathers[0] += 1
        if gathers[0] > count:
            os.kill(os.getpid(), signal.SIGKILL)
        return full(tensor)

    streamed_sources._full = dying
