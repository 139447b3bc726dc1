"""One-frame chunk replies vs the old two-frame form, on loopback TCP, one run.

``two``: ``[msgpack header][payload]``, the payload sent zero-copy out of the
source buffer and received with ``recv_into`` straight into place (protocol 2).
``one``: ``[32-byte header + payload]`` in one frame (protocol 3,
``weightpub_wire.chunk_frame``): the sender copies the payload behind the header
in a reused scratch buffer (released when ZeroMQ reports it sent), the receiver
takes the frame without a copy (``recv(copy=False)``) and places the payload.
The sender (a ROUTER) runs in a child process, the receiver (a DEALER) here;
the sender pushes every chunk as fast as ZeroMQ takes it. Prints GB/s of each
form (median of the rounds) and the ratio one/two; rounds alternate the order.

    python benchmarks/chunk_frames.py                    # 512 MiB of 4 MiB chunks, 3 rounds
    python benchmarks/chunk_frames.py --mib 128 --rounds 1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import msgspec
import zmq

from weightpub_wire import chunk_frame


class _OldHeader(msgspec.Struct):
    """Protocol 2's msgpack chunk header (the first of its two frames)."""

    t: str
    p: int
    req: int
    version: int
    chunk: int
    size: int


def _serve(mode: str, port: int, chunk: int, count: int) -> None:
    """The sender, in its own process (as a publisher is)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    source = memoryview(bytearray(b"\x5a" * (64 << 20)))
    scratch = chunk_frame.ScratchPool()
    pending: list[tuple[zmq.MessageTracker, bytearray]] = []
    identity = router.recv_multipart()[0]  # "go"
    router.send_multipart([identity, b"ready"])  # the clock starts here
    for index in range(count):
        data = source[(index * chunk) % len(source):][:chunk]
        router.send(identity, zmq.SNDMORE)
        if mode == "two":
            header = msgspec.msgpack.encode({"t": "chunk", "p": 2, "req": 1, "version": 1,
                                             "chunk": index, "size": len(data)})
            router.send(header, zmq.SNDMORE)
            router.send(data, copy=False)
            continue
        buffer = scratch.take(chunk_frame.frame_bytes(len(data)))
        frame = chunk_frame.pack(buffer, req=1, version=1, chunk=index, payload=data)
        pending.append((router.send(frame, copy=False, track=True), buffer))
        while pending and pending[0][0].done:
            scratch.give(pending.pop(0)[1])
    router.recv_multipart()  # "done": every frame has arrived
    router.close(linger=0)
    ctx.term()


def run(mode: str, mib: int, chunk: int) -> float:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    count = (mib << 20) // chunk
    server = mp.get_context("spawn").Process(target=_serve, args=(mode, port, chunk, count))
    server.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    target = memoryview(bytearray(mib << 20))
    dealer.send(b"go")
    dealer.recv()  # "ready": the sender's process is up
    started = time.perf_counter()
    for index in range(count):
        place = target[index * chunk: (index + 1) * chunk]
        if mode == "two":
            msgspec.msgpack.decode(dealer.recv(copy=False).buffer, type=_OldHeader)
            dealer.recv_into(place)
        else:
            frame = dealer.recv(copy=False)
            header = chunk_frame.parse(frame.buffer)
            place[:] = frame.buffer[chunk_frame.HEADER_BYTES:][: header.size]
    elapsed = time.perf_counter() - started
    dealer.send(b"done")
    server.join(30)
    dealer.close(linger=0)
    ctx.term()
    return (mib << 20) / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"two": [], "one": []}
    for round_ in range(args.rounds):
        for mode in ("two", "one") if round_ % 2 == 0 else ("one", "two"):
            rates[mode].append(run(mode, args.mib, args.chunk_mib << 20))
    two, one = statistics.median(rates["two"]), statistics.median(rates["one"])
    print(f"two frames (zero-copy send, recv_into): {two:.2f} GB/s  {rates['two']}")
    print(f"one frame  (scratch copy, placed):      {one:.2f} GB/s  {rates['one']}")
    print(f"ratio one/two: {one / two:.2f}")


if __name__ == "__main__":
    main()
