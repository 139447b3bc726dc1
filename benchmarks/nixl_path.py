"""NIXL one-sided reads vs a raw TCP socket, same run: GB/s and CPU-seconds per GB, both sides.

Issue 31.5. Three paths move the same buffer between two processes, rounds
interleaved (path order rotates each round), every process kept across rounds:

* ``tcp``: ``sendall`` -> ``recv_into`` (the baseline every ratio is against);
* ``nixl-cma``: a NIXL READ with UCX's default same-host transports (CMA:
  ``process_vm_readv``, one copy, no network stack);
* ``nixl-tcp``: a NIXL READ with ``UCX_TLS=tcp,self`` (READ emulated over TCP: what
  a host without RDMA gets across hosts).

End to end through weightpub, publish -> staged (``publish()`` called -> the
subscriber's ``on_version``), a publisher process and a subscriber process each:

* ``e2e-nixl``: ``WeightPublisher(nixl=True)``, the subscriber READs every chunk
  one-sided into staging and verifies it in place (``data_path`` "nixl");
* ``e2e-zmq``: the same publisher and ``nixl=False`` on the subscriber: ZeroMQ frames.

Both include the publisher's snapshot copy and hashing (the same work on both); the
CPU-seconds per GB of each side are its whole process over the round.

The same for a sharded trainer (``--ranks N`` rank processes, each a
``ShardedPublisher`` with ``nixl=True`` holding 1/N of the bytes, rank 0 with the
coordinator), publish on every rank -> staged:

* ``e2e-shard-nixl``: the subscriber READs each rank's range from that rank's agent;
* ``e2e-shard-zmq``: the same ranks, ``nixl=False`` on the subscriber: frames from
  each rank. Their "holder" CPU is every rank's together.

Behind a relay (``--subscribers N`` subscriber processes, default 2): a publisher
process (frames to the relay), a store-and-forward relay process (``weightpub.relay``,
``nixl=True`` downstream: it registers its pool buffers and offers its copy), and N
subscribers of the relay:

* ``e2e-relay-nixl``: the subscribers READ the relay's copy one-sided;
* ``e2e-relay-zmq``: the same relay, ``nixl=False`` on the subscribers: frames.

Their "holder" is the relay: ``relay_cpu_s_per_GB`` is its CPU from its announcement
to the last subscriber staged, over the bytes delivered downstream (N copies);
``leg_GBps`` the bytes delivered over that time (the upstream leg and the relay's copy
and hashes are the same work on both paths and are left out).

The reader's destination is allocated once (its first round pays the page faults
a fresh staging buffer does); the steady state is the median from round 3 on.
CPU-seconds per GB are user+system time of each side's whole process (NIXL's
progress thread included) over the bytes moved. ZeroMQ frames through weightpub
are measured against the same raw TCP by ``weightpub bench --sections transport``.
UCX is confined to loopback (``UCX_NET_DEVICES=lo``).

    python benchmarks/nixl_path.py                 # 256 MiB and 1 GiB, 5 rounds
    python benchmarks/nixl_path.py --mib 64 --rounds 3
    python benchmarks/nixl_path.py --paths tcp e2e-nixl e2e-zmq --mib 256
    python benchmarks/nixl_path.py --paths tcp e2e-shard-nixl e2e-shard-zmq --ranks 4
    python benchmarks/nixl_path.py --paths e2e-relay-nixl e2e-relay-zmq --mib 128
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STEADY_FROM = 2


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _holder(nbytes: int) -> None:
    from weightpub_wire.nixl_link import NixlExporter, encode_offer

    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    holder = NixlExporter("bench-holder")
    offer = holder.offer([holder.register(data.ctypes.data, data.nbytes)])
    print("OFFER", encode_offer(offer).hex(), flush=True)
    sys.stdin.readline()
    holder.close()


def _nixl_reader(nbytes: int, offer_hex: str) -> None:
    from weightpub_wire.nixl_link import NixlReader, decode_offer

    offer = decode_offer(bytes.fromhex(offer_hex))
    dest = np.empty(nbytes, dtype=np.uint8)  # fresh, untouched, as staging would be
    reader = NixlReader("bench-reader")
    reader.register(dest.ctypes.data, dest.nbytes)
    print("READY", flush=True)
    for _ in sys.stdin:
        cpu, start = _cpu_self(), time.perf_counter()
        reader.read(offer, [(0, 0, dest.ctypes.data, nbytes)], timeout=600)
        print("DONE", time.perf_counter() - start, _cpu_self() - cpu, flush=True)
    reader.close()


def _tcp_sender(nbytes: int, port: int) -> None:
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = data.data  # the buffer itself, no copy
        while sock.recv(1):
            sock.sendall(view)


def _tcp_receiver(nbytes: int, port: int) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    print("READY", flush=True)
    sock, _ = listener.accept()
    dest = np.empty(nbytes, dtype=np.uint8)
    view = dest.data
    for _ in sys.stdin:
        cpu, start = _cpu_self(), time.perf_counter()
        sock.sendall(b"g")
        got = 0
        while got < nbytes:
            got += sock.recv_into(view[got:], nbytes - got)
        print("DONE", time.perf_counter() - start, _cpu_self() - cpu, flush=True)


def _e2e_publisher(nbytes: int, nixl: bool) -> None:
    import torch

    from publisher import WeightPublisher

    torch.set_num_threads(1)
    weights = {"w": torch.randint(0, 255, (nbytes,), dtype=torch.uint8)}
    pub = WeightPublisher("tcp://127.0.0.1:0", nixl=nixl)
    print("OFFER", pub.endpoint, flush=True)
    for _ in sys.stdin:
        start = time.time()
        version = pub.publish(weights)
        pub.wait_announced(version, timeout=600)
        print("PUBLISHED", start, time.time(), flush=True)
    pub.close()


def _e2e_rank(nbytes: int, rank: int, world: int, coordinator: str) -> None:
    import torch

    from publisher.sharded_publisher import ShardedPublisher

    torch.set_num_threads(1)
    weights = {f"w{rank}": torch.randint(0, 255, (nbytes,), dtype=torch.uint8)}
    announce = "tcp://127.0.0.1:0" if rank == 0 else None
    pub = ShardedPublisher("tcp://127.0.0.1:0", rank=rank, world_size=world,
                           coordinator=coordinator, announce_endpoint=announce, nixl=True)
    coord = pub.coordinator
    print("OFFER", coord.endpoint if coord else "-", coord.collect_endpoint if coord else "-",
          flush=True)
    version = 0
    for _ in sys.stdin:
        version += 1
        start = time.time()
        pub.publish(weights, version=version)
        pub.wait_submitted(version, timeout=600)
        print("PUBLISHED", start, time.time(), flush=True)
    pub.close()


def _e2e_subscriber(endpoint: str, nixl: bool) -> None:
    import queue

    from subscriber_ext import WeightSubscriber

    staged: queue.Queue[tuple[int, float, str]] = queue.Queue()

    def on_version(version: Any) -> None:
        staged.put((version.version, time.time(), version.data_path))
        version.release()

    sub = WeightSubscriber(endpoint, nixl=nixl, on_version=on_version)
    print("READY", flush=True)
    ended = threading.Event()  # the driver went away (stdin closed): never linger

    def watch_stdin() -> None:
        sys.stdin.read()
        ended.set()

    threading.Thread(target=watch_stdin, daemon=True, name="bench-stdin").start()
    while not ended.is_set():
        try:
            number, when, path = staged.get(timeout=0.5)
        except queue.Empty:
            continue
        print("DONE", number, when, path, flush=True)
    sub.close()


class _E2E:
    """A publisher and a subscriber process, a version published per round."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(REPO),
               "OMP_NUM_THREADS": "1"}
        me = [sys.executable, __file__]
        nixl = "1" if name == "e2e-nixl" else "0"
        self.holder = _popen([*me, "--role", "e2e-pub", str(nbytes), nixl], env)
        endpoint = _expect(self.holder, "OFFER")[0]
        self.reader = _popen([*me, "--role", "e2e-sub", endpoint, nixl], env)
        _expect(self.reader, "READY")
        self.rounds: list[dict[str, float]] = []
        self.paths: list[str] = []

    def round(self, nbytes: int) -> None:
        holder_cpu, reader_cpu = _cpu_of(self.holder.pid), _cpu_of(self.reader.pid)
        assert self.holder.stdin is not None
        self.holder.stdin.write("go\n")
        self.holder.stdin.flush()
        start, announced = (float(x) for x in _expect(self.holder, "PUBLISHED"))
        _, end, path = _expect(self.reader, "DONE")
        self.paths.append(path)
        gb = nbytes / 1e9
        self.rounds.append({
            "seconds": float(end) - start,
            "announce_s": announced - start,  # publish() -> the manifest out (copy, hashes)
            "reader_cpu_s_per_gb": (_cpu_of(self.reader.pid) - reader_cpu) / gb,
            "holder_cpu_s_per_gb": (_cpu_of(self.holder.pid) - holder_cpu) / gb})

    def steady(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds[STEADY_FROM:] or self.rounds)

    def close(self) -> None:
        for proc in (self.reader, self.holder):
            if proc.stdin is not None:
                proc.stdin.close()  # both end on EOF
        for proc in (self.reader, self.holder):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=60)


