"""Drive fault-matrix children and check the invariants every case must keep.

``Proc`` starts a child (``children.py``) and waits on it with timeouts.
``Recorder`` is a subscriber's ``on_version``: it checks every delivered
version bit-exact against the bytes its publisher instance derived from its
seed, so a partial or mixed version fails the case the moment it is offered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from subscriber_ext import StagedVersion
from tests.transport.faults.children import (
    mp_context,
    publisher_child,
    relay_child,
    shard_rank_child,
)
from tests.transport.procs import as_bytes, det_weights, digests

__all__ = ["Proc", "Recorder", "Spec"]

Spec = list[tuple[str, str, list[int]]]


class Proc:
    """A forked child speaking over a pipe; every wait is bounded."""

    def __init__(self, role: str, **args: Any) -> None:
        ctx = mp_context()
        self._conn, child_conn = ctx.Pipe()
        target = {"publisher": publisher_child, "relay": relay_child,
                  "shard_rank": shard_rank_child}[role]
        self.process = ctx.Process(target=target, args=(child_conn, args), daemon=True)
        self.process.start()
        child_conn.close()
        self.args = args
        ready = self._expect("ready", 60)
        _, self.endpoint, self.publisher_id, self.started_at, self.pid = ready

    def _expect(self, what: str, timeout: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self._conn.poll(0.1):
                    message = self._conn.recv()
                    if message[0] == what:
                        return tuple(message)
            except (EOFError, OSError):
                break
            if not self.process.is_alive() and not self._conn.poll(0):
                break
        raise AssertionError(f"child {self.process.pid}: no {what!r} within {timeout}s "
                             f"(exitcode {self.process.exitcode})")

    def publish(self, version: int, spec: Spec, *, wait: bool = True) -> None:
        self._conn.send(("publish", version, spec))
        if wait:
            self._expect("published", 60)

    def wait_killed(self, timeout: float = 30.0) -> None:
        """The child died by SIGKILL (its own kill point or ours)."""
        self.process.join(timeout)
        assert self.process.exitcode == -9, f"exitcode {self.process.exitcode}"

    def kill9(self) -> None:
        self.process.kill()
        self.wait_killed()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit",))
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self._conn.close()


@dataclass
class Recorder:
    """``on_version`` that checks each delivered version against what its instance sent."""

    seeds: dict[str, int]  # publisher_id -> seed of its det_weights
    specs: dict[int, Spec]  # version -> spec
    seed_for: Callable[[str, int], int] | None = None  # relays: (relay id, version) -> seed
    delivered: list[tuple[str, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    on_commit: Callable[[StagedVersion], None] | None = None
    #: a sliced subscriber's plan (name -> byte ranges): those bytes, zeros elsewhere
    ranges: dict[str, list[tuple[int, int]]] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, staged: StagedVersion) -> None:
        key = (staged.publisher_id, staged.version)
        seed = (self.seed_for(*key) if self.seed_for is not None
                else self.seeds.get(staged.publisher_id))
        spec = self.specs.get(staged.version)
        if seed is None or spec is None:
            problem = f"unexpected version {key}"
        else:
            want = digests(planned(det_weights(seed, staged.version, spec), self.ranges))
            problem = "" if digests(staged.items()) == want else f"{key} is not bit-exact"
        if self.on_commit is not None and not problem:
            self.on_commit(staged)
        with self.lock:
            self.delivered.append(key)
            if problem:
                self.problems.append(problem)

    def got(self, publisher_id: str, version: int) -> bool:
        with self.lock:
            return (publisher_id, version) in self.delivered


def planned(weights: dict[str, torch.Tensor], ranges: dict[str, list[tuple[int, int]]] | None
            ) -> list[tuple[str, torch.Tensor]]:
    """``weights`` as a subscriber with the plan ``ranges`` stages them: the planned bytes,
    zeros elsewhere (all of them without a plan)."""
    if ranges is None:
        return list(weights.items())
    out = []
    for name, tensor in weights.items():
        raw, want = as_bytes(tensor), torch.zeros_like(as_bytes(tensor))
        for start, end in ranges.get(name, []):
            want[start:end] = raw[start:end]
        out.append((name, want))  # compared as bytes (``digests``)
    return out


def close_all(sub: Any, procs: list[Proc]) -> None:
    """A case's end: its subscriber closes promptly (asserted), then every process goes."""
    if sub is not None:
        start = time.monotonic()
        sub.close()
        assert time.monotonic() - start < 15, "subscriber close hung"
    for proc in procs:
        proc.close()
