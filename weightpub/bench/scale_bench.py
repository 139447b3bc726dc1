"""Section ``scale``: host memory and speed at real model sizes, measured from outside.

Why from outside: the figure that kills a trainer or a replica is the kernel's
view of the whole process (every buffer pool, ZeroMQ queue and allocator
cache), not what weightpub thinks it holds. Each run starts two processes, a
*trainer* (``WeightPublisher``, 64 bf16 tensors of ``size`` bytes in all) and a
*subscriber* (``WeightSubscriber``), both this module run as a script and driven
line by line over stdin/stdout::

    parent -> subscriber  "wait N"      subscriber -> parent  {"staged": N, "t": ...}
    parent -> trainer     "publish"     trainer    -> parent  {"published": N, "t0": ...}
    parent -> either      "exit"

Each process says ``ready`` once its source weights (trainer) or its socket
(subscriber) exist: its ``VmRSS`` then is the baseline. Before it exits the
parent reads its ``VmHWM`` (peak resident set); a sampler thread also sums
``VmRSS`` over the process and every descendant (for trees, e.g. an engine).
The figure is ``(peak - baseline) / version bytes``: host memory beyond the
source weights, in versions. publish -> staged is ``t`` (subscriber) minus
``t0`` (trainer, just before ``publish()``), both ``CLOCK_MONOTONIC``, which is
one clock for every process of a Linux host.

Runs interleave sizes (a round goes up, the next down) so drift on a shared host
falls on every size alike. A fresh buffer pays first-touch page faults (about
0.5 s/GB): the trainer makes a new snapshot buffer for each of the first
``keep_versions`` versions and copies every later one over the oldest held
(``publisher/store/version_store.py``), so GB/s is given three ways: ``first`` (version 1),
``cold`` (the other fresh snapshot buffers; none with ``keep_versions=1``) and
``warm`` (reused ones: the steady state of a long run, and the figure compared
across sizes).
A run is skipped, with the reason, when ``MemAvailable`` cannot hold it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["Child", "Sampler", "ScaleRun", "mem_available", "run_scale", "say", "serve_versions",
           "tree_rss"]

TENSORS = 64
_TIMEOUT = 600.0  # any one line from a child


# -- /proc readings ----------------------------------------------------------------------------
def _status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as children:
                    todo.extend(int(c) for c in children.read().split())
            except (OSError, ValueError):
                pass
    return found


def tree_rss(pid: int) -> int:
    """Bytes resident now in ``pid`` and every process below it."""
    return sum(_status_kib(p, "VmRSS") for p in _descendants(pid)) * 1024


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class Sampler:
    """The highest ``tree_rss`` of each watched process, sampled every ``every`` seconds."""

    def __init__(self, pids: Iterable[int], every: float = 0.02) -> None:
        self.peaks = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._run, name="weightpub-bench-rss",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            for pid in self.peaks:
                self.peaks[pid] = max(self.peaks[pid], tree_rss(pid))

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peaks


# -- the two children --------------------------------------------------------------------------
_TAG = "@weightpub-scale "  # what the parent reads; anything else on stdout (vLLM) is not


def say(obj: dict[str, Any]) -> None:
    """One line of JSON to the parent."""
    sys.stdout.write(_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _flat_weights(nbytes: int) -> dict[str, Any]:
    import torch

    numel = max(1, nbytes // TENSORS // 2)
    # filled, so every page is resident before the baseline is read
    return {f"layers.{i}.weight": torch.full((numel,), float(i), dtype=torch.bfloat16)
            for i in range(TENSORS)}


def serve_versions(weights: dict[str, Any], keep_versions: int, host_budget: int | None,
                   ready: dict[str, Any] | None = None) -> None:
    """The trainer child's loop: one ``publish()`` per "publish" line on stdin."""
    from publisher import WeightPublisher
    from weightpub_wire.errors import WeightPubError

    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    extra: dict[str, Any] = {} if host_budget is None else {"host_budget_bytes": host_budget}
    with WeightPublisher("tcp://127.0.0.1:0", keep_versions=keep_versions, **extra) as pub:
        say({"ready": pub.endpoint, "bytes": nbytes, **(ready or {})})
        for line in sys.stdin:
            if line.strip() != "publish":
                break
            for tensor in weights.values():
                tensor.view(-1)[0] += 1  # a new version (the rest of the bytes need not change)
            t0 = time.monotonic()
            try:
                version = pub.publish(weights)
            except WeightPubError as exc:
                say({"refused": str(exc), "type": type(exc).__name__})
                continue
            say({"published": version, "t0": t0, "t_return": time.monotonic()})


