"""Transport vs a raw TCP socket moving the same bytes across processes, in one run.

A thin wrapper around ``weightpub bench --sections transport`` (the logic lives in
``weightpub/bench/transport_bench.py``): raw, tcp:// and ipc:// interleaved; steady-state
and first-version (cold) ratios. Target: >= 0.8x steady, >= 0.6x cold.

    python benchmarks/throughput.py --mib 256,1024 --rounds 8
"""

from __future__ import annotations

import argparse

from weightpub.bench import BenchOptions, run_and_print


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="256,1024", help="version sizes, MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--schemes", default="tcp,ipc")
    args = parser.parse_args()
    options = BenchOptions(sections=("transport",),
                           transport_mib=[int(m) for m in args.mib.split(",")],
                           transport_rounds=args.rounds, schemes=args.schemes.split(","))
    return run_and_print(options)


if __name__ == "__main__":
    raise SystemExit(main())
