"""Fleet simulator: deliver versions to K simulated replica hosts over rate-limited links.

Each host is a network namespace with its own shaped link (``benchmarks/netsim.py``):
the trainer's uplink, every replica host's downlink and uplink (default 400 Mbit/s
each), optional delay. Real processes run inside them (``benchmarks/fleet_node.py``):
a publisher on the trainer host, a subscriber per replica host, and relays on hosts
of their own. Delivery time of a version = ``publish()`` called on the trainer ->
the *last* replica host has it staged and verified (its digest is checked against
the trainer's). Modes:

* ``direct``: every subscriber fetches from the trainer;
* ``relay``: sqrt(K) cut-through relays between the trainer and the subscribers;
* ``relay-sf``: the same with store-and-forward relays (``cut_through: false``);
* ``peers``: every subscriber ``peer_share=True``; the trainer's tracker splits each
  version into ``--fanout`` stripes, each fetched once from the trainer by its root
  and passed down that stripe's tree (``publisher/serving/tracker.py``).

``--trainer-ranks R`` (R > 1): the trainer is R ranks of a ``ShardedPublisher``, each
on a simulated host of its own behind its own link, each serving 1/R of the tensors
(rank 0 also announces the union); subscribers fetch each chunk from its rank
(issue 20); with ``peers`` the coordinator's tracker stripes the union and each stripe's
root fetches it from the ranks.

Also reported: the trainer's uplink bytes per version (``data_stats``), in versions.
Every mode and fleet size runs in one invocation, so the ratios (K hosts vs 1 host)
are same-run figures. The first version and the steady state (the median of versions
2..N) are reported apart: the first one meets cold buffers and connections.

What a deployment may do differently can be varied (issue 22.5: an outside harness
with all of these measured what this one did not): ``--publisher-root`` (the trainer in
the machine's own namespace, behind a shaped link of its own), ``--chunk-mib 0`` (the
publisher's default chunk size; the simulator's default is 1 MiB), ``--torch-threads 0``
(torch's default threads), ``--stream`` (the trainer's stream port, taken by every
subscriber; peers forward over their own stream ports), ``--spacing S`` (the next
version S seconds after the last host had the previous one), ``--consumer wait``
(subscribers take versions with ``wait_for_version`` on a thread of their own, then
``release()``), ``--dtype bf16``.

    python benchmarks/fleet.py                       # 1, 4, 16 hosts; direct, relay, peers
    python benchmarks/fleet.py --hosts 1 4 --mib 16 --rounds 2 --modes direct peers
    python benchmarks/fleet.py --json
    python benchmarks/fleet.py --hosts 1 16 --modes peers --rounds 4 --publisher-root \
        --chunk-mib 0 --torch-threads 0 --spacing 1 --consumer wait --dtype bf16 --diag

Needs root (network namespaces). Cleans up its namespaces and processes on exit,
Ctrl-C included; ``--reap`` removes leftovers of a run that was killed outright.
"""

from __future__ import annotations

import argparse
import itertools
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
from weightpub.bench.forked import ForkedProcess  # noqa: E402

PORT = 5555


@dataclass
class Node:
    """A ``fleet_node`` process inside a host; events arrive on a queue."""

    host: Host
    role: str
    proc: subprocess.Popen[str] | ForkedProcess
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)

    @classmethod
    def start(cls, host: Host, role: str, args: dict[str, Any],
              torch_threads: int = 1, forked: bool = False) -> Node:
        """``forked``: forked from a zygote that imported torch once (``Host.fork``), not
        a fresh interpreter: the same node in milliseconds instead of seconds of CPU."""
        log_dir = os.environ.get("FLEET_LOG_DIR")  # keep each node's log there
        log = None
        if log_dir:
            log = open(os.path.join(log_dir, f"{host.name or 'root'}-{role}.log"), "w")
        if forked:
            if not torch_threads:
                raise ValueError("forked nodes need torch_threads >= 1 (the zygote's "
                                 "torch is already loaded: its default is not a fresh one)")
            from benchmarks.fleet_node import PRELOAD, forked_main

            env = {"PYTHONUNBUFFERED": "1", "FLEET_TORCH_THREADS": str(torch_threads),
                   "OMP_NUM_THREADS": str(torch_threads)}
            node = cls(host, role, host.fork(forked_main, (role, json.dumps(args), env),
                                             stderr=log, preload=PRELOAD,
                                             name=f"fleet-{role}"))
            threading.Thread(target=node._read, daemon=True).start()
            return node
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                   FLEET_TORCH_THREADS=str(torch_threads))
        if torch_threads:
            env["OMP_NUM_THREADS"] = str(torch_threads)
        else:  # torch's default, as an application that never set it
            env.pop("OMP_NUM_THREADS", None)
        stderr: Any = subprocess.DEVNULL if log is None else log
        proc = host.popen([sys.executable, "-m", "benchmarks.fleet_node", role,
                           json.dumps(args)], cwd=str(REPO), env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=stderr)
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


