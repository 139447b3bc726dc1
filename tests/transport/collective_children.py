"""Child processes of the collective-path tests: a trainer and node subscribers, over gloo.

Forked from the fault suite's forkserver (torch and the packages preloaded), they
talk to the test over a pipe. A ``kill_at`` point makes the child SIGKILL itself
at an exact place in the real code (a real ``kill -9``, mid-broadcast):

- trainer ``die:<v>:<n>``: about to broadcast the n-th bucket of the round of
  version ``v`` (``v`` 0: the n-th bucket over all rounds);
- member ``die:<v>:<n>``: just after receiving that bucket;
- member ``corrupt:<v>:<n>``: not a kill: flips one byte of that received bucket
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
    """Patch ``cls._round`` / ``cls._bucket`` to act at bucket ``n`` of the round of ``version``.

    ``kill_at`` is ``die:<version>:<n>`` or ``corrupt:<version>:<n>`` (flip one byte of
    that received bucket); version 0 counts buckets over every round.
    """
    if not kill_at:
        return
    action, version_text, n_text = kill_at.split(":")
    wanted, target = int(version_text), int(n_text)
    seen = {"n": 0, "version": 0}
    original_round, original_bucket = cls._round, cls._bucket

    def round_(self: Any, *args: Any) -> None:
        seen["version"] = args[0].manifest.version if len(args) == 1 else args[1].version
        original_round(self, *args)

    def bucket(self: Any, *args: Any) -> None:
        counting = wanted in (0, seen["version"])
        seen["n"] += counting
        hit = counting and seen["n"] == target
        if hit and action == "die" and not after:
            _die()
        original_bucket(self, *args)
        if hit and action == "die" and after:
            _die()
        if hit and action == "corrupt" and args[1] is not None:
            args[1].buffer[args[2]] ^= 0xFF  # (group, assembly, start, size)

    cls._round, cls._bucket = round_, bucket


def _logging(role: str) -> None:
    if os.environ.get("WEIGHTPUB_TEST_LOG"):  # debugging a case: the children's logs
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s {role} %(threadName)s %(message)s")


def trainer_child(conn: multiprocessing.connection.Connection, args: dict[str, Any]) -> None:
    """("publish", version, spec) -> ("published", version); ("group",) -> ("group", status)."""
    faulthandler.dump_traceback_later(60, exit=True)
    _logging("trainer")
    from publisher import WeightPublisher
    from publisher.collective.collective_sender import CollectivePublisher

    _count_buckets(CollectivePublisher, args.get("kill_at"), after=False)
    pub = WeightPublisher(args["endpoint"], chunk_size=args.get("chunk_size", 64 << 10),
                          heartbeat_interval=0.2, collective="gloo", keep_versions=4,
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
        elif command[0] == "publish_hf":  # a real model's weights (the vLLM tests' oracle)
            from tests.vllm.helpers import new_weights

            _, version, kind, seed = command
            started = time.monotonic()
            pub.publish(new_weights(kind, seed), version=version)
            pub.wait_announced(version, timeout=30)
            conn.send(("published", version, time.monotonic() - started))
        elif command[0] == "group":
            conn.send(("group", msgspec.to_builtins(pub.collective_status())))
        elif command[0] == "fleet":
            conn.send(("fleet", [msgspec.to_builtins(r) for r in pub.fleet()]))
    pub.close()


def member_child(conn: multiprocessing.connection.Connection, args: dict[str, Any]) -> None:
    """Sends ("staged", publisher_id, version, data_path, exact, digests) per staged version
    (``exact``: the bytes are ``det_weights`` of the seed sent for that instance)."""
    faulthandler.dump_traceback_later(60, exit=True)
    _logging(args["name"])
    from subscriber_ext import WeightSubscriber
    from subscriber_ext.transport.collective.collective_receiver import CollectiveReceiver

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
        spec = args.get("specs", {}).get(str(staged.version))
        got = digests(staged.items())
        exact = seed is not None and spec is not None and \
            got == digests(det_weights(seed, staged.version, spec).items())
        sub.mark_applied(staged.version)
        conn.send(("staged", staged.publisher_id, staged.version, staged.data_path, exact, got))
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
        reply = "published" if command[0].startswith("publish") else command[0]
        return self.expect(reply, timeout)

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
