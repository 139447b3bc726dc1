"""New weights in trainer memory -> a vLLM engine generating with them, vs two baselines.

One engine, one trainer-side model (random Qwen2 shape). Each repetition first
perturbs the trainer's weights (nothing cached anywhere), then times one path
from "new weights in trainer memory" to "a short greedy generation with them has
returned":

* ``weightpub``: ``publish()`` -> every rank reports it applied -> generate;
* ``disk``: ``save_pretrained`` -> vLLM's ``reload_weights(weights_path=...)`` -> generate;
* ``per_param_rpc``: one seed ``http_load_weight`` RPC per tensor -> generate.

Paths are interleaved, order rotating. Every generation is checked (untimed)
against an fp32 transformers copy of the same weights: an exact greedy match, or
every token within ``GAP_TOL`` of the argmax teacher-forced (bf16 kernels flip
near-ties). Also measured: the engine's step loop blocked by a weightpub commit
(``commit_pause_seconds``, the figure ``weightpub_commit_pause_seconds`` records)
vs vLLM's own ``reload_weights`` of the same tensors (the disk path's reload RPC).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weightpub.bench.engines import weights_of

__all__ = ["GAP_TOL", "PATHS", "run_e2e"]

PROMPT = [11, 42, 7, 300, 5]
GEN_TOKENS = 8
#: allowed teacher-forced gap (logit std units): fp32 exact; bf16 kernels up to ~0.6;
#: tokens of the weights before an update score >= ~2.8 (perturbation 0.05)
GAP_TOL = {torch.float32: 0.05, torch.bfloat16: 1.0}
PATHS = ("weightpub", "disk", "per_param_rpc")


@torch.no_grad()
def perturb(model: torch.nn.Module, gen: torch.Generator, scale: float = 0.05) -> None:
    """What a training step does as far as we care: every tensor changes."""
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        p.add_(noise.to(p.dtype), alpha=scale)


@torch.no_grad()
def greedy_gap(oracle: torch.nn.Module, tokens: list[int]) -> float:
    """Worst teacher-forced gap of ``tokens`` after PROMPT in units of the logits' std."""
    logits = oracle(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1].float()
    gap = logits.max(-1).values - logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return float((gap / logits.std(-1)).max())


def vllm_greedy(llm: Any) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _run_path(name: str, llm: Any, model: torch.nn.Module, pub: Any,
              ckpt_dir: str) -> tuple[float, dict[str, Any], list[int]]:
    from subscriber_ext import wait_until_applied
    from subscriber_ext.vllm_ext.seed.tensor_bytes import encode_tensor

    phases: dict[str, Any] = {}
    t0 = time.perf_counter()
    if name == "weightpub":
        version = pub.publish(model)
        phases["publish"] = time.perf_counter() - t0
        ranks = wait_until_applied(llm, version, timeout=300, poll_s=0.005)
        phases["applied"] = time.perf_counter() - t0
        last = max((r["commits"][-1] for r in ranks
                    if r["commits"] and r["commits"][-1]["version"] == version),
                   key=lambda c: c["seconds"])
        phases["commit_pause"] = last["seconds"]
        phases["prepared"] = bool(last["prepared"])
        phases["early_layers"] = last.get("early_layers", 0)
        phases["staged_to_commit"] = last.get("staged_to_commit_s")
    elif name == "disk":
        model.save_pretrained(ckpt_dir, safe_serialization=True)  # type: ignore[operator]
        phases["save"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        llm.collective_rpc("reload_weights",
                           kwargs={"weights_path": ckpt_dir, "is_checkpoint_format": True})
        phases["reload_rpc"] = time.perf_counter() - t1
    elif name == "per_param_rpc":
        for pname, tensor in weights_of(model).items():  # encode each just before its RPC
            llm.collective_rpc("http_load_weight", kwargs=encode_tensor(pname, tensor))
        phases["rpcs"] = time.perf_counter() - t0
    else:
        raise ValueError(name)
    t_gen = time.perf_counter()
    tokens = vllm_greedy(llm)
    end = time.perf_counter()
    phases["generate"] = end - t_gen
    return end - t0, phases, tokens


def run_e2e(llm: Any, model: torch.nn.Module, oracle: torch.nn.Module, *, reps: int,
            warmup: int, tick: Callable[[], None],
            subscriber_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time every path ``reps`` times (after ``warmup`` untimed rounds) on ``llm``."""
    from publisher import WeightPublisher
    from weightpub.demos.tiny_vllm import hf_greedy

    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(1234)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    phases: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    exact_runs, gaps, stale_gaps, mismatches = 0, [], [], []
    prev = vllm_greedy(llm)
    with tempfile.TemporaryDirectory(prefix="weightpub-e2e-") as tmp, \
            WeightPublisher("tcp://127.0.0.1:0", model_id="bench-e2e") as pub:
        ckpt = str(Path(tmp, "ckpt"))
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,),
                           kwargs=subscriber_options or {})
        try:
            for rnd in range(warmup + reps):
                order = PATHS[rnd % len(PATHS):] + PATHS[:rnd % len(PATHS)]
                for path in order:
                    perturb(model, gen)  # fresh weights for every path and repetition
                    seconds, ph, got = _run_path(path, llm, model, pub, ckpt)
                    oracle.load_state_dict(model.state_dict())
                    exact = got == hf_greedy(oracle, PROMPT, GEN_TOKENS)
                    gap, stale = greedy_gap(oracle, got), greedy_gap(oracle, prev)
                    exact_runs += exact
                    gaps.append(gap)
                    stale_gaps.append(stale)
                    if not (exact or gap <= GAP_TOL[dtype]):
                        mismatches.append(f"round {rnd} {path}: vllm {got}, gap {gap:.3f}")
                    prev = got
                    if rnd >= warmup:
                        times[path].append(seconds)
                        phases[path].append(ph)
                        tick()
        finally:
            llm.collective_rpc("stop_weight_subscriber")
    med = {p: statistics.median(v) for p, v in times.items()}
    pauses = [ph["commit_pause"] for ph in phases["weightpub"]]
    reload_s = statistics.median(ph["reload_rpc"] for ph in phases["disk"])
    staged = [ph["staged_to_commit"] for ph in phases["weightpub"]
              if ph["staged_to_commit"] is not None]
    return {
        "reps": reps, "median_s": med, "runs_s": times, "phases": phases,
        "ratios": {"weightpub/disk": med["weightpub"] / med["disk"],
                   "weightpub/per_param_rpc": med["weightpub"] / med["per_param_rpc"],
                   "commit_pause/reload_weights": statistics.median(pauses) / reload_s},
        "targets": {"weightpub/disk": 0.33, "weightpub/per_param_rpc": 0.2,
                    "commit_pause/reload_weights": 0.1},
        "commit_pause_seconds": {"median": statistics.median(pauses), "max": max(pauses)},
        "reload_weights_seconds": reload_s,
        "prepared_commits": sum(bool(ph["prepared"]) for ph in phases["weightpub"]),
        "early_layers": statistics.median(ph["early_layers"] for ph in phases["weightpub"]),
        "staged_to_commit_seconds": statistics.median(staged) if staged else None,
        "oracle": {"runs": len(gaps), "exact": exact_runs, "max_gap": max(gaps),
                   "tolerance": GAP_TOL[dtype], "stale_min_gap": min(stale_gaps),
                   "mismatches": mismatches, "ok": not mismatches},
    }