MODES = ("direct", "relay", "relay-sf", "peers")


@dataclass
class Scenario:
    hosts: int
    mode: str  # one of MODES
    mib: int
    rounds: int
    link: Link
    relays: int = 0
    chunk_mib: int = 1  # 0: the publisher's default chunk size
    fanout: int = 4
    timeout: float = 300.0
    torch_threads: int = 1  # in every node; 0: torch's default
    publisher_root: bool = False  # the trainer in the machine's own namespace
    spacing: float = 0.0  # seconds from the last host's arrival to the next publish()
    consumer: str = "callback"  # subscribers: "callback" (on_version) or "wait"
    dtype: str = "uint8"  # "bf16": 8 bf16 tensors
    diag: bool = False  # each host's peer figures after every version
    prefix: str = "wpsim"  # of its namespaces (``Network.reap`` removes them by it)
    trainer_ranks: int = 1  # > 1: a ShardedPublisher, one simulated host per rank
    forked_nodes: bool = False  # nodes forked from a zygote with torch loaded (tests)
    stream: bool = False  # the trainer's and the subscribers' plain-TCP stream (issue 29)


def run_scenario(s: Scenario) -> dict[str, Any]:
    """One fleet, ``rounds`` versions; returns delivery times, the first version's and
    the median of the later ones (steady state) apart."""
    with Network(s.prefix) as net:
        trainer = net.add_root_host(s.link) if s.publisher_root else net.add_host(s.link)
        if s.trainer_ranks > 1:
            trainers = _start_ranks(net, trainer, s)
            endpoint = trainers[0].wait("ready", 120)["announce"]
        else:
            trainers = [Node.start(trainer, "publisher", {
                "bind": f"tcp://{trainer.address}:{PORT}", "chunk_mib": s.chunk_mib,
                "publisher_options": {"peer_fanout": s.fanout, "stream": s.stream}},
                s.torch_threads,
                s.forked_nodes)]
            endpoint = trainers[0].wait("ready", 120)["endpoint"]
        publisher = trainers[0]
        sources = [endpoint]
        nodes: list[Node] = list(trainers)
        if s.mode.startswith("relay"):
            relays = s.relays or max(1, round(math.sqrt(s.hosts)))
            sources = []
            for _ in range(relays):
                host = net.add_host(s.link)
                relay = Node.start(host, "relay", {
                    "connect": endpoint, "bind": f"tcp://{host.address}:{PORT}",
                    "cut_through": s.mode == "relay",
                    "publisher_options": {"chunk_mib": s.chunk_mib} if s.chunk_mib else {}},
                    s.torch_threads, s.forked_nodes)
                nodes.append(relay)
                sources.append(relay.wait("ready", 120)["endpoint"])
        options: dict[str, Any] = {"peer_share": True, "insecure": True} \
            if s.mode == "peers" else {}
        if s.stream:  # and peers forward over their own stream ports (docs/peer-stream.md)
            options["stream"] = True
        subscribers = []
        for index in range(s.hosts):
            host = net.add_host(s.link)
            sub = Node.start(host, "subscriber", {"connect": sources[index % len(sources)],
                                                  "subscriber_options": options,
                                                  "consumer": s.consumer}, s.torch_threads,
                           s.forked_nodes)
            subscribers.append(sub)
        for sub in subscribers:
            sub.wait("ready", 120)
        if s.mode == "peers":  # every subscriber has said hello and holds the plan
            _wait_for_plan(subscribers, 10.0)
        times, trainer_versions, spreads, diag = [], [], [], []
        sent_before = 0.0
        for version in range(1, s.rounds + 1):
            if version > 1 and s.spacing:
                time.sleep(s.spacing)
            for rank in trainers:
                rank.send(cmd="publish", version=version, mib=s.mib, dtype=s.dtype)
            want = publisher.wait("digest", 120, version=version)["digest"]
            start = min(rank.wait("published", 120, version=version)["start"]
                        for rank in trainers)
            arrived = [sub.wait("staged", s.timeout, version=version) for sub in subscribers]
            bad = [a for a in arrived if a["digest"] != want]
            if bad:
                raise AssertionError(f"version {version}: {len(bad)} hosts got wrong bytes")
            times.append(max(a["t"] for a in arrived) - start)
            spreads.append(sorted(round(a["t"] - start, 2) for a in arrived))
            sent = 0.0  # every rank's uplink, in versions
            for rank in trainers:
                rank.send(cmd="stats")
                stats = rank.wait("stats", 60)["stats"]
                sent += stats["bytes_sent_full"] + stats.get("bytes_sent_stream", 0)
            trainer_versions.append((sent - sent_before) / (s.mib << 20))
            sent_before = sent
            if s.diag and s.mode == "peers":
                diag.append(_peer_figures(subscribers))
        peers = None
        if s.mode == "peers":
            statuses = []
            for sub in subscribers:
                sub.send(cmd="status")
                statuses.append(sub.wait("status", 60)["status"]["peers"])
            peers = {"from_peers_fraction": round(
                sum(p["bytes_from_peers"] for p in statuses)
                / max(1, s.rounds * s.hosts * (s.mib << 20)), 3),
                "peer_failures": sum(sum(p["peer_failures"].values()) for p in statuses)}
        for node in nodes + subscribers:
            node.send(cmd="exit")
    steady = times[1:] or times
    return {"hosts": s.hosts, "mode": s.mode, "mib": s.mib, "seconds": times,
            "trainer_ranks": s.trainer_ranks,
            "median_s": statistics.median(times), "first_s": times[0],
            "steady_s": statistics.median(steady),
            "trainer_versions_sent": [round(v, 2) for v in trainer_versions],
            "peers": peers, **({"arrivals": spreads, "diag": diag} if s.diag else {})}


