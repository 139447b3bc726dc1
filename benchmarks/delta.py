"""Delta versions vs full versions for RL-like steps: bytes on the wire, time, CPU, one run.

A bf16 model (``--mib``, default 256 MiB: 32 matrices of 2048 x 2048) is trained
with fp32 master weights and ``torch.optim.AdamW`` at a small learning rate
(``--lr``, default 1e-6) on random gradients; each step publishes the bf16 cast,
as a mixed-precision RL trainer does. Two publishers in this process get every
step: ``full`` (``delta_anchor_every=1``) and ``delta`` (``delta_anchor_every=64``,
so version 1 is the only anchor). Each has one subscriber process, connected
through a byte-counting TCP relay in this process (the ROUTER connection: every
chunk of the data path, measured from outside weightpub; ``--mbit`` caps the
relay's rate to model a slower link). Rounds are interleaved (rotating order);
each round: ``publish()`` -> the subscriber has the version staged (complete,
verified); bytes the relay forwarded toward the subscriber in that round; the
publisher's delta encoding CPU seconds and the subscriber's decode CPU seconds.
Every staged version is checked bit-exact against the published bytes.

    python benchmarks/delta.py                      # 256 MiB, 6 rounds (~2 min)
    python benchmarks/delta.py --mib 64 --rounds 3  # quick smoke run
    python benchmarks/delta.py --mbit 1000          # through a 1 Gbit/s link
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import threading
import time
from typing import Any

import orjson
import torch
import xxhash

from weightpub_wire.buffers import byte_view, flat_bytes

MODES = ("full", "delta")


class CountingRelay:
    """TCP forwarder 127.0.0.1:port -> upstream, counting the bytes sent back downstream."""

    def __init__(self, upstream: tuple[str, int], mbit: float = 0.0) -> None:
        self.upstream = upstream
        self.rate = mbit * 1e6 / 8  # bytes per second, 0 = unlimited
        self.down_bytes = 0
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.upstream)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        buf = memoryview(bytearray(1 << 20))
        start, sent = time.monotonic(), 0
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                dst.sendall(buf[:n])
                if counted:
                    with self._lock:
                        self.down_bytes += n
                    if self.rate:  # token bucket: never ahead of the link rate
                        sent += n
                        ahead = sent / self.rate - (time.monotonic() - start)
                        if ahead > 0:
                            time.sleep(ahead)
                        elif ahead < -0.05:
                            start, sent = time.monotonic(), 0
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                sock.close()


def _subscriber(endpoint: str, versions: int, conn: Any) -> None:
    from subscriber_ext import WeightSubscriber

    with WeightSubscriber(endpoint, window_bytes=64 << 20) as sub:
        conn.send("ready")
        for version in range(1, versions + 1):
            staged = sub.wait_for_version(version, timeout=600)
            at = time.time()
            state = xxhash.xxh3_64()
            for tensor in staged.tensors.values():
                state.update(byte_view(flat_bytes(tensor)))
            digest = state.hexdigest()
            status = sub.status()
            conn.send((at, digest, status["delta_decode_cpu_seconds"],
                       status["bytes_received_full"] + status["bytes_received_delta"]))
            staged.release()


def make_model(mib: int) -> list[torch.nn.Parameter]:
    n = max(1, (mib << 20) // (2048 * 2048 * 2))
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(2048, 2048, generator=gen) * 0.02) for _ in range(n)]


def bf16_weights(params: list[torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": p.detach().to(torch.bfloat16) for i, p in enumerate(params)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bf16 model size, MiB")
    parser.add_argument("--rounds", type=int, default=6, help="timed steps")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    parser.add_argument("--mbit", type=float, default=0.0, help="relay rate cap (0: none)")
    args = parser.parse_args()
    from publisher import WeightPublisher

    torch.set_num_threads(2)
    params = make_model(args.mib)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    versions = args.rounds + 1
    pubs = {mode: WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=1.0,
                                  delta_anchor_every=64 if mode == "delta" else 1)
            for mode in MODES}
    relays, conns, procs = {}, {}, []
    ctx = mp.get_context("spawn")
    for mode, pub in pubs.items():
        port = int(pub.endpoint.rsplit(":", 1)[1])
        relays[mode] = CountingRelay(("127.0.0.1", port), args.mbit)
        conns[mode], child = mp.Pipe()
        proc = ctx.Process(target=_subscriber, daemon=True,
                           args=(f"tcp://127.0.0.1:{relays[mode].port}", versions, child))
        proc.start()
        procs.append(proc)
    for conn in conns.values():
        conn.recv()

    weights = bf16_weights(params)
    total = sum(t.numel() * 2 for t in weights.values())
    print(f"{total / 2**20:.0f} MiB bf16 ({len(weights)} tensors), AdamW lr {args.lr}, "
          f"{args.rounds} steps after version 1; relay cap "
          f"{f'{args.mbit:.0f} Mbit/s' if args.mbit else 'none'}", flush=True)
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    last_decode = dict.fromkeys(MODES, 0.0)
    for version in range(1, versions + 1):
        changed = 0.0
        if version > 1:
            previous = weights
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            weights = bf16_weights(params)
            changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum())
                          for a, b in zip(previous.values(), weights.values(), strict=True))
            changed /= total / 2
        want = xxhash.xxh3_64()
        for t in weights.values():
            want.update(byte_view(flat_bytes(t)))
        order = MODES if version % 2 else MODES[::-1]
        line = []
        for mode in order:
            before = relays[mode].down_bytes
            start = time.time()
            pubs[mode].publish(weights, version=version)
            at, digest, decode_s, _ = conns[mode].recv()
            wire = relays[mode].down_bytes - before
            assert digest == want.hexdigest(), f"{mode} version {version} is not bit-exact"
            row = {"seconds": at - start, "wire_bytes": wire,
                   "decode_cpu_s": decode_s - last_decode[mode], "changed": changed}
            last_decode[mode] = decode_s
            if version > 1:
                rows[mode].append(row)
            line.append(f"{mode}={row['seconds']:.3f}s/{wire / 2**20:.1f}MiB")
        tag = "anchor" if version == 1 else f"step {version - 1} ({100 * changed:.2f}% changed)"
        print(f"  {tag:>24}  " + "  ".join(line), flush=True)
    for proc in procs:
        proc.join(60)
    stats = pubs["delta"].data_stats()
    for pub in pubs.values():
        pub.close()
    med = {m: {k: statistics.median(r[k] for r in rows[m]) for k in rows[m][0]} for m in MODES}
    med["delta"]["encode_cpu_s"] = stats["delta_encode_cpu_seconds"] / max(
        1, stats["delta_versions_encoded"])  # mean per step
    bytes_ratio = med["delta"]["wire_bytes"] / med["full"]["wire_bytes"]
    time_ratio = med["delta"]["seconds"] / med["full"]["seconds"]
    print(f"\n{'':<8}{'publish->staged s':>18}{'wire MiB':>10}{'encode CPU s':>14}"
          f"{'decode CPU s':>14}")
    for m in MODES:
        print(f"{m:<8}{med[m]['seconds']:>18.3f}{med[m]['wire_bytes'] / 2**20:>10.2f}"
              f"{med[m].get('encode_cpu_s', 0.0):>14.3f}{med[m]['decode_cpu_s']:>14.3f}")
    print(f"changed bf16 elements per step (median): {100 * med['delta']['changed']:.2f}%")
    print(f"bytes delta/full {bytes_ratio:.4f}x (target <= 0.1x: "
          f"{'met' if bytes_ratio <= 0.1 else 'NOT met'}); time delta/full {time_ratio:.2f}x")
    print(orjson.dumps({"mib": args.mib, "lr": args.lr, "mbit": args.mbit,
                        "bytes_ratio": bytes_ratio, "time_ratio": time_ratio,
                        "median": med}).decode())


if __name__ == "__main__":
    main()
