"""New weights in trainer memory -> vLLM engine generating with them, weightpub vs baselines.

A thin wrapper around ``weightpub bench --sections e2e`` (the logic lives in
``weightpub/bench/e2e_bench.py``): weightpub vs save + ``reload_weights`` from disk vs one
seed RPC per tensor, interleaved, every generation checked against transformers,
plus the engine's step loop blocked by a commit vs vLLM's own ``reload_weights``.
Targets: <= 0.33x disk, <= 0.2x per-parameter RPC, commit pause <= 0.1x reload.

    python benchmarks/e2e_update.py                 # Qwen2-shaped, 311 MB bf16, 5 reps
    python benchmarks/e2e_update.py --model 80MB --reps 3
    python benchmarks/e2e_update.py --tiny          # smoke run
"""

from __future__ import annotations

import argparse

from weightpub.bench import BenchOptions, run_and_print
from weightpub.bench.engines import MODELS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model, quick smoke run")
    ap.add_argument("--model", default="311MB", choices=sorted(MODELS))
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per path")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    args = ap.parse_args()
    if args.tiny:
        options = BenchOptions.quick_run(("e2e",))
        options.e2e_reps = args.reps
    else:
        options = BenchOptions(sections=("e2e",), e2e_model=args.model, e2e_reps=args.reps,
                               e2e_warmup=args.warmup)
    return run_and_print(options)


if __name__ == "__main__":
    raise SystemExit(main())
