"""Tools of the fault-matrix tests: RSS and fd counts from /proc, raw peers, a log counter."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import msgpack
import zmq

from weightpub_wire import protocol as wire

__all__ = ["LineCounter", "RawPeer", "fds", "pack", "rss_mib", "threads_named"]


def rss_mib(pid: int | None = None) -> float:
    """Resident set size of a process (this one by default), from /proc, in MiB."""
    status = Path(f"/proc/{pid or os.getpid()}/status").read_text()
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc status")


def fds(pid: int | None = None) -> int:
    """Open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid or os.getpid()}/fd"))


def threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def pack(body: dict[str, Any]) -> bytes:
    """A wire frame built by an independent encoder (msgpack), for hand-made hostile input."""
    return msgpack.packb({"p": wire.PROTOCOL_VERSION, **body}, use_bin_type=True)


class RawPeer:
    """A bare DEALER talking to a publisher's ROUTER; optional CURVE keys; bounded waits."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, server_key: bytes | None = None,
                 keypair: tuple[bytes, bytes] | None = None, rcvhwm: int | None = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
            self.sock.setsockopt(zmq.RCVBUF, 4096)
        if server_key is not None:
            public, secret = keypair or zmq.curve_keypair()
            self.sock.curve_serverkey = server_key
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
        self.sock.connect(endpoint)

    def send(self, message: wire.Message | bytes) -> None:
        body = message if isinstance(message, bytes) else wire.encode(message)
        self.sock.send(body)

    def recv(self, timeout: float = 10.0) -> list[bytes]:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no reply within {timeout}s")
        return self.sock.recv_multipart()

    def call(self, message: wire.Message, timeout: float = 10.0) -> wire.Message:
        self.send(message)
        return wire.decode(self.recv(timeout)[0])

    def close(self) -> None:
        self.sock.close(linger=0)


class LineCounter(logging.Handler):
    """Counts log lines of the ``weightpub`` loggers (to prove floods are rate-limited)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines = 0
        self.warnings: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("weightpub"):
            self.lines += 1
            if record.levelno >= logging.WARNING and len(self.warnings) < 10_000:
                self.warnings.append(record.getMessage())

    def __enter__(self) -> LineCounter:
        root = logging.getLogger("weightpub")
        self._level = root.level
        root.setLevel(logging.INFO)
        root.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger("weightpub")
        root.removeHandler(self)
        root.setLevel(self._level)