def _e2e_relay(upstream: str, nixl: bool) -> None:
    from weightpub.deployment_config import RelayConfig
    from weightpub.relay import Relay

    relay = Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": upstream}, "cut_through": False,
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "nixl": nixl}}))
    print("OFFER", relay.endpoint, flush=True)
    ended = threading.Event()

    def announced() -> None:
        version = 0
        while not ended.is_set():
            version += 1
            while not ended.is_set():
                try:
                    relay.publisher.wait_announced(version, timeout=0.5)
                    break
                except Exception:  # not yet (or closing)
                    continue
            print("ANNOUNCED", version, time.time(), _cpu_self(), flush=True)

    threading.Thread(target=announced, daemon=True, name="bench-announced").start()
    sys.stdin.read()
    ended.set()
    relay.close()


class _E2ERelay:
    """A publisher, a relay and ``subscribers`` subscriber processes, a version per round."""

    def __init__(self, name: str, nbytes: int, subscribers: int) -> None:
        self.name = name
        env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(REPO),
               "OMP_NUM_THREADS": "1"}
        me = [sys.executable, __file__]
        self.holder = _popen([*me, "--role", "e2e-pub", str(nbytes), "0"], env)
        upstream = _expect(self.holder, "OFFER")[0]
        self.relay = _popen([*me, "--role", "e2e-relay", upstream, "1"], env)
        endpoint = _expect(self.relay, "OFFER")[0]
        nixl = "1" if name == "e2e-relay-nixl" else "0"
        self.readers = [_popen([*me, "--role", "e2e-sub", endpoint, nixl], env)
                        for _ in range(subscribers)]
        for reader in self.readers:
            _expect(reader, "READY")
        self.rounds: list[dict[str, float]] = []
        self.paths: list[str] = []

    def round(self, nbytes: int) -> None:
        readers_cpu = sum(_cpu_of(r.pid) for r in self.readers)
        relay_cpu = _cpu_of(self.relay.pid)
        assert self.holder.stdin is not None
        self.holder.stdin.write("go\n")
        self.holder.stdin.flush()
        start, _ = (float(x) for x in _expect(self.holder, "PUBLISHED"))
        _, when, cpu = _expect(self.relay, "ANNOUNCED")
        announced, relay_at_announce = float(when), float(cpu)  # the relay's own, then
        ends = []
        for reader in self.readers:
            _, end, path = _expect(reader, "DONE")
            ends.append(float(end))
            self.paths.append(path)
        relay_end = _cpu_of(self.relay.pid)
        delivered = nbytes * len(self.readers) / 1e9
        self.rounds.append({
            "seconds": max(ends) - start,
            "announce_s": announced - start,  # publish() -> the relay's manifest out
            "leg_s": max(ends) - announced,
            "relay_cpu_s_per_gb": (relay_end - relay_at_announce) / delivered,
            "relay_round_cpu_s_per_gb": (relay_end - relay_cpu) / (nbytes / 1e9),
            "reader_cpu_s_per_gb": (sum(_cpu_of(r.pid) for r in self.readers)
                                    - readers_cpu) / delivered,
            "holder_cpu_s_per_gb": (relay_end - relay_at_announce) / delivered})

    def steady(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds[STEADY_FROM:] or self.rounds)

    def close(self) -> None:
        _end_all([*self.readers, self.relay, self.holder])