def _start_ranks(net: Network, first: Host, s: Scenario) -> list[Node]:
    """The sharded trainer: rank 0 on ``first`` (also the coordinator: subscribers dial
    ``PORT + 1``, ranks submit to ``PORT + 2``), every other rank on a host of its own."""
    rank0 = Node.start(first, "shard_rank", {
        "bind": f"tcp://{first.address}:{PORT}", "rank": 0, "world": s.trainer_ranks,
        "announce": f"tcp://{first.address}:{PORT + 1}",
        "coordinator": f"tcp://{first.address}:{PORT + 2}", "chunk_mib": s.chunk_mib,
        "peer_fanout": s.fanout}, s.torch_threads, s.forked_nodes)
    ranks = [rank0]
    for rank in range(1, s.trainer_ranks):
        host = net.add_host(s.link)
        ranks.append(Node.start(host, "shard_rank", {
            "bind": f"tcp://{host.address}:{PORT}", "rank": rank, "world": s.trainer_ranks,
            "coordinator": f"tcp://{first.address}:{PORT + 2}", "chunk_mib": s.chunk_mib},
            s.torch_threads, s.forked_nodes))
    for node in ranks[1:]:
        node.wait("ready", 120)
    return ranks


def _wait_for_plan(subscribers: list[Node], timeout: float) -> None:
    """Until every subscriber holds a slot of the same plan (the tracker's epoch), at most
    ``timeout`` seconds: then the first version goes out anyway, as it would in a
    deployment (this was a fixed 2.5 s sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        plans = []
        for sub in subscribers:
            sub.send(cmd="status")
            plans.append(sub.wait("status", 60)["status"]["peers"] or {})
        if all(p.get("slot") is not None for p in plans) \
                and len({p.get("plan_epoch") for p in plans}) == 1:
            return
        time.sleep(0.05)


def _peer_figures(subscribers: list[Node]) -> list[dict[str, Any]]:
    """What each host's peering did so far (cumulative): served, failures, upload budget."""
    keys = ("slot", "bytes_from_peers", "served_chunks", "peer_failures", "upload_bytes",
            "upload_cpu_share_now", "upload_effective_rate", "unavailable_replies")
    out = []
    for sub in subscribers:
        sub.send(cmd="status")
        peers = sub.wait("status", 60)["status"]["peers"]
        out.append({k: peers.get(k) for k in keys})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--modes", nargs="+", default=["direct", "relay", "peers"],
                    choices=MODES)
    ap.add_argument("--mib", type=int, default=48, help="version size")
    ap.add_argument("--chunk-mib", type=int, default=1,
                    help="the trainer's chunk size (0: the publisher's default)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch threads in every node (0: torch's default)")
    ap.add_argument("--publisher-root", action="store_true",
                    help="the trainer in the machine's own namespace (behind its own link)")
    ap.add_argument("--spacing", type=float, default=0.0,
                    help="seconds between the last host's arrival and the next publish()")
    ap.add_argument("--consumer", choices=("callback", "wait"), default="callback",
                    help="subscribers take versions in on_version, or wait_for_version "
                         "on a thread of their own, then release()")
    ap.add_argument("--dtype", choices=("uint8", "bf16"), default="uint8")
    ap.add_argument("--diag", action="store_true",
                    help="record each host's arrival and peer figures per version")
    ap.add_argument("--fanout", type=int, default=4, help="peers: stripes per version")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trainer-ranks", type=int, nargs="+", default=[1],
                    help="trainer ranks, each on a host of its own (> 1: ShardedPublisher)")
    ap.add_argument("--mbit", type=float, default=400.0, help="every link, each direction")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--stream", action="store_true",
                    help="the trainer serves its stream port, subscribers take it (and peers "
                         "forward over theirs); one trainer rank, relays' downstream stays frames")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--prefix", default="wpsim",
                    help="this run's namespace prefix (a random tag follows it)")
    ap.add_argument("--reap", nargs="?", const="wpsim", metavar="PREFIX",
                    help="remove the namespaces (and processes) of killed runs whose "
                         "names start with PREFIX (default wpsim: every run's; give a "
                         "run's --prefix to leave parallel runs alone)")
    args = ap.parse_args()
    if args.reap is not None:
        print("removed:", Network.reap(args.reap))
        return 0
    ok, why = available()
    if not ok:
        print(f"fleet simulator skipped: {why}", file=sys.stderr)
        return 2
    if args.stream and max(args.trainer_ranks) > 1:
        ap.error("--stream runs with one trainer rank (--trainer-ranks 1)")
    link = Link(up_mbit=args.mbit, down_mbit=args.mbit, delay_ms=args.delay_ms)
    line_rate_s = args.mib * (1 << 20) * 8 / (args.mbit * 1e6)
    results = []
    for hosts, mode, ranks in itertools.product(args.hosts, args.modes, args.trainer_ranks):
        result = run_scenario(Scenario(
            hosts, mode, args.mib, args.rounds, link, chunk_mib=args.chunk_mib,
            fanout=args.fanout, torch_threads=args.torch_threads,
            publisher_root=args.publisher_root, spacing=args.spacing,
            consumer=args.consumer, dtype=args.dtype, diag=args.diag,
            trainer_ranks=ranks, prefix=args.prefix, stream=args.stream))
        results.append(result)
        if not args.json:
            print(f"{mode:>8} {hosts:>3} hosts, {ranks} trainer ranks: first "
                  f"{result['first_s']:.2f} s, steady {result['steady_s']:.2f} s "
                  f"({result['steady_s'] / line_rate_s:.2f}x one transfer at line rate), "
                  f"rounds {[round(t, 2) for t in result['seconds']]}, trainer sent "
                  f"{result['trainer_versions_sent']} versions"
                  + (f", {result['peers']}" if result["peers"] else ""), flush=True)
    one, fewest = min(args.hosts), min(args.trainer_ranks)
    for r in results:  # sharded: the same fleet and mode from the fewest trainer ranks
        same = next(b for b in results if (b["hosts"], b["mode"], b["trainer_ranks"])
                    == (r["hosts"], r["mode"], fewest))
        r["vs_fewest_ranks"] = round(r["steady_s"] / same["steady_s"], 3)
    base = {r["mode"]: r for r in results if r["hosts"] == one and r["trainer_ranks"] == fewest}
    direct_one = base.get("direct")
    for r in results:  # first version vs first version, steady state vs steady state
        r["vs_one_host_first"] = round(r["first_s"] / base[r["mode"]]["first_s"], 3)
        r["vs_one_host"] = round(r["steady_s"] / base[r["mode"]]["steady_s"], 3)
        if direct_one:
            r["vs_one_host_direct"] = round(r["steady_s"] / direct_one["steady_s"], 3)
    summary = {"line_rate_transfer_s": round(line_rate_s, 3), "results": results,
               "target": "16 hosts <= 1.5x 1 host (peer sharing, steady state)"}
    if not args.json:
        for r in results:
            print(f"{r['mode']:>8} {r['hosts']:>3} hosts, {r['trainer_ranks']} ranks / "
                  f"{fewest} ranks: steady {r['vs_fewest_ranks']:.2f}x; / {one} host "
                  "(same mode): first "
                  f"{r['vs_one_host_first']:.2f}x, steady {r['vs_one_host']:.2f}x"
                  + (f"; steady / {one} host direct: {r['vs_one_host_direct']:.2f}x"
                     if direct_one else ""))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
