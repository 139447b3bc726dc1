"""Diagnostic for the e2e transfer stall (docs/benchmarks.md, "House third pass"):
manifest -> staged per version, with the subscriber in a child process that is slow
to read (a thread holding the GIL; ``STALL_CPU=1``: torch threads spinning on every
core, like vLLM-cpu), an on-progress listener, and each staged version released and
marked applied a while later (like a commit between generation steps).

    python -m benchmarks.chunk_stall --model 311MB --versions 5 --timeout 5 --gap 3
    STALL_DEBUG=1 ...   # weightpub.* at DEBUG on both sides: each fetch, deferred
                        # chunk, owed payload and dropped peer of the publisher

Findings so far (2026-12-02, load 5-8): no stall of a request_timeout reproduced
without vLLM; manifest -> staged 0.4-3.5 s, gaps in the publisher's log are the
subscriber not asking (its process busy), never a request left unanswered. The stall's
signature (one request_timeout per version; at 1.5 s two ProtocolErrors) is what a DEALER
connection that ends mid-transfer gave before commit a664862
(tests/transport/test_reconnect_reask.py): status()["reconnects"] says whether e2e has it.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import torch

HOG = 0.2  # seconds of pure Python per GIL hold


def _gil_hog(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < HOG:
            x += 1
        time.sleep(0.005)


def _cpu_hog(stop: threading.Event) -> None:
    a = torch.randn(1024, 1024)
    while not stop.is_set():
        a = (a @ a).clamp_(-1, 1)


def _log_setup(side: str) -> None:
    level = logging.DEBUG if os.environ.get("STALL_DEBUG") else logging.WARNING
    logging.basicConfig(level=level, format=f"%(relativeCreated)d {side} %(name)s %(message)s")


def _child(endpoint: str, timeout: float, q: Any, hold: float) -> None:
    _log_setup("SUB")
    from subscriber_ext import StagedVersion, WeightSubscriber

    stop = threading.Event()
    threading.Thread(target=_gil_hog, args=(stop,), daemon=True).start()
    if os.environ.get("STALL_CPU"):
        threading.Thread(target=_cpu_hog, args=(stop,), daemon=True).start()

    def later(staged: StagedVersion) -> None:
        time.sleep(hold)
        staged.release()
        sub.mark_applied(staged.version)

    def on_version(staged: StagedVersion) -> None:
        q.put(("staged", staged.version, time.time(), staged.fetch_seconds))
        threading.Thread(target=later, args=(staged,), daemon=True).start()

    sub = WeightSubscriber(endpoint, on_version=on_version, on_progress=lambda p: None,
                           request_timeout=timeout)
    q.put(("ready", 0, time.time(), 0.0))
    while True:
        time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=160)
    ap.add_argument("--model", default="", help="a bench model name (311MB) instead of --mb")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--hold", type=float, default=1.0)
    ap.add_argument("--gap", type=float, default=1.0)
    args = ap.parse_args()
    _log_setup("PUB")
    from publisher import WeightPublisher

    if args.model:
        from weightpub.bench.engines import build_model
        weights = dict(build_model(args.model, torch.bfloat16).state_dict())
    else:
        n = args.mb * (1 << 20) // 2 // 4096
        weights = {f"w{i}": torch.randn(n // 4, 4096).to(torch.bfloat16) for i in range(4)}
    if os.environ.get("STALL_PARENT_GIL"):
        threading.Thread(target=_gil_hog, args=(threading.Event(),), daemon=True).start()
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    out = []
    with WeightPublisher("tcp://127.0.0.1:0", model_id="stall") as pub:
        proc = ctx.Process(target=_child, args=(pub.endpoint, args.timeout, q, args.hold))
        proc.start()
        assert q.get(timeout=120)[0] == "ready"
        try:
            for _ in range(args.versions):
                with torch.no_grad():
                    for w in weights.values():
                        w.add_(0.01)
                t0 = time.time()
                version = pub.publish(weights)
                _, got, t1, fetch = q.get(timeout=120)
                assert got == version, (got, version)
                out.append({"version": version, "publish_to_staged": round(t1 - t0, 3),
                            "fetch_s": round(fetch, 3)})
                print(json.dumps(out[-1]), flush=True)
                time.sleep(args.hold + args.gap)
        finally:
            proc.kill()
    print(json.dumps({"timeout": args.timeout, "runs": out}))


if __name__ == "__main__":
    main()
