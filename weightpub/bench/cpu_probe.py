"""Where a process's CPU goes: its seconds, its threads' seconds, its Python hot spots.

Why: on a 2-core box the data path is CPU-bound, so throughput ratios alone hide
whether a change saved work or only moved it; the transport bench reports CPU-seconds
per GB on each side and this breakdown (``transport_bench.py``).

* ``process_cpu``: user + system seconds of a whole process (every thread, ZeroMQ's
  I/O threads included), from ``/proc/<pid>/stat``;
* ``process_faults``: the page faults of a whole process (minor + major), the cost of
  first touch and of memory the allocator gave back and takes anew (``transport_bench``
  reports them per GB: a fault is about 1-2 us here, so 250 k per GB is 0.25-0.5 s);
* ``thread_cpu``: the same per thread name (``/proc/<pid>/task/*``): ZeroMQ's I/O
  threads are ``ZMQbg/IO/n``, Python's threads carry the interpreter's name;
* ``idle_cpu_rate``: this process's CPU a second while the caller sleeps (what idle
  publishers cost it: a bench subtracts it times a round's wall time, a ``net`` figure);
* ``task_stats``: per thread id, its run time (``schedstat``, ns), system seconds and
  minor faults (``benchmarks/pub_threads.py``);
* ``StackSampler``: every ``interval`` seconds, the innermost Python frame of each
  other thread (perf-style sampling: a C call such as a memcpy or a hash is charged
  to the Python line that made it); py-spy is not installed on the box.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["StackSampler", "TaskStat", "idle_cpu_rate", "process_cpu", "process_faults",
           "task_stats", "thread_cpu"]

_TICK = os.sysconf("SC_CLK_TCK")


def _fields(stat: str) -> list[str]:
    """A ``/proc/.../stat`` line's fields after ``pid (comm) `` (comm may hold spaces)."""
    return stat[stat.rindex(")") + 2:].split()


def _stat_seconds(stat: str) -> float:
    fields = _fields(stat)
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def process_cpu(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (default: this one), all threads."""
    return _stat_seconds(Path(f"/proc/{pid or os.getpid()}/stat").read_text())


def idle_cpu_rate(seconds: float = 2.0) -> float:
    """CPU-seconds a second this process spends while the caller sleeps ``seconds``: its
    other threads' cost of doing nothing (an idle publisher's serving loop, heartbeats),
    which a round's CPU includes too; ``cpu - rate * wall`` is the round's own."""
    start = time.process_time()
    time.sleep(seconds)
    return (time.process_time() - start) / seconds


def process_faults(pid: int | None = None) -> int:
    """Page faults (minor + major) of process ``pid`` (default: this one) so far."""
    fields = _fields(Path(f"/proc/{pid or os.getpid()}/stat").read_text())
    return int(fields[7]) + int(fields[9])  # minflt, majflt


def thread_cpu(pid: int | None = None) -> dict[str, float]:
    """CPU seconds per thread name of process ``pid`` (threads of one name summed)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid or os.getpid()}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + _stat_seconds((task / "stat").read_text())
        except OSError:  # the thread ended meanwhile
            continue
    return out


@dataclass(frozen=True, slots=True)
class TaskStat:
    """One thread's counters so far: ``run`` seconds on a CPU (``schedstat``, ns-precise),
    ``system`` seconds (tick-granular), minor page faults."""

    comm: str
    run: float
    system: float
    minor_faults: int


def task_stats(pid: int | None = None) -> dict[int, TaskStat]:
    """Thread id -> ``TaskStat`` for each thread of process ``pid`` (default: this one)."""
    out: dict[int, TaskStat] = {}
    for task in Path(f"/proc/{pid or os.getpid()}/task").iterdir():
        try:
            run = int((task / "schedstat").read_text().split()[0]) / 1e9
            fields = _fields((task / "stat").read_text())
            comm = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = TaskStat(comm, run, int(fields[12]) / _TICK, int(fields[7]))
    return out


class StackSampler:
    """Counts the innermost Python frame of every other thread, ``interval`` apart."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.samples: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightpub-bench-sampler",
                                        daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                code = frame.f_code
                where = f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"
                self.samples[where] += 1

    def top(self, count: int = 8, *, skip_idle: bool = True) -> list[tuple[str, float]]:
        """The ``count`` most sampled frames and their share of the samples (idle waits
        such as ``poll`` and ``wait`` left out when ``skip_idle``)."""
        idle = ("poll", "wait", "select", "_wait_for_tstate_lock", "_recv_bytes",
                "_run", "sleep")
        items = [(k, v) for k, v in self.samples.items()
                 if not skip_idle or k.rsplit(" ", 1)[-1] not in idle]
        total = sum(v for _, v in items) or 1
        return [(k, round(v / total, 3)) for k, v in sorted(items, key=lambda kv: -kv[1])[:count]]
