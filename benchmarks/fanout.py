"""Time to deliver a version to 4 replicas vs 1 replica (and 4 through a relay), in one run.

This process owns three publishers, each with its own subscriber processes (spawn), all
kept alive for the whole run: ``1`` (one subscriber), ``4`` (four subscribers) and
``relay4`` (a ``weightpub.relay.Relay`` in its own process subscribed to the third
publisher, four subscribers attached to the relay). Each subscriber sends ``time.time()``
through a pipe right after ``wait_for_version`` returns (the version complete, checksummed
and staged). Deliver time = ``publish()`` start -> the last subscriber of the group
staged. Rounds are interleaved (1, 4, relay4, rotating order), each publishing a changed
version; medians over the rounds after the warm-up. Target (shared/DESIGN.md):
deliver(4) / deliver(1) <= 1.5. ``raw4`` is the baseline for fan-out itself: this process
sends the same bytes on 4 TCP sockets at once (a thread each, ``sendall``) to 4 processes
that ``recv_into`` a buffer of their own; target: raw4 / 4 >= 0.85 (issue 29).
The stream groups (issue 29): ``s1`` / ``s4`` are 1 / 4 subscribers with ``stream=True``
to a publisher with ``stream=True`` (chunks on its plain TCP port, ``sendmsg`` straight
from the snapshot, ``recv_into`` staging), against ``raw1`` / ``raw4``. Each subscriber
also reports the CPU-seconds its process spent per version (``time.process_time``),
shown per GB received. Early sums (issue 29, ``announce_early``): ``e1`` / ``e4`` are
``s1`` / ``s4`` with the publisher announcing each version before its snapshot is
copied and hashed (the checksums follow over the ROUTER), ``z1`` the same over ZeroMQ
frames. ``pub CPU-s/GB`` is this process's CPU over the round (the publisher, or the
raw sender threads) per GB delivered; ``net`` subtracts what the process spends idle
(measured over 2 s before the rounds, every group attached: each idle publisher's serving
thread wakes every ``GuardLimits.check_interval``, ~15 ms CPU a second), so a group is not
charged for the other groups' publishers living in the same process.

On one 2-core machine all replicas, the relay and the publisher share the CPU, the memory
bandwidth and the loopback, so this measures the publisher's cost of serving N subscribers
plus N receivers competing for 2 cores, not network fan-out (where each replica has its
own NIC and cores and the trainer's uplink is the bottleneck).

    python benchmarks/fanout.py                    # 256 MiB versions, 6 rounds (~1.5 min)
    python benchmarks/fanout.py --mib 32 --rounds 3    # quick smoke run
    python benchmarks/fanout.py --groups 4,raw4        # only fan-out against raw streams
    python benchmarks/fanout.py --groups raw1,s1,4,s4,raw4   # the stream path (issue 29)
    python benchmarks/fanout.py --groups raw1,s1,e1,z1,raw4,s4,e4   # early sums (issue 29)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from typing import Any

import orjson
import torch

from weightpub.bench.cpu_probe import idle_cpu_rate
from weightpub_wire.buffers import byte_view

GROUPS = ("1", "4", "relay4", "raw4", "raw1", "s1", "s4", "e1", "e4", "z1")
_FAN = {"1": 1, "4": 4, "relay4": 4, "raw4": 4, "raw1": 1, "s1": 1, "s4": 4, "e1": 1, "e4": 4,
        "z1": 1}
_STREAM = ("s1", "s4", "e1", "e4")
_EARLY = ("e1", "e4", "z1")


def _subscriber(endpoint: str, versions: int, window_mib: int, conn: Any,
                stream: bool = False) -> None:
    from subscriber_ext import WeightSubscriber

    with WeightSubscriber(endpoint, window_bytes=window_mib << 20, stream=stream) as sub:
        conn.send("ready")
        cpu = time.process_time()
        for version in range(1, versions + 1):
            staged = sub.wait_for_version(version, timeout=300)
            now = time.process_time()
            # staged: complete and verified; the CPU this process spent on the version
            conn.send((time.time(), now - cpu, staged.data_path))
            cpu = now
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


def _raw_receiver(port: int, nbytes: int, versions: int, conn: Any) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        conn.send("ready")
        for _ in range(versions):
            got = 0
            cpu = time.process_time()
            while got < nbytes:
                n = sock.recv_into(view[got:], nbytes - got)
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
            conn.send((time.time(), time.process_time() - cpu, "raw"))


class RawGroup:
    """``n`` raw TCP streams of the same bytes from this process, one receiver process each."""

    def __init__(self, n: int, nbytes: int, versions: int) -> None:
        ctx = mp.get_context("spawn")
        server = socket.create_server(("127.0.0.1", 0))
        self.conns, self.procs, self.socks = [], [], []
        for _ in range(n):
            conn, child = mp.Pipe()
            proc = ctx.Process(target=_raw_receiver,
                               args=(server.getsockname()[1], nbytes, versions, child),
                               daemon=True)
            proc.start()
            server.settimeout(120)
            sock, _ = server.accept()
            self.conns.append(conn)
            self.procs.append(proc)
            self.socks.append(sock)
        server.close()
        for conn in self.conns:
            conn.recv()

    def round(self, weights: dict[str, torch.Tensor]) -> tuple[float, float, float]:
        view = byte_view(weights["w"])
        start = time.time()
        threads = [threading.Thread(target=sock.sendall, args=(view,)) for sock in self.socks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        staged = [conn.recv() for conn in self.conns]
        return max(s[0] for s in staged) - start, 0.0, sum(s[1] for s in staged)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        for proc in self.procs:
            proc.join(60)


class Group:
    """A publisher here and ``n`` subscriber processes (optionally behind a relay)."""

    def __init__(self, n: int, relay: bool, versions: int, chunk_mib: int,
                 window_mib: int, stream: bool = False, early: bool = False) -> None:
        from publisher import WeightPublisher

        ctx = mp.get_context("spawn")
        self.stream = stream
        self.pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=chunk_mib << 20,
                                   stream=stream, announce_early=early)
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
            proc = ctx.Process(target=_subscriber,
                               args=(endpoint, versions, window_mib, child, stream),
                               daemon=True)
            proc.start()
            self.conns.append(conn)
            self.procs.append(proc)
        for conn in self.conns:
            conn.recv()

    def round(self, weights: dict[str, torch.Tensor]) -> tuple[float, float, float]:
        """(publish() start -> last subscriber staged, seconds publish() took, the
        subscribers' CPU-seconds on the version)."""
        start = time.time()
        self.pub.publish(weights)
        publish_s = time.time() - start
        staged = [conn.recv() for conn in self.conns]
        if self.stream and any(s[2] != "stream" for s in staged):
            print(f"    (stream group: data paths {[s[2] for s in staged]})", flush=True)
        return max(s[0] for s in staged) - start, publish_s, sum(s[1] for s in staged)

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
    parser.add_argument("--groups", default=",".join(GROUPS),
                        help=f"which of {','.join(GROUPS)} to run (1 is always run)")
    args = parser.parse_args()
    chosen = tuple(g for g in GROUPS if g == "1" or g in args.groups.split(","))
    nbytes = args.mib << 20
    versions = args.warmup + args.rounds
    weights = {"w": torch.randint(0, 255, (nbytes,), dtype=torch.uint8)}
    t0 = time.perf_counter()
    groups: dict[str, Group | RawGroup] = {
        name: RawGroup(_FAN[name], nbytes, versions) if name.startswith("raw") else
        Group(_FAN[name], name == "relay4", versions, args.chunk_mib, args.window_mib,
              stream=name in _STREAM, early=name in _EARLY) for name in chosen}
    print(f"{args.mib} MiB versions; groups {', '.join(chosen)} started in "
          f"{time.perf_counter() - t0:.1f} s; {args.rounds} rounds (+{args.warmup} warm-up) "
          f"per group, interleaved", flush=True)
    deliver: dict[str, list[float]] = {g: [] for g in chosen}
    publish: dict[str, list[float]] = {g: [] for g in chosen}
    cpu: dict[str, list[float]] = {g: [] for g in chosen}
    pub_cpu: dict[str, list[float]] = {g: [] for g in chosen}
    pub_net: dict[str, list[float]] = {g: [] for g in chosen}
    loads: list[float] = []
    idle_rate = idle_cpu_rate(2.0)  # CPU-s a second, every group idle
    print(f"idle: this process spends {idle_rate * 1000:.0f} ms CPU a second", flush=True)
    for rnd in range(versions):
        shift = rnd % len(chosen)
        order = chosen[shift:] + chosen[:shift]
        line = []
        for name in order:
            weights["w"][rnd * 8:rnd * 8 + 8] += 1  # a different version each round
            here, wall = time.process_time(), time.perf_counter()
            took, pub_s, cpu_s = groups[name].round(weights)
            here = time.process_time() - here  # the publisher's (or raw senders') CPU
            wall = time.perf_counter() - wall
            line.append(f"{name}={took:.3f}s")
            if rnd >= args.warmup:
                deliver[name].append(took)
                publish[name].append(pub_s)
                cpu[name].append(cpu_s / (_FAN[name] * nbytes / 1e9))
                pub_cpu[name].append(here / (_FAN[name] * nbytes / 1e9))
                pub_net[name].append((here - idle_rate * wall) / (_FAN[name] * nbytes / 1e9))
        tag = "warm-up" if rnd < args.warmup else f"round {rnd - args.warmup + 1}"
        loads.append(os.getloadavg()[0])
        print(f"  {tag:>8}  " + "  ".join(line) + f"  (load {loads[-1]:.1f})", flush=True)
    for group in groups.values():
        group.close()
    med = {g: statistics.median(v) for g, v in deliver.items()}
    ratio = med["4"] / med["1"] if "4" in med else float("nan")
    relay_ratio = med["relay4"] / med["1"] if "relay4" in med else float("nan")
    # per round, raw4's time over 4's (the rounds interleave the two): a same-run ratio
    def same_run(raw: str, ours: str) -> float:
        if raw not in med or ours not in med:
            return float("nan")
        return statistics.median(r / w for r, w in zip(deliver[raw], deliver[ours],
                                                       strict=True))

    raw_ratio = same_run("raw4", "4")
    ratios = {f"raw{_FAN[ours]}/{ours}": same_run(f"raw{_FAN[ours]}", ours)
              for ours in chosen if not ours.startswith("raw") and ours != "relay4"
              and f"raw{_FAN[ours]}" in med}
    print(f"\n{'group':<30}{'deliver s (median)':>19}{'min':>8}{'max':>8}{'GB/s out':>10}"
          f"{'publish() s':>13}{'sub CPU-s/GB':>14}{'pub CPU-s/GB':>14}{'net':>7}")
    labels = {"1": "1 subscriber", "4": "4 subscribers", "relay4": "4 behind a relay",
              "raw4": "4 raw TCP streams", "raw1": "1 raw TCP stream",
              "s1": "1 subscriber, stream", "s4": "4 subscribers, stream",
              "e1": "1 subscriber, stream, early", "e4": "4 subscribers, stream, early",
              "z1": "1 subscriber, frames, early"}
    for g in chosen:
        fan = _FAN[g]
        print(f"{labels[g]:<30}{med[g]:>19.3f}{min(deliver[g]):>8.3f}{max(deliver[g]):>8.3f}"
              f"{fan * nbytes / med[g] / 1e9:>10.2f}{statistics.median(publish[g]):>13.3f}"
              f"{statistics.median(cpu[g]):>14.2f}{statistics.median(pub_cpu[g]):>14.2f}"
              f"{statistics.median(pub_net[g]):>7.2f}")
    print(f"load average over the rounds: {min(loads):.1f}-{max(loads):.1f}")
    print("same-run ratios (raw time / ours, per round, median): " +
          ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(f"ratio 4/1 {ratio:.2f}x (target <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}); "
          f"relay4/1 {relay_ratio:.2f}x; 4 subscribers vs 4 raw streams {raw_ratio:.2f}x "
          f"(target >= 0.85x: {'met' if raw_ratio >= 0.85 else 'NOT met'})")
    print(orjson.dumps({
        "bench": "fanout", "bytes": nbytes, "rounds": args.rounds, "median_s": med,
        "ratio_4_vs_1": ratio, "ratio_relay4_vs_1": relay_ratio,
        "ratio_raw4_vs_4": raw_ratio, "target": "<= 1.5", "same_run_ratios": ratios,
        "deliver_s": deliver, "publish_s": publish, "sub_cpu_s_per_gb": cpu,
        "pub_cpu_s_per_gb": pub_cpu, "pub_cpu_s_per_gb_net": pub_net,
        "idle_cpu_s_per_s": idle_rate, "load": loads,
    }).decode())


if __name__ == "__main__":
    main()
