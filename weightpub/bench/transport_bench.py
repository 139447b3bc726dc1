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
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from weightpub_wire.buffers import byte_view

__all__ = ["run_transport"]

STEADY_FROM = 3  # 0-based round from which every buffer on both sides is reused


def _raw_receiver(port: int, nbytes: int, rounds: int, conn: Any) -> None:
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)  # fresh, untouched memory
    view = byte_view(buf)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            got = 0
            while got < nbytes:
                n = sock.recv_into(view[got:], nbytes - got)
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
            conn.send(got)


def _wp_receiver(endpoint: str, rounds: int, conn: Any) -> None:
    from subscriber_ext import WeightSubscriber

    with WeightSubscriber(endpoint) as sub:
        conn.send("ready")
        for version in range(1, rounds + 1):
            staged = sub.wait_for_version(version, timeout=300)
            conn.send(staged.fetch_seconds)  # manifest seen -> all chunks verified
            staged.release()


class _RawPath:
    def __init__(self, source: torch.Tensor, rounds: int) -> None:
        self.view = byte_view(source)
        server = socket.create_server(("127.0.0.1", 0))
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=_raw_receiver, args=(server.getsockname()[1], len(self.view), rounds, child),
            daemon=True)
        self.proc.start()
        server.settimeout(120)
        self.sock, _ = server.accept()
        server.close()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round(self) -> dict[str, float]:
        start = time.perf_counter()
        self.sock.sendall(self.view)
        if not self.conn.poll(300):
            raise TimeoutError("raw receiver did not answer")
        self.conn.recv()
        return {"seconds": time.perf_counter() - start}

    def close(self) -> None:
        self.sock.close()
        self.proc.join(30)


class _WeightpubPath:
    def __init__(self, source: torch.Tensor, rounds: int, endpoint: str) -> None:
        from publisher import WeightPublisher

        self.weights = {"w": source}
        self.pub = WeightPublisher(endpoint)
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=_wp_receiver, args=(self.pub.endpoint, rounds, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise TimeoutError("subscriber process did not start")
        self.conn.recv()

    def round(self) -> dict[str, float]:
        start = time.perf_counter()
        self.pub.publish(self.weights)
        published = time.perf_counter() - start
        if not self.conn.poll(300):
            raise TimeoutError("subscriber did not stage the version")
        transfer = self.conn.recv()
        took = time.perf_counter() - start
        self.weights["w"][:8] += 1  # a different version each round
        return {"seconds": took, "publish_seconds": published, "transfer_seconds": transfer}

    def close(self) -> None:
        self.proc.join(60)
        self.pub.close()


def _pair(source: torch.Tensor, rounds: int, scheme: str, tick: Callable[[], None],
          ipc_dir: str) -> dict[str, Any]:
    endpoint = "tcp://127.0.0.1:0" if scheme == "tcp" else f"ipc://{ipc_dir}/bench-{rounds}"
    raw_path = _RawPath(source, rounds)
    wp_path = _WeightpubPath(source, rounds, endpoint)
    raw: list[dict[str, float]] = []
    wp: list[dict[str, float]] = []
    try:
        for rnd in range(rounds):
            first, second = (raw_path, wp_path) if rnd % 2 == 0 else (wp_path, raw_path)
            for path in (first, second):
                (raw if path is raw_path else wp).append(path.round())
                tick()
    finally:
        raw_path.close()
        wp_path.close()
    nbytes = source.numel()
    steady = slice(STEADY_FROM, None) if rounds > STEADY_FROM else slice(rounds - 1, None)

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs[steady])

    raw_s, wp_s = med(raw, "seconds"), med(wp, "seconds")
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
    }


def run_transport(sizes_mib: list[int], rounds: int, schemes: list[str],
                  tick: Callable[[], None]) -> dict[str, Any]:
    """Every (size, scheme) pair; ``tick`` is called once per timed round."""
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="weightpub-bench-") as ipc_dir:
        for mib in sizes_mib:
            source = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8)
            for scheme in schemes:
                results.append({"mib": mib, **_pair(source, rounds, scheme, tick, ipc_dir)})
            del source
    return {"rounds": rounds, "steady_from_round": STEADY_FROM + 1, "pairs": results,
            "targets": {"ratio": 0.8, "cold_ratio": 0.6}}
