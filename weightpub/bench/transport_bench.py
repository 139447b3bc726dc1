"""Transport vs a raw TCP socket moving the same bytes across processes, in one run.

Each pair of paths runs interleaved (raw, weightpub, raw, ...) so both see the
same machine state:

* ``raw``: ``sendall`` of the source buffer -> ``recv_into`` a buffer allocated
  once in another process (not touched beforehand: its first round pays the
  same first-touch page faults a fresh staging buffer does);
* ``tcp`` / ``ipc``: ``publish()`` -> ``wait_for_version()`` returning in another
  process (snapshot copy, hashing, transfer, verification all count).

The first round is the *cold* one (fresh buffers on every side); the steady
state is the median of the rounds from the fourth on, when every buffer on both
sides is reused (the publisher copies each version over its one snapshot from
round 2 on, ``keep_versions`` = 1; it took a fresh one up to round 3 before).
``transfer_seconds`` is the subscriber's manifest -> staged time,
the figure the replica's ``weightpub_transfer_seconds`` histogram records.

CPU (``cpu_probe.py``): every round measures the CPU-seconds each side spent
(``/proc/<pid>/stat``: all threads, ZeroMQ's I/O threads included), reported per GB
moved: the publisher (this process, which only publishes and serves during its round),
the subscriber process, and the raw sender and receiver for scale. The subscriber also
says how its CPU splits over its threads and, sampled every 2 ms, which Python lines
its threads were on (``profile``): where the CPU goes beyond the kernel's copies.
``faults_per_GB`` counts each side's page faults per GB (steady median, cold first
round; not for ``peer``): first touch of fresh buffers, and heap memory glibc gave back
and ZeroMQ's receive buffers then take anew.

* ``peer``: peer forwarding. Two ``peer_share`` subscriber processes and a publisher
  with ``peer_fanout`` 1: the first (the *forwarder*) fetches from the publisher, the
  second fetches every chunk from the forwarder (cut-through). A round is publish ->
  both staged; ``cpu_s_per_GB`` adds ``forwarder`` (the forwarder's whole process),
  ``forwarding`` (what serving cost it: the peer ROUTER's ZeroMQ I/O thread plus the
  serving work on its subscriber thread, ``UploadBudget.cpu_seconds``, per GB it
  served) and ``peer_receiver`` (the subscriber that receives from a peer); the
  forwarder's profile is ``forwarder_profile``. Serving has no CPU-share bound here
  (``upload_cpu_share``, default 0.25 cores, would pace it); ``from_peers_fraction``
  says how much of the version came through the forwarder (a peer that stalls
  under load is skipped for a while and the publisher serves instead).
* ``peer_stream``: the same with ``stream=True`` on both members: the forwarder serves on
  its stream port (``docs/peer-stream.md``); ``benchmarks/peer_stream.py`` runs it
  interleaved with ``peer`` (and with CURVE) for same-run ratios.
* ``stream``: the plain-TCP stream path (``stream=True`` on both sides, issue 29),
  interleaved three ways in one run: raw, ZeroMQ frames (``tcp``) and the stream, so
  ``ratio`` (stream vs raw), ``frames_ratio`` (frames vs raw) and ``stream_vs_frames``
  are same-run ratios; ``frames_cpu_s_per_GB`` is the frames path's CPU beside the
  stream's ``cpu_s_per_GB``; ``data_paths`` says how each round's version came (a
  "stream+zmq" or "zmq" there means the stream fell back).
* ``slices``: a sliced subscriber (issue 30) over the stream vs over ZeroMQ slice frames,
  interleaved with raw TCP moving the plan's bytes, as ``stream`` is. The version is
  rows of ``SLICE_ROW`` bytes and the plan takes the first half of each (rank 0 of a
  TP=2 column split of bf16 rows, hidden 2048: pieces of 2 KiB, the short pieces that
  land in the stream's scratch and are scattered from there; ``benchmarks/stream_slices.py``
  measures the same on Qwen-shaped tensors and other plans). Every figure of the row is
  per GB of the plan's bytes (``bytes``; ``version_bytes`` is the whole version's): GB/s
  publish -> staged, CPU-s/GB on each side for the stream (``cpu_s_per_GB``) and frames
  (``frames_cpu_s_per_GB``); ``data_paths`` "stream" each round when nothing fell back.
  Not in ``--quick``'s schemes (it would lengthen the smoke run; ``--schemes slices``).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weightpub.bench.cpu_probe import StackSampler, process_cpu, process_faults, thread_cpu
from weightpub.bench.forked import forkserver
from weightpub_wire.buffers import byte_view
from weightpub_wire.slice_plan import SlicePlan, decode_plan, encode_plan, from_ranges

__all__ = ["SLICE_ROW", "cols_plan", "run_transport"]

STEADY_FROM = 3  # 0-based round from which every buffer on both sides is reused
#: the receivers are forked from a zygote that imported these once (an interpreter
#: importing torch costs seconds of CPU on a loaded 2-core machine, per child)
PRELOAD = ("torch", "zmq", "publisher", "subscriber_ext", __name__)
#: the ``slices`` row's version is rows of this many bytes; the plan takes half of each
SLICE_ROW = 4096


def cols_plan(nbytes: int, row: int = SLICE_ROW) -> SlicePlan:
    """The first half of every ``row``-byte row of a flat ``nbytes`` tensor "w"."""
    half = row // 2
    return from_ranges(f"bench-cols/{row}", {"w": [(start, start + half)
                                                  for start in range(0, nbytes, row)]})


def _raw_receiver(port: int, nbytes: int, rounds: int, conn: Any) -> None:
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)  # fresh, untouched memory
    view = byte_view(buf)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            got = 0
            cpu, faults = process_cpu(), process_faults()
            while got < nbytes:
                n = sock.recv_into(view[got:], nbytes - got)
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
            conn.send((got, process_cpu() - cpu, process_faults() - faults))


def _wp_receiver(endpoint: str, rounds: int, conn: Any, stream: bool = False,
                 plan: bytes | None = None) -> None:
    from subscriber_ext import WeightSubscriber

    with WeightSubscriber(endpoint, stream=stream,
                          slice_plan=None if plan is None else decode_plan(plan)) as sub, \
            StackSampler() as sampler:
        conn.send("ready")
        threads_before = thread_cpu()
        for version in range(1, rounds + 1):
            cpu, faults = process_cpu(), process_faults()
            staged = sub.wait_for_version(version, timeout=300)
            # manifest seen -> all chunks verified; this process's CPU over the round
            conn.send((staged.fetch_seconds, process_cpu() - cpu, process_faults() - faults,
                       staged.data_path))
            staged.release()
        threads = thread_cpu()
        conn.send({"threads": {name: round(seconds - threads_before.get(name, 0.0), 3)
                               for name, seconds in threads.items()
                               if seconds - threads_before.get(name, 0.0) >= 0.01},
                   "python": sampler.top()})


def _peer_member(endpoint: str, name: str, conn: Any, stream: bool = False,
                 curve: dict[str, Any] | None = None, slice_plan: Any = None) -> None:
    """One ``peer_share`` subscriber: tells its slot, each staged version, and on ``cpu``
    its process CPU and the serving CPU and bytes so far; on ``exit`` its profile.
    ``stream``: peers over the stream (both serving and asking); ``curve``: its CURVE
    keyword arguments (the publisher's key, its own secret); ``slice_plan``: a sliced
    member of that plan (None: whole versions)."""
    from subscriber_ext import SyncOptions, WeightSubscriber

    staged_q: queue.Queue[Any] = queue.Queue()
    # no CPU-share bound on serving (default 0.25 cores): the bench measures what
    # forwarding costs, not the policy that paces it
    with WeightSubscriber(endpoint, peer_share=True, subscriber_id=name, upload_cpu_share=64,
                          on_version=staged_q.put, options=SyncOptions(stream=stream),
                          **(curve or {}),
                          **({} if slice_plan is None else {"slice_plan": slice_plan})
                          ) as sub, StackSampler() as sampler:
        deadline = time.monotonic() + 60
        while (sub.status()["peers"] or {}).get("slot") is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: no place in the peer plan within 60s")
            time.sleep(0.05)
        conn.send(("ready", sub.status()["peers"]["slot"]))
        threads_before = thread_cpu()
        budget = sub._client.peering.budget  # type: ignore[union-attr]  # a bench reads it
        while True:
            if conn.poll(0.005):
                command = conn.recv()
                if command == "cpu":
                    conn.send(("cpu", process_cpu(), budget.cpu_seconds, budget.bytes_sent,
                               (sub.status()["peers"] or {}).get("bytes_from_peers", 0)))
                elif command == "exit":
                    break
            try:
                staged = staged_q.get_nowait()
            except queue.Empty:
                continue
            conn.send(("staged", staged.version, staged.fetch_seconds))
            staged.release()
        threads = thread_cpu()
        peers = sub.status()["peers"] or {}
        conn.send(("profile", {
            "peers": {key: peers.get(key) for key in (
                "peer_failures", "served_chunks", "dropped_clients", "cut_clients",
                "bytes_from_peers", "upload_bytes", "stream_bytes_from_peers",
                "stream_fallback_causes", "stream_served")},
            "threads": {name: round(seconds - threads_before.get(name, 0.0), 3)
                        for name, seconds in threads.items()
                        if seconds - threads_before.get(name, 0.0) >= 0.01},
            "python": sampler.top()}))


class _PeerPath:
    """publish() -> staged at a forwarder and at a subscriber fed by the forwarder."""

    def __init__(self, source: torch.Tensor, endpoint: str, stream: bool = False,
                 curve_dir: str | None = None, slice_plan: Any = None) -> None:
        """``stream``: members forward over their stream ports (peers over the stream);
        ``curve_dir``: CURVE on every hop, keys made there; ``slice_plan``: both members
        sliced with that plan (of ``{"w": source}``)."""
        from publisher import WeightPublisher

        self.weights = {"w": source}
        keys: dict[str, Any] = {}
        curves: list[dict[str, Any] | None] = [None, None]
        if curve_dir is not None:
            from weightpub_wire.keys import create_key_pair

            allowed = Path(curve_dir) / "allowed"
            allowed.mkdir(parents=True, exist_ok=True)
            public, secret = map(str, create_key_pair(curve_dir, "server"))
            keys = {"curve_secret_key_file": secret,
                    "curve_allowed_clients_dir": str(allowed)}
            curves = [{"curve_server_key_file": public, "curve_secret_key_file":
                       str(create_key_pair(allowed, f"member{i}")[1])} for i in range(2)]
        self.pub = WeightPublisher(endpoint, peer_fanout=1, **keys)
        self.members: list[tuple[Any, Any]] = []
        self.version = 0
        for index in range(2):  # joined one by one: member i holds slot i
            conn, child = mp.Pipe()
            proc = forkserver(PRELOAD).Process(
                target=_peer_member, args=(self.pub.endpoint, f"bench-peer{index}", child,
                                           stream, curves[index], slice_plan),
                daemon=True)
            proc.start()
            slot = self._recv(conn, "ready", 120)
            if slot != index:
                raise RuntimeError(f"peer member {index} got slot {slot}")
            self.members.append((conn, proc))
        time.sleep(2.0)  # every member follows the final plan (hello interval ~1 s)

    @staticmethod
    def _recv(conn: Any, kind: str, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise TimeoutError(f"a peer member sent no {kind} within {timeout:.0f}s")
        message = conn.recv()
        if message[0] != kind:
            raise RuntimeError(f"a peer member sent {message[0]} where {kind} was due")
        return message[1:] if len(message) > 2 else message[1]

    def _cpu(self) -> list[Any]:
        for conn, _ in self.members:
            conn.send("cpu")
        return [self._recv(conn, "cpu", 60) for conn, _ in self.members]

    def round(self) -> dict[str, float]:
        before = self._cpu()
        start = time.perf_counter()
        cpu = process_cpu()
        self.version += 1
        self.pub.publish(self.weights)
        fetch = [self._recv(conn, "staged", 300)[1] for conn, _ in self.members]
        took = time.perf_counter() - start
        publisher_cpu = process_cpu() - cpu
        after = self._cpu()
        self.weights["w"][:8] += 1
        forwarder, receiver = ([a - b for a, b in zip(x, y, strict=True)]
                               for x, y in zip(after, before, strict=True))
        nbytes = self.weights["w"].numel()
        return {"seconds": took, "publish_seconds": 0.0, "transfer_seconds": max(fetch),
                "publisher_cpu": publisher_cpu, "subscriber_cpu": receiver[0],
                "forwarder_cpu": forwarder[0], "serving_cpu": forwarder[1],
                "served_bytes": forwarder[2], "from_peers_fraction": receiver[3] / nbytes}

    def close(self) -> dict[str, Any]:
        profiles: list[Any] = []
        for conn, proc in self.members:
            conn.send("exit")
            try:
                profiles.append(self._recv(conn, "profile", 60))
            except (TimeoutError, RuntimeError, EOFError):
                profiles.append({})
            proc.join(60)
        self.pub.close()
        return {"forwarder": profiles[0], "receiver": profiles[1]}


class _RawPath:
    def __init__(self, source: torch.Tensor, rounds: int) -> None:
        self.view = byte_view(source)
        server = socket.create_server(("127.0.0.1", 0))
        self.conn, child = mp.Pipe()
        self.proc = forkserver(PRELOAD).Process(
            target=_raw_receiver, args=(server.getsockname()[1], len(self.view), rounds, child),
            daemon=True)
        self.proc.start()
        server.settimeout(120)
        self.sock, _ = server.accept()
        server.close()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round(self) -> dict[str, float]:
        start = time.perf_counter()
        cpu = process_cpu()
        self.sock.sendall(self.view)
        sender_cpu = process_cpu() - cpu
        if not self.conn.poll(300):
            raise TimeoutError("raw receiver did not answer")
        _, receiver_cpu, receiver_faults = self.conn.recv()
        return {"seconds": time.perf_counter() - start, "sender_cpu": sender_cpu,
                "receiver_cpu": receiver_cpu, "receiver_faults": receiver_faults}

    def close(self) -> None:
        self.sock.close()
        self.proc.join(30)


class _WeightpubPath:
    def __init__(self, source: torch.Tensor, rounds: int, endpoint: str,
                 stream: bool = False, plan: SlicePlan | None = None) -> None:
        """``plan``: the subscriber stages only these slices (``stream``: over the stream)."""
        from publisher import WeightPublisher

        # its own weights dict: paths sharing ``source`` each publish their own versions
        self.weights = {"w": source}
        self.pub = WeightPublisher(endpoint, stream=stream)
        self.conn, child = mp.Pipe()
        self.proc = forkserver(PRELOAD).Process(
            target=_wp_receiver, args=(self.pub.endpoint, rounds, child, stream,
                                       None if plan is None else encode_plan(plan)),
            daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise TimeoutError("subscriber process did not start")
        self.conn.recv()

    def round(self) -> dict[str, float]:
        start = time.perf_counter()
        cpu, faults = process_cpu(), process_faults()
        self.pub.publish(self.weights)
        published = time.perf_counter() - start
        if not self.conn.poll(300):
            raise TimeoutError("subscriber did not stage the version")
        transfer, subscriber_cpu, subscriber_faults, data_path = self.conn.recv()
        took = time.perf_counter() - start
        publisher_cpu, publisher_faults = process_cpu() - cpu, process_faults() - faults
        self.weights["w"][:8] += 1  # a different version each round
        return {"seconds": took, "publish_seconds": published, "transfer_seconds": transfer,
                "publisher_cpu": publisher_cpu, "subscriber_cpu": subscriber_cpu,
                "publisher_faults": publisher_faults, "subscriber_faults": subscriber_faults,
                "data_path": data_path}

    def close(self) -> dict[str, Any]:
        """The subscriber's CPU breakdown over all rounds (threads, Python lines)."""
        profile: dict[str, Any] = {}
        if self.conn.poll(60):
            profile = self.conn.recv()
        self.proc.join(60)
        self.pub.close()
        return profile


def _pairs(source: torch.Tensor, rounds: int, scheme: str, tick: Callable[[], None],
           ipc_dir: str, frames_too: bool = False) -> list[dict[str, Any]]:
    """``scheme``'s figures against raw TCP from one interleaved run; ``stream`` and
    ``slices`` run a frames path in the same rounds (``frames_too``: the stream's figures
    also as the ``tcp`` pair, which then needs no run of its own)."""
    endpoint = "tcp://127.0.0.1:0" if scheme != "ipc" else f"ipc://{ipc_dir}/bench-{rounds}"
    plan = cols_plan(source.numel()) if scheme == "slices" else None
    moved = source.numel() if plan is None else plan.needed_bytes  # what the subscriber pulls
    raw_path = _RawPath(source[:moved], rounds)
    streams = scheme in ("stream", "slices")
    wp_path: _WeightpubPath | _PeerPath = \
        _PeerPath(source, endpoint, stream=scheme == "peer_stream") \
        if scheme in ("peer", "peer_stream") \
        else _WeightpubPath(source, rounds, endpoint, stream=streams, plan=plan)
    # the stream's same-run baseline over ZeroMQ frames (the same source, its own versions)
    frames_path = _WeightpubPath(source, rounds, endpoint, plan=plan) if streams else None
    paths: list[Any] = [p for p in (raw_path, wp_path, frames_path) if p is not None]
    by_path: dict[int, list[dict[str, Any]]] = {id(path): [] for path in paths}
    profile: dict[str, Any] = {}
    frames_profile: dict[str, Any] = {}
    try:
        for rnd in range(rounds):
            shift = rnd % len(paths)  # each path first in turn: the same machine state
            for path in paths[shift:] + paths[:shift]:
                by_path[id(path)].append(path.round())
                tick()
    finally:
        raw_path.close()
        profile = wp_path.close()
        if frames_path is not None:
            frames_profile = frames_path.close()
    raw, wp = by_path[id(raw_path)], by_path[id(wp_path)]
    frames = None if frames_path is None else by_path[id(frames_path)]
    out = [_figures(scheme, moved, rounds, raw, wp, profile, frames)]
    if plan is not None:
        out[0].update(version_bytes=source.numel(), row_bytes=SLICE_ROW,
                      piece_bytes=SLICE_ROW // 2)
    if frames is not None and frames_too and scheme == "stream":
        out.insert(0, _figures("tcp", source.numel(), rounds, raw, frames, frames_profile))
    return out


def _figures(scheme: str, nbytes: int, rounds: int, raw: list[dict[str, Any]],
             wp: list[dict[str, Any]], profile: dict[str, Any],
             frames: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One pair's figures from its rounds (``frames``: the stream's frames baseline)."""
    steady = slice(STEADY_FROM, None) if rounds > STEADY_FROM else slice(rounds - 1, None)

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs[steady])

    def per_gb(runs: list[dict[str, float]], key: str) -> float:
        return round(med(runs, key) / (nbytes / 1e9), 3)

    raw_s, wp_s = med(raw, "seconds"), med(wp, "seconds")
    cpu: dict[str, float | None] = {
        "publisher": per_gb(wp, "publisher_cpu"), "subscriber": per_gb(wp, "subscriber_cpu"),
        "raw_sender": per_gb(raw, "sender_cpu"), "raw_receiver": per_gb(raw, "receiver_cpu")}
    faults: dict[str, dict[str, int]] = {}
    for runs, side, key in ((wp, "publisher", "publisher_faults"),
                            (wp, "subscriber", "subscriber_faults"),
                            (raw, "raw_receiver", "receiver_faults")):
        if key in runs[0]:
            faults[side] = {"steady": round(med(runs, key) / (nbytes / 1e9)),
                            "cold": round(runs[0][key] / (nbytes / 1e9))}
    extra: dict[str, Any] = {}
    if scheme in ("peer", "peer_stream"):  # the subscriber is the one fed by the forwarder
        # serving CPU over the bytes served, steady rounds together (a round in which the
        # receiver skipped the forwarder served nothing and adds nothing)
        served = sum(r["served_bytes"] for r in wp[steady])
        cpu.update(peer_receiver=cpu["subscriber"], forwarder=per_gb(wp, "forwarder_cpu"),
                   forwarding=round(sum(r["serving_cpu"] for r in wp[steady]) / (served / 1e9),
                                    3) if served else None)
        extra = {"from_peers_fraction": med(wp, "from_peers_fraction"),
                 "from_peers_rounds": [round(r["from_peers_fraction"], 3) for r in wp],
                 "forwarder_profile": profile.get("forwarder", {})}
        profile = profile.get("receiver", {})
    if frames is not None:
        frames_s = med(frames, "seconds")
        extra = {"frames_GBps": nbytes / frames_s / 1e9, "frames_ratio": raw_s / frames_s,
                 "stream_vs_frames": frames_s / wp_s,
                 "stream_vs_frames_rounds": [f["seconds"] / w["seconds"]
                                             for f, w in zip(frames, wp, strict=True)],
                 "frames_seconds": [f["seconds"] for f in frames],
                 "frames_cpu_s_per_GB": {"publisher": per_gb(frames, "publisher_cpu"),
                                         "subscriber": per_gb(frames, "subscriber_cpu")},
                 "data_paths": [w["data_path"] for w in wp]}
    return {
        "scheme": scheme,
        "bytes": nbytes,
        "raw_GBps": nbytes / raw_s / 1e9,
        "weightpub_GBps": nbytes / wp_s / 1e9,
        "ratio": raw_s / wp_s,
        "ratio_rounds": [r["seconds"] / w["seconds"] for r, w in zip(raw, wp, strict=True)],
        "cold_ratio": raw[0]["seconds"] / wp[0]["seconds"],
        "transfer_ratio": raw_s / med(wp, "transfer_seconds"),
        "publish_seconds": med(wp, "publish_seconds"),
        "transfer_seconds": med(wp, "transfer_seconds"),
        "raw_seconds": [r["seconds"] for r in raw],
        "weightpub_seconds": [w["seconds"] for w in wp],
        # CPU-seconds per GB moved, steady rounds (medians), each side's whole process
        "cpu_s_per_GB": cpu,
        # page faults per GB moved, steady rounds (medians) and the cold first round
        "faults_per_GB": faults,
        "subscriber_profile": profile,
        **extra,
    }


def run_transport(sizes_mib: list[int], rounds: int, schemes: list[str],
                  tick: Callable[[], None]) -> dict[str, Any]:
    """Every (size, scheme) pair; ``tick`` is called once per timed round."""
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="weightpub-bench-") as ipc_dir:
        for mib in sizes_mib:
            source = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8)
            # with ``stream`` asked, the tcp pair's frames run in the stream's rounds
            merged = "stream" in schemes and "tcp" in schemes
            for scheme in schemes:
                if not (merged and scheme == "tcp"):
                    results += [{"mib": mib, **pair} for pair in _pairs(
                        source, rounds, scheme, tick, ipc_dir, frames_too=merged)]
            del source
    return {"rounds": rounds, "steady_from_round": STEADY_FROM + 1, "pairs": results,
            "targets": {"ratio": 0.8, "cold_ratio": 0.6}}
