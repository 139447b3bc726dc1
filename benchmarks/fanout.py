"""Time to deliver a version to 4 replicas vs 1 replica (and 4 through a relay), in one run.

This process owns three publishers, each with its own subscriber processes (spawn), all
kept alive for the whole run: ``1`` (one subscriber), ``4`` (four subscribers) and
``relay4`` (a ``weightpub.relay.Relay`` in its own process subscribed to the third
publisher, four subscribers attached to the relay). Each subscriber sends ``time.time()``
through a pipe right after ``wait_for_version`` returns (the version complete, checksummed
and staged). Deliver time = ``publish()`` start -> the last subscriber of the group
staged. Rounds are interleaved (1, 4, relay4, rotating order), each publishing a changed
version; medians over the rounds after the warm-up. Target (shared/DESIGN.md):
deliver(4) / deliver(1) <= 1.5.

On one 2-core machine all replicas, the relay and the publisher share the CPU, the memory
bandwidth and the loopback, so this measures the publisher's cost of serving N subscribers
plus N receivers competing for 2 cores, not network fan-out (where each replica has its
own NIC and cores and the trainer's uplink is the bottleneck).

    python benchmarks/fanout.py                    # 256 MiB versions, 6 rounds (~1.5 min)
    python benchmarks/fanout.py --mib 32 --rounds 3    # quick smoke run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import orjson
import torch

GROUPS = ("1", "4", "relay4")


def _subscriber(endpoint: str, versions: int, window_mib: int, conn: Any) -> None:
    from subscriber_ext import WeightSubscriber

    with WeightSubscriber(endpoint, window_bytes=window_mib << 20) as sub:
        conn.send("ready")
        for version in range(1, versions + 1):
            staged = sub.wait_for_version(version, timeout=300)
            conn.send(time.time())  # staged: complete and verified
            staged.release()


def _relay(upstream: str, chunk_mib: int, window_mib: int, conn: Any) -> None:
    from weightpub.deployment_config import PublisherConfig, RelayConfig, SubscriberConfig
    from weightpub.relay import Relay

    config = RelayConfig(
        upstream=SubscriberConfig(endpoint=upstream, window_bytes=window_mib << 20),
        downstream=PublisherConfig(endpoint="tcp://127.0.0.1:0",
                                   chunk_size=(chunk_mib << 20) or None),
    )
    with Relay(config) as relay:
        conn.send(relay.endpoint)
        conn.recv()  # until told to stop


class Group:
    """A publisher here and ``n`` subscriber processes (optionally behind a relay)."""

    def __init__(self, n: int, relay: bool, versions: int, chunk_mib: int,
                 window_mib: int) -> None:
        from publisher import WeightPublisher

        ctx = mp.get_context("spawn")
        self.pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=chunk_mib << 20)
        endpoint = self.pub.endpoint
        self.relay_conn = None
        if relay:
            self.relay_conn, child = mp.Pipe()
            self.relay_proc = ctx.Process(target=_relay, args=(endpoint, chunk_mib, window_mib,
                                                                child), daemon=True)
            self.relay_proc.start()
            endpoint = self.relay_conn.recv()
        self.conns, self.procs = [], []
        for _ in range(n):
            conn, child = mp.Pipe()
            proc = ctx.Process(target=_subscriber, args=(endpoint, versions, window_mib, child),
                               daemon=True)
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)
        for conn in self.conns:
            conn.recv()

    def round(self, weights: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(publish() start -> last subscriber staged, seconds publish() took)."""
        start = time.time()
        self.pub.publish(weights)
        publish_s = time.time() - start
        staged = [conn.recv() for conn in self.conns]
        return max(staged) - start, publish_s

    def close(self) -> None:
        for proc in self.procs:
            proc.join(60)
        if self.relay_conn is not None:
            self.relay_conn.send("stop")
            self.relay_proc.join(60)
        self.pub.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes per version, MiB")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per group")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--window-mib", type=int, default=64, help="subscriber credit")
    args = parser.parse_args()
    nbytes = args.mib << 20
    versions = args.warmup + args.rounds
    weights = {"w": torch.randint(0, 255, (nbytes,), dtype=torch.uint8)}
    t0 = time.perf_counter()
    groups = {name: Group(4 if name != "1" else 1, name == "relay4", versions,
                          args.chunk_mib, args.window_mib) for name in GROUPS}
    print(f"{args.mib} MiB versions; 9 subscriber processes + 1 relay process started in "
          f"{time.perf_counter() - t0:.1f} s; {args.rounds} rounds (+{args.warmup} warm-up) "
          f"per group, interleaved", flush=True)
    deliver: dict[str, list[float]] = {g: [] for g in GROUPS}
    publish: dict[str, list[float]] = {g: [] for g in GROUPS}
    for rnd in range(versions):
        order = GROUPS[rnd % 3:] + GROUPS[:rnd % 3]
        line = []
        for name in order:
            weights["w"][rnd * 8:rnd * 8 + 8] += 1  # a different version each round
            took, pub_s = groups[name].round(weights)
            line.append(f"{name}={took:.3f}s")
            if rnd >= args.warmup:
                deliver[name].append(took)
                publish[name].append(pub_s)
        tag = "warm-up" if rnd < args.warmup else f"round {rnd - args.warmup + 1}"
        print(f"  {tag:>8}  " + "  ".join(line), flush=True)
    for group in groups.values():
        group.close()
    med = {g: statistics.median(v) for g, v in deliver.items()}
    ratio = med["4"] / med["1"]
    relay_ratio = med["relay4"] / med["1"]
    print(f"\n{'group':<24}{'deliver s (median)':>19}{'min':>8}{'max':>8}{'GB/s out':>10}"
          f"{'publish() s':>13}")
    labels = {"1": "1 subscriber", "4": "4 subscribers", "relay4": "4 behind a relay"}
    for g in GROUPS:
        fan = 1 if g == "1" else 4
        print(f"{labels[g]:<24}{med[g]:>19.3f}{min(deliver[g]):>8.3f}{max(deliver[g]):>8.3f}"
              f"{fan * nbytes / med[g] / 1e9:>10.2f}{statistics.median(publish[g]):>13.3f}")
    print(f"ratio 4/1 {ratio:.2f}x (target <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}); "
          f"relay4/1 {relay_ratio:.2f}x")
    print(orjson.dumps({
        "bench": "fanout", "bytes": nbytes, "rounds": args.rounds, "median_s": med,
        "ratio_4_vs_1": ratio, "ratio_relay4_vs_1": relay_ratio, "target": "<= 1.5",
        "deliver_s": deliver, "publish_s": publish,
    }).decode())


if __name__ == "__main__":
    main()