def _subscriber(endpoint: str) -> None:
    from subscriber_ext import WeightSubscriber

    with WeightSubscriber(endpoint) as sub:
        say({"ready": endpoint})
        for line in sys.stdin:
            words = line.split()
            if len(words) != 2 or words[0] != "wait":
                break
            staged = sub.wait_for_version(int(words[1]), timeout=_TIMEOUT)
            t = time.monotonic()
            version = staged.version
            staged.release()
            say({"staged": version, "t": t})


# -- the parent --------------------------------------------------------------------------------
class Child:
    """One child process spoken to in lines of JSON; its /proc readings."""

    def __init__(self, *args: str, module: str = "weightpub.bench.scale_bench") -> None:
        self.args = args
        env = {**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.baseline = 0

    def send(self, line: str) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def read(self) -> dict[str, Any]:
        stdout = self.proc.stdout
        assert stdout is not None
        result: dict[str, Any] = {}
        done = threading.Event()

        def read_line() -> None:
            try:
                for line in stdout:
                    if line.startswith(_TAG):
                        result.update(json.loads(line[len(_TAG):]))
                        return
            finally:
                done.set()

        threading.Thread(target=read_line, name="weightpub-bench-read", daemon=True).start()
        if not done.wait(_TIMEOUT) or not result:
            raise RuntimeError(f"scale bench child {self.args} said nothing "
                               f"(exit code {self.proc.poll()})")
        return result

    def ready(self) -> dict[str, Any]:
        said = self.read()
        self.baseline = tree_rss(self.proc.pid)
        return said

    def finish(self) -> int:
        """The peak resident set (``VmHWM``) read just before the child exits."""
        peak = _status_kib(self.proc.pid, "VmHWM") * 1024
        self.close()
        return peak

    def close(self) -> None:
        try:
            self.send("exit")
        except (BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@dataclass(frozen=True, slots=True)
class ScaleRun:
    """One configuration: version bytes, versions per run, the trainer's ``keep_versions``."""

    nbytes: int
    versions: int = 5
    keep_versions: int = 1
    host_budget: int | None = None
    #: publish each version as soon as ``publish()`` returns (as a trainer that does not
    #: wait): evicted versions may still be in flight, which the paced runs never see
    back_to_back: bool = False

    @property
    def name(self) -> str:
        size = f"{self.nbytes >> 20} MiB" if self.nbytes < 1 << 30 else \
            f"{self.nbytes / (1 << 30):g} GiB"
        pace = ", back to back" if self.back_to_back else ""
        return f"{size}, keep_versions={self.keep_versions}{pace}"

    def needs(self) -> int:
        """Host memory a run may take: the source, the trainer's ``keep_versions`` snapshots
        and scratch, a subscriber's two staging buffers (back to back), and 1 GiB."""
        return self.nbytes * (1 + self.keep_versions + 2) + self.nbytes // 4 + (1 << 30)


def run_one(run: ScaleRun) -> dict[str, Any]:
    """One trainer and one subscriber process; ``versions`` published one after another."""
    trainer = Child("trainer", str(run.nbytes), str(run.keep_versions),
                     str(run.host_budget or 0))
    subscriber: Child | None = None
    try:
        said = trainer.ready()
        nbytes = int(said["bytes"])
        subscriber = Child("subscriber", str(said["ready"]))
        subscriber.ready()
        sampler = Sampler([trainer.proc.pid, subscriber.proc.pid])
        seconds, returns, refused = [], [], []
        version, total, first_t0 = 0, None, None
        for _ in range(run.versions):
            if not run.back_to_back:
                subscriber.send(f"wait {version + 1}")
            trainer.send("publish")
            published = trainer.read()
            if "refused" in published:
                refused.append(published["refused"])
                break
            version = int(published["published"])
            first_t0 = first_t0 or float(published["t0"])
            returns.append(float(published["t_return"]) - float(published["t0"]))
            if not run.back_to_back:
                staged = subscriber.read()
                seconds.append(float(staged["t"]) - float(published["t0"]))
        if run.back_to_back and version:
            subscriber.send(f"wait {version}")
            total = float(subscriber.read()["t"]) - (first_t0 or 0.0)
        peaks = sampler.stop()
        sampled = {"trainer": peaks[trainer.proc.pid], "subscriber": peaks[subscriber.proc.pid]}
        bases = {"trainer": trainer.baseline, "subscriber": subscriber.baseline}
        hwm = {"subscriber": subscriber.finish(), "trainer": trainer.finish()}
    finally:
        for child in (subscriber, trainer):
            if child is not None and child.proc.poll() is None:
                child.close()
    cold, warm = seconds[1:run.keep_versions], seconds[run.keep_versions:]
    out: dict[str, Any] = {
        "run": run.name, "bytes": nbytes, "versions": len(returns),
        "keep_versions": run.keep_versions, "refused": refused,
        "publish_to_staged_s": seconds, "publish_return_s": returns,
        "back_to_back": run.back_to_back, "all_versions_s": total,
        "first_GBps": nbytes / seconds[0] / 1e9 if seconds else None,
        "cold_GBps": nbytes / statistics.median(cold) / 1e9 if cold else None,
        "warm_GBps": nbytes / statistics.median(warm) / 1e9 if warm else None,
        "baseline_bytes": bases, "peak_bytes": hwm, "sampled_peak_bytes": sampled,
    }
    out["beyond_source"] = {side: (max(hwm[side], sampled[side]) - bases[side]) / nbytes
                            for side in hwm}
    return out


def run_scale(sizes_mib: list[int], *, versions: int, rounds: int,
              keep_versions: tuple[int, ...] = (1, 2), back_to_back: bool = True,
              tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Every size x ``keep_versions`` (and back to back at the first), ``rounds`` times,
    interleaved; per configuration the median GB/s and the worst peak."""
    plans = [ScaleRun(mib << 20, versions, keep) for keep in keep_versions for mib in sizes_mib]
    if back_to_back:
        plans += [ScaleRun(mib << 20, versions, keep_versions[0], back_to_back=True)
                  for mib in sizes_mib]
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for index in range(rounds):
        for plan in (plans if index % 2 == 0 else list(reversed(plans))):
            available = mem_available()
            if available and plan.needs() > available:
                skipped.append({"run": plan.name, "needs_bytes": plan.needs(),
                                "available_bytes": available})
            else:
                runs.append(run_one(plan))
            if tick is not None:
                tick()
    per_run: dict[str, list[dict[str, Any]]] = {}
    for result in runs:
        per_run.setdefault(result["run"], []).append(result)
    summary = []
    for name, results in per_run.items():
        def median(key: str, of: list[dict[str, Any]] = results) -> float | None:
            values = [r[key] for r in of if r[key]]
            return statistics.median(values) if values else None

        summary.append({
            "run": name, "bytes": results[0]["bytes"],
            "keep_versions": results[0]["keep_versions"], "rounds": len(results),
            "first_GBps": median("first_GBps"), "cold_GBps": median("cold_GBps"),
            "warm_GBps": median("warm_GBps"),
            "trainer_beyond_source": max(r["beyond_source"]["trainer"] for r in results),
            "subscriber_beyond_source": max(r["beyond_source"]["subscriber"] for r in results),
        })
    default = sorted((s for s in summary if s["keep_versions"] == keep_versions[0]
                      and s["warm_GBps"]), key=lambda s: s["bytes"])
    ratio = None
    if len(default) >= 2:
        ratio = {"largest": default[-1]["run"], "smallest": default[0]["run"],
                 "ratio": default[-1]["warm_GBps"] / default[0]["warm_GBps"]}
    return {"sizes_mib": sizes_mib, "versions": versions, "rounds": rounds,
            "tensors": TENSORS, "summary": summary, "gbps_largest_over_smallest": ratio,
            "runs": runs, "skipped": skipped,
            "targets": {"trainer_beyond_source": 1.25, "subscriber_beyond_source": 1.2,
                        "gbps_largest_over_smallest": 0.8}}


def _main(argv: list[str]) -> None:
    if argv[0] == "trainer":
        serve_versions(_flat_weights(int(argv[1])), int(argv[2]), int(argv[3]) or None)
    elif argv[0] == "subscriber":
        _subscriber(argv[1])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} trainer BYTES KEEP BUDGET | subscriber ENDPOINT")


if __name__ == "__main__":
    _main(sys.argv[1:])
