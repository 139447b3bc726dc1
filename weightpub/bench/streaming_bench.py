"""Generation throughput while versions stream in vs no updates, in one run.

One engine subscribed to a publisher in this process. Rounds alternate: the
same batch (``requests`` x ``tokens`` greedy tokens, repeated so a round lasts
about ``round_s``) with no updates, then while a thread publishes a changed
version every ``every`` seconds. Reported per cadence: tokens/s of both (median),
their ratio, the commits during the batches (how many were prepared off the
step path, how many layers while the version was still arriving), the longest
step-loop pause (``weightpub_commit_pause_seconds``) and the time from "staged
here" to "live" (``staged_to_commit_s``). Everything, the trainer-side
``publish()`` included, shares this machine's cores: a lower bound for a
replica whose trainer is elsewhere.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Streamer", "generate", "run_streaming"]


def generate(llm: Any, requests: int, tokens: int, repeat: int = 1) -> int:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [11 + i, 42, 7, 300, 5]} for i in range(requests)]
    n = 0
    for _ in range(repeat):
        out = llm.generate(prompts, params, use_tqdm=False)
        n += sum(len(o.outputs[0].token_ids) for o in out)
    return n


class Streamer:
    """Publishes a slightly changed version every ``every`` seconds until stopped."""

    def __init__(self, pub: Any, weights: dict[str, torch.Tensor], every: float) -> None:
        self.pub, self.weights, self.every = pub, weights, every
        self.published: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightpub-bench-publish",
                                        daemon=True)

    @torch.no_grad()
    def _run(self) -> None:
        sign = 1.0
        while not self._stop.is_set():
            t0 = time.monotonic()
            sign = -sign
            for t in self.weights.values():
                t.view(-1)[:256].add_(0.01 * sign)
            self.published.append(self.pub.publish(self.weights))
            self._stop.wait(max(0.0, self.every - (time.monotonic() - t0)))

    def __enter__(self) -> Streamer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def _engine_commits(llm: Any) -> list[dict[str, Any]]:
    """The engine core's side of the newest commits: its RPC round trip (``rpc_s``) and the
    prefix-cache invalidation (``prefix_s``), together the whole step-loop pause."""
    try:
        status = llm.llm_engine.engine_core.call_utility("weightpub_driver_status")
    except Exception:  # no engine driver (plugin off): the worker's figure is all there is
        return []
    return list(status.get("commits", [])) if status.get("active") else []


def _status(llm: Any) -> dict[str, Any]:
    """Rank 0's state, without committing anything (``commits``: the newest 16)."""
    return llm.collective_rpc("weight_status")[0]


def run_streaming(llm: Any, weights: dict[str, torch.Tensor], *, cadences: list[float],
                  rounds: int, requests: int, tokens: int, round_s: float,
                  tick: Callable[[], None],
                  subscriber_options: dict[str, Any] | None = None) -> dict[str, Any]:
    from publisher import WeightPublisher
    from subscriber_ext import wait_until_applied

    out: list[dict[str, Any]] = []
    with WeightPublisher("tcp://127.0.0.1:0", model_id="bench-stream") as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,),
                           kwargs=subscriber_options or {})
        first_streaming: dict[str, Any] | None = None
        try:
            wait_until_applied(llm, pub.publish(weights), timeout=300)
            t0 = time.perf_counter()
            generate(llm, requests, tokens)  # warm-up, untimed
            repeat = max(1, math.ceil(round_s / (time.perf_counter() - t0)))
            for every in cadences:
                tps: dict[str, list[float]] = {"quiet": [], "streaming": []}
                commits: list[dict[str, Any]] = []  # the newest 16 of each round: details
                published = committed = 0
                engine: list[dict[str, Any]] = []
                for rnd in range(2 * rounds):
                    kind = ("quiet", "streaming")[rnd % 2]
                    before = _status(llm)
                    t0 = time.perf_counter()
                    if kind == "quiet":
                        n = generate(llm, requests, tokens, repeat)
                        took = time.perf_counter() - t0
                    else:
                        with Streamer(pub, weights, every) as streamer:
                            n = generate(llm, requests, tokens, repeat)
                            took = time.perf_counter() - t0
                        after = _status(llm)  # what was committed while the batch ran
                        count = after["commit_count"] - before["commit_count"]
                        new = [c for c in after["commits"]
                               if c["version"] > (before["applied_version"] or 0)]
                        if first_streaming is None and new:
                            first_streaming = new[0]  # the first commit on a busy engine
                        commits += new[-count:] if count else []
                        committed += count
                        engine += [c for c in _engine_commits(llm)
                                   if c["version"] > (before["applied_version"] or 0)]
                        published += len(streamer.published)
                        wait_until_applied(llm, streamer.published[-1], timeout=300)
                    tps[kind].append(n / took)
                    tick()
                med = {k: statistics.median(v) for k, v in tps.items()}
                pauses = [c["seconds"] for c in commits] or [0.0]
                stalls = [c["rpc_s"] + c["prefix_s"] for c in engine]
                lags = [c["staged_to_commit_s"] for c in commits
                        if c.get("staged_to_commit_s") is not None] or [0.0]
                out.append({
                    "every_s": every, "tokens_per_s": tps, "median_tokens_per_s": med,
                    "ratio": med["streaming"] / med["quiet"], "published": published,
                    "commits": committed,
                    "prepared_commits": sum(bool(c["prepared"]) for c in commits),
                    "early_layers_median": statistics.median(
                        [c.get("early_layers", 0) for c in commits] or [0]),
                    "commit_pause_seconds": {"median": statistics.median(pauses),
                                             "max": max(pauses)},
                    # the engine core's whole pause: commit RPC + prefix-cache invalidation
                    "engine_pause_seconds": {
                        "median": statistics.median(stalls) if stalls else None,
                        "max": max(stalls) if stalls else None},
                    "staged_to_commit_seconds": {"median": statistics.median(lags),
                                                 "max": max(lags)},
                })
        finally:
            llm.collective_rpc("stop_weight_subscriber")
    return {"requests": requests, "tokens": tokens, "repeat": repeat, "rounds": rounds,
            "cadences": out, "first_busy_commit": first_streaming,
            "subscriber_options": subscriber_options or {}, "target": {"ratio_at_1s": 0.9}}
