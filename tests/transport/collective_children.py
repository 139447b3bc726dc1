"""Child processes of the collective-path tests: a trainer and node subscribers, over gloo.

Forked from the fault suite's forkserver (torch and the packages preloaded), they
talk to the test over a pipe. A ``kill_at`` point makes the child SIGKILL itself
at an exact place in the real code (a real ``kill -9``, mid-broadcast):

- trainer ``bucket:<n>``: about to broadcast the n-th bucket of a data round
  (counting from the first round's first bucket);
- member ``bucket:<n>``: just after receiving the n-th bucket;
- member ``corrupt:<n>``: not a kill: flips one byte of the n-th received bucket
  (the round must fail its checksum and the version come over ZeroMQ instead).

A member reports every staged version: its data path, and whether its bytes are
exactly what the trainer of that instance derived (``det_weights``).
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing.connection
import os
import queue
import signal
import time
from typing import Any

import msgspec

from tests.transport.faults.children import mp_context
from tests.transport.procs import det_weights, digests

__all__ = ["Child", "member_child", "trainer_child"]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # never reached


def _count_buckets(cls: Any, kill_at: str | None, *, after: bool) -> None:
    """Patch ``cls._bucket`` to die (or corrupt) at bucket ``n`` of the data rounds."""
    if not kill_at:
        return
    point, _, arg = kill_at.partition(":")
    target, seen = int(arg), {"n": 0}
    original = cls._bucket

    def bucket(self: Any, *args: Any) -> None:
        seen["n"] += 1
        if point == "bucket" and not after and seen["n"] >= target:
            _die()
        original(self, *args)
        if seen["n"] == target and point == "bucket" and after:
            _die()
        if seen["n"] == target and point == "corrupt":
            assembly, start = args[1], args[2]
            if assembly is not None:
                assembly.buffer[start] ^= 0xFF

    cls._bucket = bucket


def _logging(role: str) -> None:
    if os.environ.get("WEIGHTPUB_TEST_LOG"):  # debugging a case: the children's logs
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s {role} %(threadName)s %(message)s")


def trainer_child(conn: multiprocessing.connection.Connection, args: dict[str, Any]) -> None:
    """("publish", version, spec) -> ("published", version); ("group",) -> ("group", status)."""
    faulthandler.dump_traceback_later(60, exit=True)
    _logging("trainer")
    from publisher import WeightPublisher
    from publisher.collective import CollectivePublisher

    _count_buckets(CollectivePublisher, args.get("kill_at"), after=False)
    pub = WeightPublisher(args["endpoint"], chunk_size=args.get("chunk_size", 64 << 10),
                          heartbeat_interval=0.2, collective="gloo",
                          collective_bucket_bytes=args.get("bucket_bytes", 128 << 10),
                          collective_timeout=args.get("timeout", 5.0))
    conn.send(("ready", pub.endpoint, pub.publisher_id, os.getpid()))
    faulthandler.cancel_dump_traceback_later()
    while conn.poll(600):
        command = conn.recv()
        if command[0] == "exit":
            break
        if command[0] == "publish":
            _, version, spec = command
            started = time.monotonic()
            pub.publish(det_weights(args["seed"], version, spec), version=version)
            conn.send(("published", version, time.monotonic() - started))
        elif command[0] == "group":
            conn.send(("group", msgspec.to_builtins(pub.collective_status())))
        elif command[0] == "fleet":
            conn.send(("fleet", [msgspec.to_builtins(r) for r in pub.fleet()]))
    pub.close()


def member_child(conn: multiprocessing.connection.Connection, args: dict[str, Any]) -> None:
    """Sends ("staged", publisher_id, version, data_path, exact) per staged version."""
    faulthandler.dump_traceback_later(60, exit=True)
    _logging(args["name"])
    from subscriber_ext import WeightSubscriber
    from subscriber_ext.transport.collective_receiver import CollectiveReceiver

    _count_buckets(CollectiveReceiver, args.get("kill_at"), after=True)
    seeds: dict[str, int] = {}
    staged_q: queue.Queue[Any] = queue.Queue()
    sub = WeightSubscriber(args["endpoint"], collective=True, on_version=staged_q.put,
                           subscriber_id=args["name"], report_interval=0.2,
                           request_timeout=2.0)
    conn.send(("ready", sub.subscriber_id, os.getpid()))
    faulthandler.cancel_dump_traceback_later()
    def commands() -> bool:
        while conn.poll(0):
            command = conn.recv()
            if command[0] == "exit":
                return False
            if command[0] == "seed":  # the seed each publisher instance derives its bytes from
                seeds[command[1]] = command[2]
            elif command[0] == "status":
                conn.send(("status", sub.status()))
        return True

    while commands():
        try:
            staged = staged_q.get(timeout=0.05)
        except queue.Empty:
            continue
        if not commands():  # a seed sent before this version's publish is known now
            break
        seed = seeds.get(staged.publisher_id)
        spec = args["specs"].get(str(staged.version))
        exact = seed is not None and spec is not None and \
            digests(staged.items()) == digests(det_weights(seed, staged.version, spec).items())
        sub.mark_applied(staged.version)
        conn.send(("staged", staged.publisher_id, staged.version, staged.data_path, exact))
        staged.release()
    sub.close()


class Child:
    """A forked trainer or member; every wait is bounded."""

    def __init__(self, role: str, **args: Any) -> None:
        ctx = mp_context()
        self._conn, child_conn = ctx.Pipe()
        target = {"trainer": trainer_child, "member": member_child}[role]
        self.process = ctx.Process(target=target, args=(child_conn, args), daemon=True)
        self.process.start()
        child_conn.close()
        self.inbox: list[tuple[Any, ...]] = []
        ready = self.expect("ready", 60)
        self.endpoint = ready[1] if role == "trainer" else ""
        self.name = ready[2] if role == "trainer" else ready[1]
        self.pid = ready[-1]

    def _pump(self, wait: float) -> None:
        try:
            if self._conn.poll(wait):
                self.inbox.append(tuple(self._conn.recv()))
        except (EOFError, OSError):
            time.sleep(wait)

    def expect(self, what: str, timeout: float, match: Any = None) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while True:
            for message in self.inbox:
                if message[0] == what and (match is None or match(message)):
                    self.inbox.remove(message)
                    return message
            if time.monotonic() >= deadline:
                raise AssertionError(f"child {self.process.pid}: no {what!r} within {timeout}s "
                                     f"(alive {self.process.is_alive()}; inbox {self.inbox[-4:]})")
            self._pump(0.05)

    def call(self, *command: Any, timeout: float = 60.0) -> tuple[Any, ...]:
        self._conn.send(command)
        return self.expect(command[0] if command[0] != "publish" else "published", timeout)

    def staged(self, version: int, timeout: float) -> tuple[Any, ...]:
        return self.expect("staged", timeout, lambda m: m[2] == version)

    def kill9(self) -> None:
        self.process.kill()
        self.process.join(10)

    def wait_killed(self, timeout: float = 30.0) -> None:
        self.process.join(timeout)
        assert self.process.exitcode == -9, f"exitcode {self.process.exitcode}"

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit",))
            except OSError:
                pass
            self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self._conn.close()
