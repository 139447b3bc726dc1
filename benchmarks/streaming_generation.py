"""Generation throughput while versions stream in vs no updates, in one run.

A thin wrapper around ``weightpub bench --sections streaming`` (the logic lives in
``weightpub/bench/streaming_bench.py``): quiet and streaming rounds alternate, for each
cadence. Target: >= 0.9x the tokens/s of no updates at one version per second.

    python benchmarks/streaming_generation.py                 # 80 MB bf16, every 1 s and 0.3 s
    python benchmarks/streaming_generation.py --every 0.3 --rounds 4
    python benchmarks/streaming_generation.py --tiny          # smoke run
"""

from __future__ import annotations

import argparse

from weightpub.bench import BenchOptions, run_and_print


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model, quick smoke run")
    ap.add_argument("--every", default="1.0,0.3", help="seconds between versions, per cadence")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind per cadence")
    ap.add_argument("--round-seconds", type=float, default=3.0)
    args = ap.parse_args()
    options = BenchOptions.quick_run(("streaming",)) if args.tiny else \
        BenchOptions(sections=("streaming",))
    options.cadences = [float(e) for e in args.every.split(",")]
    options.stream_rounds = args.rounds
    if not args.tiny:
        options.stream_round_s = args.round_seconds
    return run_and_print(options)


if __name__ == "__main__":
    raise SystemExit(main())
