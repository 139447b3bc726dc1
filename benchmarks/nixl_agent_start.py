"""What a member's NIXL agent start costs its loop (``client/nixl_agent_start.py``).

A publisher process (``nixl=True``, ``peer_fanout`` 1) and a fresh member process per
round (``peer_share``, the ``nixl`` option "auto" or "on"; UCX's first agent in a
process costs ~0.5 s, so each round is a new process): the member waits 1 s in its
slot, the publisher publishes version 1, and a DEALER asks the member ``peer_nixl``
for it every 5 ms until it offers it. Printed per round: the longest gap between two
turns of the member's loop (``SyncClient.tick``) from the publish to the version's
staging, the longest ``peer_nixl`` round trip meanwhile, when the first offer came
(the option "on" only: auto does not share over NIXL), and how long the agent took.

    UCX_NET_DEVICES=lo python benchmarks/nixl_agent_start.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any


def publisher() -> None:
    """The publisher's process: its endpoint and id on stdout, then publish at a line."""
    import torch

    from publisher import WeightPublisher

    pub = WeightPublisher("tcp://127.0.0.1:0", nixl=True, peer_fanout=1,
                          chunk_size=256 << 10, heartbeat_interval=0.2)
    print("endpoint", pub.endpoint, pub.publisher_id, flush=True)
    seeded = torch.Generator().manual_seed(5)
    weights = {"w": torch.randn(1024, 1024, generator=seeded),
               "b": torch.randint(0, 1 << 30, (10_000,), dtype=torch.int32, generator=seeded)}
    sys.stdin.readline()
    pub.publish(weights, version=1)
    sys.stdin.readline()
    pub.close()


def member(mode: str) -> dict[str, Any]:
    """One round in this (fresh) process."""
    import msgspec
    import zmq

    from subscriber_ext import WeightSubscriber
    from subscriber_ext.transport.client.sync_client import SyncClient
    from weightpub_wire import protocol as wire
    from weightpub_wire.peer_protocol import PeerNixl, PeerNixlOffer

    turns: list[float] = []
    tick = SyncClient.tick

    def counted(self: SyncClient, now: float) -> float:
        turns.append(time.monotonic())
        return tick(self, now)

    SyncClient.tick = counted  # type: ignore[method-assign]
    proc = subprocess.Popen([sys.executable, __file__, "--publisher"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    line = proc.stdout.readline()
    while not line.startswith("endpoint "):
        line = proc.stdout.readline()
    _, endpoint, publisher_id = line.split()
    sub = WeightSubscriber(endpoint, peer_share=True, nixl={"auto": None, "on": True}[mode],
                           subscriber_id="m0", request_timeout=10.0)
    while sub.status()["peers"]["slot"] != 0:
        time.sleep(0.02)
    time.sleep(1.0)
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(sub.status()["peers"]["endpoint"])
    start = time.monotonic()
    proc.stdin.write("publish\n")
    proc.stdin.flush()
    trips: list[float] = []
    offered: float | None = None
    req = 0
    while offered is None and time.monotonic() - start < 10 and (
            mode == "on" or sub.latest() is None):
        req += 1
        sent = time.monotonic()
        dealer.send(wire.encode(PeerNixl(req=req, publisher_id=publisher_id, version=1)))
        if dealer.poll(5000):
            reply = msgspec.msgpack.decode(dealer.recv(), type=PeerNixlOffer)
            trips.append(time.monotonic() - sent)
            if reply.offer is not None:
                offered = time.monotonic() - start
        time.sleep(0.005)
    staged = sub.wait_for_version(1, timeout=30)
    path = staged.data_path
    staged.release()
    end = time.monotonic()
    window = [t for t in turns if start <= t <= end]
    result = {"mode": mode, "loop_longest_gap_s": round(max(
                  b - a for a, b in zip(window, window[1:], strict=False)), 3),
              "peer_nixl_longest_trip_s": round(max(trips), 4),
              "first_offer_s": None if offered is None else round(offered, 3),
              "data_path": path, "agent_start_s": sub.status()["nixl"]["agent_start_s"]}
    dealer.close(0)
    sub.close()
    proc.kill()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--publisher", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--member", choices=("auto", "on"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if args.publisher:
        publisher()
    elif args.member:
        print(json.dumps(member(args.member)), flush=True)
        os._exit(0)  # the agent's threads need not wind down
    else:
        for _ in range(args.rounds):
            for mode in ("auto", "on"):
                out = subprocess.run([sys.executable, __file__, "--member", mode],
                                     capture_output=True, text=True, timeout=120, check=True)
                print([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
        print("load average:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
