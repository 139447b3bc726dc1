"""Fleet simulator: deliver versions to K simulated replica hosts over rate-limited links.

Each host is a network namespace with its own shaped link (``benchmarks/netsim.py``):
the trainer's uplink, every replica host's downlink and uplink (default 400 Mbit/s
each), optional delay. Real processes run inside them (``benchmarks/fleet_node.py``):
a publisher on the trainer host, a subscriber per replica host, and, in relay mode,
relays on hosts of their own. Delivery time of a version = ``publish()`` called on
the trainer -> the *last* replica host has it staged and verified (its digest is
checked against the trainer's). Every mode and fleet size runs in one invocation, so
the ratios (K hosts vs 1 host) are same-run figures.

    python benchmarks/fleet.py                       # 1, 4, 16 hosts; direct and relay
    python benchmarks/fleet.py --hosts 1 4 --mib 16 --rounds 2
    python benchmarks/fleet.py --json

Needs root (network namespaces). Cleans up its namespaces and processes on exit,
Ctrl-C included; ``--reap`` removes leftovers of a run that was killed outright.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.netsim import Host, Link, Network, available  # noqa: E402

PORT = 5555


@dataclass
class Node:
    """A ``fleet_node`` process inside a host; events arrive on a queue."""

    host: Host
    role: str
    proc: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)

    @classmethod
    def start(cls, host: Host, role: str, args: dict[str, Any]) -> Node:
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        proc = host.popen([sys.executable, "-m", "benchmarks.fleet_node", role,
                           json.dumps(args)], cwd=str(REPO), env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL)
        node = cls(host, role, proc)
        threading.Thread(target=node._read, daemon=True).start()
        return node

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                continue

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def wait(self, event: str, timeout: float, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.role} on {self.host.name}: no {event} {match}")
            try:
                got = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.role} on {self.host.name} exited "
                                       f"({self.proc.returncode})") from None
                continue
            if got.get("event") == event and all(got.get(k) == v for k, v in match.items()):
                return got


@dataclass
class Scenario:
    hosts: int
    mode: str  # "direct" | "relay"
    mib: int
    rounds: int
    link: Link
    relays: int = 0
    timeout: float = 300.0


def run_scenario(s: Scenario) -> dict[str, Any]:
    """One fleet, ``rounds`` versions; returns delivery times and their median."""
    with Network() as net:
        trainer = net.add_host(s.link)
        publisher = Node.start(trainer, "publisher",
                               {"bind": f"tcp://{trainer.address}:{PORT}"})
        endpoint = publisher.wait("ready", 120)["endpoint"]
        sources = [endpoint]
        nodes: list[Node] = [publisher]
        if s.mode == "relay":
            relays = s.relays or max(1, round(math.sqrt(s.hosts)))
            sources = []
            for _ in range(relays):
                host = net.add_host(s.link)
                relay = Node.start(host, "relay", {"connect": endpoint,
                                                  "bind": f"tcp://{host.address}:{PORT}"})
                nodes.append(relay)
                sources.append(relay.wait("ready", 120)["endpoint"])
        subscribers = []
        for index in range(s.hosts):
            host = net.add_host(s.link)
            sub = Node.start(host, "subscriber", {"connect": sources[index % len(sources)]})
            subscribers.append(sub)
        for sub in subscribers:
            sub.wait("ready", 120)
        times = []
        for version in range(1, s.rounds + 1):
            publisher.send(cmd="publish", version=version, mib=s.mib)
            want = publisher.wait("digest", 120, version=version)["digest"]
            start = publisher.wait("published", 120, version=version)["start"]
            arrived = [sub.wait("staged", s.timeout, version=version) for sub in subscribers]
            bad = [a for a in arrived if a["digest"] != want]
            if bad:
                raise AssertionError(f"version {version}: {len(bad)} hosts got wrong bytes")
            times.append(max(a["t"] for a in arrived) - start)
        for node in nodes + subscribers:
            node.send(cmd="exit")
    return {"hosts": s.hosts, "mode": s.mode, "mib": s.mib, "seconds": times,
            "median_s": statistics.median(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--modes", nargs="+", default=["direct", "relay"],
                    choices=["direct", "relay"])
    ap.add_argument("--mib", type=int, default=48, help="version size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mbit", type=float, default=400.0, help="every link, each direction")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reap", action="store_true", help="remove leftovers of killed runs")
    args = ap.parse_args()
    if args.reap:
        print("removed:", Network.reap())
        return 0
    ok, why = available()
    if not ok:
        print(f"fleet simulator skipped: {why}", file=sys.stderr)
        return 2
    link = Link(up_mbit=args.mbit, down_mbit=args.mbit, delay_ms=args.delay_ms)
    line_rate_s = args.mib * (1 << 20) * 8 / (args.mbit * 1e6)
    results = []
    for mode in args.modes:
        for hosts in args.hosts:
            result = run_scenario(Scenario(hosts, mode, args.mib, args.rounds, link))
            results.append(result)
            if not args.json:
                print(f"{mode:>7} {hosts:>3} hosts: median {result['median_s']:.2f} s "
                      f"({result['median_s'] / line_rate_s:.2f}x one transfer at line rate)",
                      flush=True)
    base = {r["mode"]: r["median_s"] for r in results if r["hosts"] == min(args.hosts)}
    for r in results:
        r["vs_one_host"] = round(r["median_s"] / base[r["mode"]], 3)
    summary = {"line_rate_transfer_s": round(line_rate_s, 3), "results": results,
               "target": "16 hosts <= 1.5x 1 host (peer sharing)"}
    if not args.json:
        for r in results:
            print(f"{r['mode']:>7} {r['hosts']:>3} hosts / {min(args.hosts)}: "
                  f"{r['vs_one_host']:.2f}x")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
