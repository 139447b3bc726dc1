"""Slice fetch vs whole versions, same run: bytes per receiver and publish -> staged time.

No vLLM: a dense, Qwen-shaped set of tensors (about 40 MB by default) is published;
per round, interleaved (sliced first on even rounds), (a) two subscribers with
complementary TP=2 plans (rank 0: the first half of every row of each matrix, rank 1:
the second half; norms and the embedding whole for both) and (b) one subscriber taking
whole versions (what node staging receives per node) each follow their own publisher
through their own byte-counting TCP relay, so the transfers do not compete. Printed:
bytes each receiver took per version (x the version), both sliced receivers together,
and publish -> every receiver staged, sliced / whole (median of the rounds).

    python benchmarks/slice_fetch.py             # ~40 MB, 5 rounds
    python benchmarks/slice_fetch.py --tiny      # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from publisher import WeightPublisher  # noqa: E402
from subscriber_ext import WeightSubscriber  # noqa: E402
from tests.transport.byte_relay import ByteRelay  # noqa: E402
from weightpub_wire.slice_plan import SlicePlan, from_ranges  # noqa: E402


def model(hidden: int, layers: int, vocab: int, version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    out: dict[str, torch.Tensor] = {"embed.weight": torch.randn(vocab, hidden, generator=gen,
                                                                 dtype=torch.bfloat16)}
    for layer in range(layers):
        p = f"layers.{layer}."
        out[p + "qkv_proj.weight"] = torch.randn(3 * hidden, hidden, generator=gen,
                                                 dtype=torch.bfloat16)
        out[p + "o_proj.weight"] = torch.randn(hidden, hidden, generator=gen,
                                               dtype=torch.bfloat16)
        out[p + "gate_up_proj.weight"] = torch.randn(8 * hidden, hidden, generator=gen,
                                                     dtype=torch.bfloat16)
        out[p + "down_proj.weight"] = torch.randn(hidden, 4 * hidden, generator=gen,
                                                  dtype=torch.bfloat16)
        out[p + "norm.weight"] = torch.randn(hidden, generator=gen, dtype=torch.bfloat16)
    return out


def half_plan(weights: dict[str, torch.Tensor], rank: int) -> SlicePlan:
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dim() != 2 or name.startswith("embed"):
            ranges[name] = [(0, nbytes)]
            continue
        row = tensor.shape[1] * tensor.element_size()
        half = row // 2
        ranges[name] = [(i * row + rank * half, i * row + (rank + 1) * half)
                        for i in range(tensor.shape[0])]
    return from_ranges(f"tp2/rank{rank}", ranges)


class Setup:
    """A publisher and its receivers, each behind its own relay."""

    def __init__(self, plans: list[SlicePlan | None], chunk_size: int) -> None:
        self.pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=chunk_size,
                                   heartbeat_interval=0.5)
        self.relays = [ByteRelay.in_front_of(self.pub.endpoint) for _ in plans]
        self.subs = [WeightSubscriber(relay.endpoint, slice_plan=plan)
                     for relay, plan in zip(self.relays, plans, strict=True)]
        self.seconds: list[float] = []

    def round(self, weights: dict[str, torch.Tensor], version: int) -> None:
        start = time.perf_counter()
        self.pub.publish(weights, version=version)
        for sub in self.subs:
            sub.wait_for_version(version, timeout=300).release()
        self.seconds.append(time.perf_counter() - start)

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        for relay in self.relays:
            relay.close()
        self.pub.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-mib", type=float, default=1.0)
    args = parser.parse_args()
    hidden, layers, vocab = (128, 2, 1000) if args.tiny else (512, 4, 8192)
    rounds = 2 if args.tiny else args.rounds
    first = model(hidden, layers, vocab, 1)
    version_bytes = sum(t.numel() * t.element_size() for t in first.values())
    plans = [half_plan(first, 0), half_plan(first, 1)]
    chunk = int(args.chunk_mib * (1 << 20))
    sliced, whole = Setup(list(plans), chunk), Setup([None], chunk)
    try:
        for version in range(1, rounds + 1):
            weights = model(hidden, layers, vocab, version)
            order = (sliced, whole) if version % 2 else (whole, sliced)
            for setup in order:
                setup.round(weights, version)
        print(f"version: {version_bytes / 1e6:.1f} MB, {rounds} rounds, chunks of "
              f"{chunk >> 10} KiB")
        for rank, (relay, plan) in enumerate(zip(sliced.relays, plans, strict=True)):
            took = relay.bytes_down / rounds
            print(f"  sliced rank {rank}: {took / version_bytes:.3f}x the version per version "
                  f"(plan {plan.needed_bytes / version_bytes:.3f}x)")
        together = sum(r.bytes_down for r in sliced.relays) / rounds
        print(f"  sliced ranks together: {together / version_bytes:.3f}x")
        print(f"  whole receiver: {whole.relays[0].bytes_down / rounds / version_bytes:.3f}x")
        s, w = statistics.median(sliced.seconds), statistics.median(whole.seconds)
        print(f"  publish -> staged (median): sliced {s:.3f}s (both ranks), whole {w:.3f}s, "
              f"ratio {s / w:.2f}x")
    finally:
        sliced.close()
        whole.close()


if __name__ == "__main__":
    main()
