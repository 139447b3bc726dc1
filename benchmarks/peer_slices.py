"""Peers sharing slices (issue 30), same run: what leaves the publisher per version.

No vLLM: the dense, Qwen-shaped tensors of ``slice_fetch.py`` (about 40 MB by default)
are published; N subscribers hold the same TP=2 plan (rank 0's half of every row;
norms and the embedding whole), as the same rank of N replicas of one layout would.
Per round, interleaved (peers first on odd rounds), each setup follows its own
publisher: (a) ``peer_share=True`` (the tracker plans the N members together; they
``slice_fetch`` from each other) and (b) without peers (each member fetches its plan
from the publisher). Printed per N: the publisher's planned bytes per version (x the
plan: ``bytes_sent_slices``; whole chunks, ``bytes_sent_full``, must stay 0), the
share the members got from peers, and publish -> every member staged, peers /
without (median of the rounds). Load on a shared box moves the times; the bytes do
not move.

The slice cache (``--cache``): N members of one plan with peers, the server's cache of
gathered slices on in one setup and off (``slice_cache_bytes`` 0) in the other, rounds
interleaved: the serving CPU per GB served (``upload_cpu_s``: the peer ROUTER's I/O
thread plus the serving work on the subscriber thread, ``upload_serve_cpu_s`` the
latter alone, where the gathers run), cache hits and misses, on / off as ratios.

    python benchmarks/peer_slices.py                 # ~40 MB, N = 2 and 4, 5 rounds
    python benchmarks/peer_slices.py --tiny          # smoke run
    python benchmarks/peer_slices.py --cache --members 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.slice_fetch import half_plan, model  # noqa: E402
from publisher import WeightPublisher  # noqa: E402
from subscriber_ext import WeightSubscriber  # noqa: E402
from weightpub_wire.slice_plan import SlicePlan  # noqa: E402


class Setup:
    """A publisher and N members of one plan, with or without peers."""

    def __init__(self, plan: SlicePlan, members: int, peers: bool, chunk_size: int,
                 cache: bool = True) -> None:
        self.pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=chunk_size,
                                   heartbeat_interval=0.5, peer_fanout=4 if peers else 0,
                                   peer_members_per_address=0)
        self.peers = peers
        self.subs = []
        for index in range(members):
            self.subs.append(WeightSubscriber(self.pub.endpoint, slice_plan=plan,
                                              peer_share=peers,
                                              subscriber_id=f"m{index}"))
            if not cache:  # the server gathers every slice it serves, every time
                peering = self.subs[-1]._client.peering
                assert peering is not None and peering.slice_cache is not None
                peering.slice_cache.max_bytes = 0
            if peers:  # one at a time: each takes the next slot
                wait(slot_is(self.subs[-1], index), f"member {index}'s slot")
        if peers:  # every member holds the final plan
            last = self.subs[-1]
            wait(lambda: all(s.status()["peers"]["plan_epoch"] ==
                             last.status()["peers"]["plan_epoch"] for s in self.subs),
                 "the final plan")
        self.seconds: list[float] = []

    def round(self, weights: dict[str, torch.Tensor], version: int) -> None:
        start = time.perf_counter()
        self.pub.publish(weights, version=version)
        for sub in self.subs:
            sub.wait_for_version(version, timeout=300).release()
        self.seconds.append(time.perf_counter() - start)

    def from_peers(self) -> int:
        return sum(sub.status()["peers"]["bytes_from_peers"] for sub in self.subs) \
            if self.peers else 0

    def serving(self) -> tuple[float, float, int, int, int]:
        """Over the members: (serving CPU s, of it on the subscriber thread, bytes
        served, cache hits, cache misses)."""
        got = [sub.status()["peers"] for sub in self.subs]
        return (sum(g["upload_cpu_s"] for g in got), sum(g["upload_serve_cpu_s"] for g in got),
                sum(g["payload_bytes_sent"] for g in got),
                sum(g["slice_cache_hits"] for g in got),
                sum(g["slice_cache_misses"] for g in got))

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        self.pub.close()


def slot_is(sub: WeightSubscriber, slot: int) -> Callable[[], bool]:
    return lambda: bool(sub.status()["peers"]["slot"] == slot)


def wait(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


class Rounds(Protocol):
    """What ``interleave`` runs: one version published and taken per call."""

    def round(self, weights: dict[str, torch.Tensor], version: int) -> None: ...


def interleave(first: Rounds, second: Rounds, shape: tuple[int, int, int],
               rounds: int) -> None:
    """Publish ``rounds`` versions to both setups, ``first`` first on odd rounds, so that
    load drifting over the run falls on both alike."""
    for version in range(1, rounds + 1):
        weights = model(*shape, version)
        for setup in (first, second) if version % 2 else (second, first):
            setup.round(weights, version)


def measure(members: int, plan: SlicePlan, shape: tuple[int, int, int], rounds: int,
            chunk: int) -> None:
    peered, alone = Setup(plan, members, True, chunk), Setup(plan, members, False, chunk)
    try:
        interleave(peered, alone, shape, rounds)
        print(f"N={members} members of one plan, {rounds} rounds:")
        for name, setup in (("with peers", peered), ("without", alone)):
            stats = setup.pub.data_stats()
            per = stats["bytes_sent_slices"] / rounds / plan.needed_bytes
            got = setup.from_peers() / (rounds * members * plan.needed_bytes)
            print(f"  {name:10s}: publisher {per:.2f}x the plan per version "
                  f"(whole chunks {int(stats['bytes_sent_full'])} B), "
                  f"{got:.2f} of the members' bytes from peers")
        p, a = statistics.median(peered.seconds), statistics.median(alone.seconds)
        print(f"  publish -> all {members} staged (median): peers {p:.3f}s, without "
              f"{a:.3f}s, ratio {p / a:.2f}x")
    finally:
        peered.close()
        alone.close()


def measure_cache(members: int, plan: SlicePlan, shape: tuple[int, int, int], rounds: int,
                  chunk: int) -> None:
    cached, bare = Setup(plan, members, True, chunk), Setup(plan, members, True, chunk, False)
    try:
        interleave(cached, bare, shape, rounds)
        print(f"N={members} members of one plan with peers, {rounds} rounds, slice cache:")
        per_gb = {}
        for name, setup in (("on", cached), ("off", bare)):
            cpu, serve, sent, hits, misses = setup.serving()
            gb = max(sent, 1) / 1e9
            per_gb[name] = (cpu / gb, serve / gb)
            print(f"  {name:3s}: served {sent / 1e6:.1f} MB, serving CPU {cpu / gb:.3f} s/GB "
                  f"(subscriber thread {serve / gb:.3f} s/GB), cache hits {hits}, "
                  f"misses (gathers) {misses}")
        on, off = per_gb["on"], per_gb["off"]
        print(f"  on / off: serving CPU per GB {on[0] / max(off[0], 1e-9):.2f}x, on the "
              f"subscriber thread {on[1] / max(off[1], 1e-9):.2f}x")
    finally:
        cached.close()
        bare.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-mib", type=float, default=1.0)
    parser.add_argument("--members", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cache", action="store_true",
                        help="compare the server's slice cache on and off instead")
    args = parser.parse_args()
    shape = (128, 2, 1000) if args.tiny else (512, 4, 8192)
    rounds = 2 if args.tiny else args.rounds
    first = model(*shape, 1)
    version_bytes = sum(t.numel() * t.element_size() for t in first.values())
    plan = half_plan(first, 0)
    chunk = int(args.chunk_mib * (1 << 20))
    print(f"version: {version_bytes / 1e6:.1f} MB, plan {plan.needed_bytes / 1e6:.1f} MB "
          f"({plan.needed_bytes / version_bytes:.3f}x), chunks of {chunk >> 10} KiB")
    for members in args.members:
        (measure_cache if args.cache else measure)(members, plan, shape, rounds, chunk)


if __name__ == "__main__":
    main()
