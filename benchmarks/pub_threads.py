"""Where the publisher's CPU goes on the stream path, thread by thread (issue 29).

Runs one ``fanout.Group`` (``--subs`` subscribers, ``stream=True``) and reads each thread
of this process from ``/proc/self/task/*/schedstat`` (run time, ns) around every timed
round: the stream connection threads (the kernel's send copy is their system time), the
caller of ``publish()`` (the snapshot copy), the hashing workers, the serving thread.
Minor page faults per round say whether the snapshot's pages are fresh each version.
Then the same for ``--idle`` seconds with every subscriber attached and nothing to send.
For kernel-level detail, ``perf record -g -p PID`` while it runs (PID is printed).

    python benchmarks/pub_threads.py                 # 256 MiB, 4 subscribers, 5 rounds
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time

import torch

from benchmarks.fanout import Group
from weightpub.bench.cpu_probe import task_stats


def _threads() -> dict[int, tuple[str, float, float, int]]:
    """tid -> (name, run seconds, system seconds (tick-granular), minor faults)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    return {tid: (names.get(tid, task.comm).split(" (")[0], task.run, task.system,
                  task.minor_faults) for tid, task in task_stats().items()}


def _split(before: dict[int, tuple[str, float, float, int]],
           after: dict[int, tuple[str, float, float, int]]) -> dict[str, list[float]]:
    """name -> [run s, system s, minor faults], summed over threads of that name."""
    total: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for tid, (name, run, sys_s, faults) in after.items():
        _, run0, sys0, faults0 = before.get(tid, (name, 0.0, 0.0, 0))
        entry = total[name]
        entry[0] += run - run0
        entry[1] += sys_s - sys0
        entry[2] += faults - faults0
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--subs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=float, default=3.0)
    args = parser.parse_args()
    nbytes = args.mib << 20
    weights = {"w": torch.randint(0, 255, (nbytes,), dtype=torch.uint8)}
    group = Group(args.subs, False, args.rounds + 3, 4, 64, stream=True)
    print(f"pid {os.getpid()}", flush=True)
    for rnd in range(2):  # warm-up: the buffer pool fills, connections open
        weights["w"][rnd * 8: rnd * 8 + 8] += 1
        group.round(weights)
    total: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    process = 0.0
    for rnd in range(2, args.rounds + 2):
        weights["w"][rnd * 8: rnd * 8 + 8] += 1
        before, cpu = _threads(), time.process_time()
        took = group.round(weights)[0]
        process += time.process_time() - cpu
        for name, (run, sys_s, faults) in _split(before, _threads()).items():
            total[name][0] += run
            total[name][1] += sys_s
            total[name][2] += faults
        print(f"  round {rnd - 1}: {took:.3f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    gb = args.rounds * args.subs * nbytes / 1e9
    print(f"process CPU-s/GB delivered {process / gb:.3f}; by thread (CPU-s/GB, of which "
          "system; minor faults a round):")
    for name, (run, sys_s, faults) in sorted(total.items(), key=lambda kv: -kv[1][0]):
        if run > 0:
            print(f"  {name:<34}{run / gb:8.3f}{sys_s / gb:8.3f}{faults / args.rounds:8.0f}")
    before = _threads()
    time.sleep(args.idle)  # every subscriber attached, nothing to send
    idle = _split(before, _threads())
    print(f"idle, {args.subs} subscribers attached (ms CPU a second): " + ", ".join(
        f"{name} {run / args.idle * 1000:.1f}" for name, (run, _, _) in idle.items()
        if run / args.idle > 1e-4))
    weights["w"][:8] += 1
    group.round(weights)  # the subscribers' last version
    group.close()


if __name__ == "__main__":
    main()
