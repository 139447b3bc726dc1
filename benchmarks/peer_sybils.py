"""What stalling peers (sybils) cost a version: 8 members that never serve, vs none.

Issue 28 item 6. Two publishers in this process, each with one honest
``peer_share=True`` subscriber process. Publisher ``sybils`` also has 8 stalling
members (subscriber processes whose peer server reads every request and answers
none: ``tests/transport/peer_procs.py``, ``stall``), joined first, so every chain
of the honest member's plan is made of them; publisher ``clean`` has none. Rounds
alternate: a version on ``sybils``, then one on ``clean``; the time is the honest
member's ``fetch_seconds`` for that version (the wall time between versions is
longer: each publish copies and hashes the version). The ratio is sybils / clean in the
same run (median and total). The stallers download nothing (a staging budget of
one page refuses every version; ``--stallers-fetch`` lets them, which on this
machine's 2 cores mostly measures 9x the serving work). The tracker's per-address bound is off for
``sybils`` (everything is on 127.0.0.1; with the default of 4 only 4 stallers
would get in).

    python benchmarks/peer_sybils.py              # 8 stallers, 16 MiB versions, 8 rounds
    python benchmarks/peer_sybils.py --rounds 3   # shorter
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from publisher import WeightPublisher  # noqa: E402
from publisher.serving.server import ServerLimits, TrackerLimits  # noqa: E402

# the test suite's child processes and join helper (imported by name: mypy checks the
# benchmark, not the tests)
_procs: Any = importlib.import_module("tests.transport.procs")
_peers: Any = importlib.import_module("tests.transport.test_peers")
Child, det_weights = _procs.Child, _procs.det_weights
join, peers_status, staged_ok = _peers.join, _peers.peers_status, _peers.staged_ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stallers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--mib", type=int, default=16, help="version size")
    parser.add_argument("--chunk-kib", type=int, default=1024)
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between versions")
    parser.add_argument("--stallers-fetch", action="store_true",
                        help="let the stallers download every version too (8x the "
                             "publisher's work on this machine's cores)")
    args = parser.parse_args()
    spec: list[Any] = [("w", "float32", [args.mib * 256, 1024])]
    children: list[Any] = []

    def spawn(role: str, **kwargs: Any) -> Any:
        child = Child(role, kwargs, forked=True)
        children.append(child)
        return child

    limits = ServerLimits(tracker=TrackerLimits(fanout=4, max_members_per_address=0))
    pubs = {name: WeightPublisher("tcp://127.0.0.1:0", chunk_size=args.chunk_kib << 10,
                                  heartbeat_interval=0.2, limits=limits)
            for name in ("sybils", "clean")}
    # a sybil need not download anything: a staging budget of one page refuses every
    # version, so the publisher and the cores serve the honest member only, as in ``clean``
    stalling: dict[str, Any] = {"stall": True} if args.stallers_fetch else \
        {"stall": True, "peer": {"staging_budget_bytes": 4096}}
    try:
        n = args.stallers + 1
        sybil_side = join(spawn, pubs["sybils"], n, spec,
                          lambda i: stalling if i < args.stallers else {},
                          timeout=5.0)
        honest = {"sybils": sybil_side[-1],
                  "clean": join(spawn, pubs["clean"], 1, spec, timeout=5.0)[0]}
        plan = peers_status(honest["sybils"])["peers"]
        print(f"honest member: slot {plan['slot']} of {n}, sources {len(plan['sources'])} "
              f"(all stalling), stripes {plan['stripes']}")
        times: dict[str, list[float]] = {"sybils": [], "clean": []}
        for version in range(1, args.rounds + 1):
            for name in ("sybils", "clean"):
                pubs[name].publish(det_weights(77, version, spec), version=version)
                event = staged_ok(honest[name], version, timeout=120)
                times[name].append(event["fetch_seconds"])
                time.sleep(args.gap)
            seen = peers_status(honest["sybils"])["peers"]
            print(f"version {version}: sybils {times['sybils'][-1]:.2f} s, "
                  f"clean {times['clean'][-1]:.2f} s (plan {seen['plan_epoch']}, "
                  f"{len(seen['sources'])} sources, stalls so far "
                  f"{seen['peer_failures'].get('timeout', 0)}, backed off "
                  f"{len(seen.get('backed_off', ()))})")
        stats = peers_status(honest["sybils"])["peers"]
        med = statistics.median(times["sybils"]) / statistics.median(times["clean"])
        total = sum(times["sybils"]) / sum(times["clean"])
        print(f"peer failures {stats['peer_failures']}, stall timeout "
              f"{stats.get('stall_timeout')}, backed off {len(stats.get('backed_off', []))}")
        print(f"ratio sybils/clean: median {med:.2f}x, total {total:.2f}x "
              f"(first version {times['sybils'][0] / times['clean'][0]:.2f}x; "
              f"target <= 2x)")
    finally:
        for child in children:
            child.ask_to_exit()
        for child in children:
            child.close(timeout=10)
        for pub in pubs.values():
            pub.close()


if __name__ == "__main__":
    main()
