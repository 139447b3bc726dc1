"""Sliced pulls over the stream vs over ZeroMQ frames, same run: GB/s and subscriber CPU.

No vLLM: the dense, Qwen-shaped tensors of ``slice_fetch.py`` are published; a
subscriber process holding rank 0's TP=2 plan (``--plan cols``: the first half of every
row, short strided pieces; ``rows``: the first half of the rows, one run per tensor;
norms and the embedding whole) follows each of two publishers (both ``stream=True``):
one with ``stream=True`` (its slices come over the plain TCP port, ``recv_into`` into
sparse staging) and one without (``slice_fetch`` chunk frames). Per round the two
publish the same version, interleaved (``peer_slices.interleave``: stream first on odd
rounds). Figures over the plan's bytes (what the subscriber pulls), from round 2 on
(round 1 registers the plan and touches fresh staging): publish -> staged GB/s
(median), the subscriber process's CPU-seconds per GB (the rounds together; all its
threads, ZeroMQ's I/O threads too), this process's (the publishers') CPU per GB (``net``:
less what the process spends idle, measured over 2 s before the rounds with both
subscribers attached, times each round's wall time, as ``fanout.py``), and
stream / frames per round; the load average before and after (a shared box moves the
times, not the bytes).

    python benchmarks/stream_slices.py                  # ~170 MB (plan ~100 MB), 7 rounds
    python benchmarks/stream_slices.py --hidden 512 --layers 16   # short rows: gathered
    python benchmarks/stream_slices.py --plan rows      # half the rows: long runs
    python benchmarks/stream_slices.py --tiny           # smoke run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.peer_slices import interleave  # noqa: E402
from benchmarks.slice_fetch import half_plan, model  # noqa: E402
from publisher import WeightPublisher  # noqa: E402
from weightpub.bench.cpu_probe import idle_cpu_rate, process_cpu  # noqa: E402
from weightpub.bench.forked import forkserver  # noqa: E402
from weightpub_wire.slice_plan import (  # noqa: E402
    SlicePlan,
    decode_plan,
    encode_plan,
    from_ranges,
)

PRELOAD = ("torch", "zmq", "publisher", "subscriber_ext", "benchmarks.stream_slices")


def _receiver(endpoint: str, plan: bytes, stream: bool, rounds: int, conn: Any,
              min_piece: int | None) -> None:
    """The sliced subscriber: per version, (seconds to stage, process CPU, data_path)."""
    from subscriber_ext import WeightSubscriber
    from subscriber_ext.transport.client import stream_source

    if min_piece is not None:  # the bench's knob: where scatter reads give way to a copy
        stream_source._MIN_PIECE = min_piece

    with WeightSubscriber(endpoint, stream=stream, slice_plan=decode_plan(plan),
                          request_timeout=30.0) as sub:
        conn.send("ready")
        for version in range(1, rounds + 1):
            cpu = process_cpu()
            staged = sub.wait_for_version(version, timeout=300)
            conn.send((staged.fetch_seconds, process_cpu() - cpu, staged.data_path))
            staged.release()
        conn.send(sub.status()["stream"])


def rows_plan(weights: dict[str, torch.Tensor]) -> SlicePlan:
    """Rank 0 of a column-parallel split of every matrix: its first half of the rows, one
    contiguous run per tensor (norms and the embedding whole)."""
    ranges = {name: [(0, t.numel() * t.element_size() // (2 if t.dim() == 2 and not
                                                           name.startswith("embed") else 1))]
              for name, t in weights.items()}
    return from_ranges("tp2-rows/rank0", ranges)


class Setup:
    """A publisher and one sliced subscriber process, the stream on or off."""

    def __init__(self, plan: SlicePlan, stream: bool, rounds: int, chunk_size: int,
                 min_piece: int | None = None) -> None:
        self.stream = stream
        self.pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=chunk_size, stream=True)
        self.conn, child = mp.Pipe()
        self.proc = forkserver(PRELOAD).Process(
            target=_receiver, args=(self.pub.endpoint, encode_plan(plan), stream, rounds,
                                    child, min_piece), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise TimeoutError("the subscriber process did not start")
        self.conn.recv()
        self.seconds: list[float] = []
        self.subscriber_cpu: list[float] = []
        self.publisher_cpu: list[float] = []
        self.paths: list[str] = []

    def round(self, weights: dict[str, torch.Tensor], version: int) -> None:
        start, cpu = time.perf_counter(), process_cpu()
        self.pub.publish(weights, version=version)
        if not self.conn.poll(300):
            raise TimeoutError(f"version {version} was not staged")
        _, subscriber_cpu, path = self.conn.recv()
        self.seconds.append(time.perf_counter() - start)
        self.publisher_cpu.append(process_cpu() - cpu)
        self.subscriber_cpu.append(subscriber_cpu)
        self.paths.append(path)

    def close(self) -> dict[str, Any]:
        status = self.conn.recv() if self.conn.poll(60) else {}
        self.proc.join(60)
        self.pub.close()
        return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--hidden", type=int, default=2048,
                        help="rows of 2 x hidden bytes: half rows of 2 KiB and more go as "
                             "views of the snapshot, shorter ones are gathered first")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--plan", choices=("cols", "rows"), default="cols",
                        help="cols: half of every row (short strided pieces); rows: half "
                             "of the rows (one run per tensor)")
    parser.add_argument("--min-piece", type=int, default=None,
                        help="the stream subscriber's _MIN_PIECE (bytes): slices whose "
                             "pieces average less land in scratch and are scattered")
    args = parser.parse_args()
    shape: tuple[int, int, int] = (128, 2, 1000) if args.tiny else (args.hidden, args.layers, 8192)
    rounds = 3 if args.tiny else args.rounds
    first = model(*shape, 1)
    version_bytes = sum(t.numel() * t.element_size() for t in first.values())
    plan = half_plan(first, 0) if args.plan == "cols" else rows_plan(first)
    gb = plan.needed_bytes / 1e9
    chunk = int(args.chunk_mib * (1 << 20))
    load_before = os.getloadavg()
    print(f"version {version_bytes / 1e6:.1f} MB, plan {plan.needed_bytes / 1e6:.1f} MB "
          f"({plan.needed_bytes / version_bytes:.3f}x), chunks of {chunk >> 10} KiB, "
          f"{rounds} rounds; load average {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f} on {os.cpu_count()} CPUs")
    stream = Setup(plan, True, rounds, chunk, args.min_piece)
    frames = Setup(plan, False, rounds, chunk)
    idle = idle_cpu_rate(2.0)  # both publishers idle, both subscribers attached
    print(f"idle: this process spends {idle * 1000:.0f} ms CPU a second")
    try:
        interleave(stream, frames, shape, rounds)
    finally:
        stream_status, _ = stream.close(), frames.close()
    steady = slice(1, None)
    moved = gb * (rounds - 1)  # CPU over every steady round together: it is read in 10 ms
    for name, setup in (("stream", stream), ("frames", frames)):  # ticks, a round is a few
        seconds = statistics.median(setup.seconds[steady])
        publisher = sum(setup.publisher_cpu[steady])
        net = publisher - idle * sum(setup.seconds[steady])
        print(f"  {name:6s}: {gb / seconds:.3f} GB/s of slices (median {seconds:.3f} s), "
              f"subscriber {sum(setup.subscriber_cpu[steady]) / moved:.3f} CPU-s/GB, "
              f"publisher {publisher / moved:.3f} CPU-s/GB (net {net / moved:.3f}); "
              f"data paths {setup.paths}")
    ratios = [f / s for s, f in zip(stream.seconds, frames.seconds, strict=True)][steady]
    # CPU is read in clock ticks (10 ms): a round too short for a tick reads 0
    cpu = [round(f / s, 2) if s else None for s, f in zip(
        stream.subscriber_cpu, frames.subscriber_cpu, strict=True)][steady]
    cpu_ratio = sum(frames.subscriber_cpu[steady]) / max(sum(stream.subscriber_cpu[steady]),
                                                         1e-9)
    print(f"  stream vs frames (speed, frames s / stream s): median "
          f"{statistics.median(ratios):.2f}x, rounds {[round(r, 2) for r in ratios]}")
    print(f"  subscriber CPU per GB, frames / stream: {cpu_ratio:.2f}x (steady rounds), rounds "
          f"{cpu}")
    print(f"  stream fallbacks {stream_status.get('fallback_causes')}; load average after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