class _E2EShard:
    """``ranks`` rank processes (a sharded trainer) and a subscriber, a version per round."""

    def __init__(self, name: str, nbytes: int, ranks: int) -> None:
        self.name = name
        env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(REPO),
               "OMP_NUM_THREADS": "1"}
        me = [sys.executable, __file__]
        share = str(nbytes // ranks)
        self.ranks = [_popen([*me, "--role", "e2e-rank", share, "0", str(ranks),
                              "tcp://127.0.0.1:0"], env)]
        announce, collect = _expect(self.ranks[0], "OFFER")
        for rank in range(1, ranks):
            self.ranks.append(_popen([*me, "--role", "e2e-rank", share, str(rank),
                                      str(ranks), collect], env))
            _expect(self.ranks[-1], "OFFER")
        nixl = "1" if name == "e2e-shard-nixl" else "0"
        self.reader = _popen([*me, "--role", "e2e-sub", announce, nixl], env)
        _expect(self.reader, "READY")
        self.rounds: list[dict[str, float]] = []
        self.paths: list[str] = []

    def round(self, nbytes: int) -> None:
        cpu = [_cpu_of(rank.pid) for rank in self.ranks]
        reader_cpu = _cpu_of(self.reader.pid)
        for rank in self.ranks:
            assert rank.stdin is not None
            rank.stdin.write("go\n")
            rank.stdin.flush()
        times = [[float(x) for x in _expect(rank, "PUBLISHED")] for rank in self.ranks]
        start = min(t[0] for t in times)
        _, end, path = _expect(self.reader, "DONE")
        self.paths.append(path)
        gb = nbytes / 1e9
        self.rounds.append({
            "seconds": float(end) - start,
            "announce_s": max(t[1] for t in times) - start,
            "reader_cpu_s_per_gb": (_cpu_of(self.reader.pid) - reader_cpu) / gb,
            "holder_cpu_s_per_gb": sum(_cpu_of(r.pid) - c
                                       for r, c in zip(self.ranks, cpu, strict=True)) / gb})

    def steady(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds[STEADY_FROM:] or self.rounds)

    def close(self) -> None:
        _end_all([self.reader, *reversed(self.ranks)])


class _Path:
    """One path's two processes, driven a round at a time over the reader's stdin."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(REPO)}
        if name == "nixl-tcp":
            env["UCX_TLS"] = "tcp,self"
        me = [sys.executable, __file__]
        if name == "tcp":
            port = _free_port()
            self.reader = _popen([*me, "--role", "tcp-recv", str(nbytes), str(port)], env)
            _expect(self.reader, "READY")
            self.holder = _popen([*me, "--role", "tcp-send", str(nbytes), str(port)], env)
        else:
            self.holder = _popen([*me, "--role", "holder", str(nbytes)], env)
            offer = _expect(self.holder, "OFFER")[0]
            self.reader = _popen([*me, "--role", "nixl-reader", str(nbytes), offer], env)
            _expect(self.reader, "READY")
        self.rounds: list[dict[str, float]] = []

    def round(self, nbytes: int) -> None:
        holder_cpu = _cpu_of(self.holder.pid)
        assert self.reader.stdin is not None
        self.reader.stdin.write("go\n")
        self.reader.stdin.flush()
        seconds, reader_cpu = (float(x) for x in _expect(self.reader, "DONE"))
        gb = nbytes / 1e9
        self.rounds.append({"seconds": seconds, "reader_cpu_s_per_gb": reader_cpu / gb,
                            "holder_cpu_s_per_gb": (_cpu_of(self.holder.pid) - holder_cpu) / gb})

    def steady(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds[STEADY_FROM:] or self.rounds)

    def close(self) -> None:
        for proc in (self.reader, self.holder):
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def _end_all(procs: list[subprocess.Popen[str]]) -> None:
    """Each child ends on EOF of its stdin; one that does not within 60 s is killed."""
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)


def _expect(proc: subprocess.Popen[str], tag: str) -> list[str]:
    assert proc.stdout is not None
    for line in proc.stdout:  # NIXL logs to stdout too
        if line.startswith(tag):
            return line.split()[1:]
    raise RuntimeError(f"child exited before {tag} (exit {proc.wait()})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(mib: int, rounds: int, names: list[str], ranks: int = 2,
            subscribers: int = 2) -> dict[str, Any]:
    nbytes = mib << 20
    paths: list[Any] = [_E2EShard(name, nbytes, ranks) if name.startswith("e2e-shard-")
                        else _E2ERelay(name, nbytes, subscribers)
                        if name.startswith("e2e-relay-")
                        else _E2E(name, nbytes) if name.startswith("e2e-")
                        else _Path(name, nbytes) for name in names]
    try:
        for r in range(rounds):
            for path in paths[r % len(paths):] + paths[:r % len(paths)]:
                path.round(nbytes)
        tcp = next((p for p in paths if p.name == "tcp"), None)
        base = None if tcp is None else tcp.steady("seconds")
        return {"mib": mib, **{p.name: {
            "GBps": round(nbytes / p.steady("seconds") / 1e9, 2),
            **({} if base is None else {"vs_tcp": round(base / p.steady("seconds"), 2)}),
            **({"leg_GBps": round(nbytes * subscribers / p.steady("leg_s") / 1e9, 2),
                "relay_cpu_s_per_GB": round(p.steady("relay_cpu_s_per_gb"), 3),
                "relay_round_cpu_s_per_GB": round(p.steady("relay_round_cpu_s_per_gb"), 3)}
               if isinstance(p, _E2ERelay) else {}),
            "reader_cpu_s_per_GB": round(p.steady("reader_cpu_s_per_gb"), 3),
            "holder_cpu_s_per_GB": round(p.steady("holder_cpu_s_per_gb"), 3),
            "cold_GBps": round(nbytes / p.rounds[0]["seconds"] / 1e9, 2),
            **({"data_paths": sorted(set(p.paths)),
                "announce_s": round(p.steady("announce_s"), 3)}
               if isinstance(p, _E2E | _E2EShard | _E2ERelay) else {})}
            for p in paths}}
    finally:
        for path in paths:
            try:
                path.close()
            except Exception as exc:  # a slow teardown must not leave the others running
                print(f"closing {path.name}: {exc}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--paths", nargs="+",
                        default=["tcp", "nixl-cma", "nixl-tcp", "e2e-nixl", "e2e-zmq"])
    parser.add_argument("--ranks", type=int, default=2,
                        help="rank processes of the e2e-shard-* paths")
    parser.add_argument("--subscribers", type=int, default=2,
                        help="subscriber processes behind the relay (e2e-relay-* paths)")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.role == "holder":
        return _holder(int(rest[0]))
    if args.role == "nixl-reader":
        return _nixl_reader(int(rest[0]), rest[1])
    if args.role == "tcp-send":
        return _tcp_sender(int(rest[0]), int(rest[1]))
    if args.role == "tcp-recv":
        return _tcp_receiver(int(rest[0]), int(rest[1]))
    if args.role == "e2e-pub":
        return _e2e_publisher(int(rest[0]), rest[1] == "1")
    if args.role == "e2e-rank":
        return _e2e_rank(int(rest[0]), int(rest[1]), int(rest[2]), rest[3])
    if args.role == "e2e-relay":
        return _e2e_relay(rest[0], rest[1] == "1")
    if args.role == "e2e-sub":
        return _e2e_subscriber(rest[0], rest[1] == "1")
    for mib in args.mib:
        print(measure(mib, args.rounds, args.paths, args.ranks, args.subscribers), flush=True)


if __name__ == "__main__":
    main()
