"""The learner's end of the actors: start them, hand out their batches, stop them.

Each actor is its own process group (``python -m weightpub.demos.rl_actor``, which
starts a vLLM engine core and worker of its own), pinned to one core through
``VLLM_CPU_OMP_THREADS_BIND``; its output goes to a log file whose tail is shown
if it fails. Batches arrive on one ROUTER socket; a batch is acknowledged (the
actor gets its credit back) when the learner consumes it, not when it arrives.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import msgspec
import zmq

from weightpub.demos import rl_messages as msg
from weightpub.demos.rl_actor import ActorConfig
from weightpub_wire.errors import WeightPubError, WeightPubTimeout

__all__ = ["ActorPool"]


class ActorPool:
    """``count`` actors feeding one learner; a context manager that always stops them."""

    def __init__(self, count: int, *, model_dir: Path, publisher: str, log_dir: Path,
                 seed: int, prompts_per_batch: int, group_size: int, credit: int,
                 quiet: bool = True) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        cpus = sorted(os.sched_getaffinity(0))
        self.configs = [
            ActorConfig(index=i, model_dir=str(model_dir), publisher=publisher, learner=endpoint,
                        cpus=str(cpus[i % len(cpus)]), seed=seed * 1000 + i,
                        prompts_per_batch=prompts_per_batch, group_size=group_size,
                        credit=credit, quiet=quiet)
            for i in range(count)]
        self.names = [f"actor{i}" for i in range(count)]
        self.logs = [log_dir / f"{name}.log" for name in self.names]
        self.procs: list[subprocess.Popen[bytes]] = []
        self._files: list[IO[bytes]] = []
        self.ready: set[int] = set()
        self.pending: collections.deque[msg.Batch] = collections.deque()
        self.generate_s = 0.0
        self.idle_s = 0.0
        self.wait_s = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for cfg, log in zip(self.configs, self.logs, strict=True):
            out = log.open("wb")
            self._files.append(out)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "weightpub.demos.rl_actor",
                 msgspec.json.encode(cfg).decode()],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ready) < len(self.procs):
            if time.monotonic() >= deadline:
                missing = [self.names[i] for i in range(len(self.procs)) if i not in self.ready]
                raise WeightPubTimeout(f"actors {missing} did not start within {timeout:.0f} s"
                                       f"{self._log_tails(missing)}")
            self._receive(0.5)

    def stop(self, timeout: float = 15.0) -> None:
        """Ask every actor to stop; kill the process groups of those that do not.

        A ready actor gets ``stop`` (it finishes its batch and shuts its engine
        down); one still starting its engine reads no messages yet and gets SIGTERM,
        which vLLM handles by shutting the engine down.
        """
        for i, proc in enumerate(self.procs):
            if i in self.ready:
                self.sock.send_multipart([self.names[i].encode(), msg.STOP])
            elif proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for out in self._files:
            out.close()

    def __enter__(self) -> ActorPool:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.sock.close()
            self.ctx.term()

    # ------------------------------------------------------------------ batches
    def next_batch(self, timeout: float = 120.0) -> msg.Batch:
        """The oldest unconsumed batch (blocking); its actor gets the credit back."""
        start = time.monotonic()
        while not self.pending:
            if time.monotonic() - start >= timeout:
                raise WeightPubTimeout(f"no rollouts from any actor within {timeout:.0f} s"
                                       f"{self._log_tails(self.names)}")
            self._receive(0.5)
        self.wait_s += time.monotonic() - start
        batch = self.pending.popleft()
        self.sock.send_multipart([self.names[batch.actor].encode(), msg.ACK])
        return batch

    def _receive(self, wait_s: float) -> None:
        if self.sock.poll(int(wait_s * 1000)):
            while True:
                try:
                    identity, frame = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(identity, frame)
        self._check_alive()

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            message = msg.decode(frame)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise WeightPubError(f"bad message from {identity!r}: {exc}") from exc
        if not 0 <= message.actor < len(self.procs) or \
                identity != self.names[message.actor].encode():
            raise WeightPubError(f"{identity!r} claims to be actor {message.actor}")
        if isinstance(message, msg.Failed):
            raise WeightPubError(f"{self.names[message.actor]} failed: {message.error}")
        if isinstance(message, msg.Ready):
            self.ready.add(message.actor)
            return
        self.generate_s += message.generate_s
        self.idle_s += message.idle_s
        self.pending.append(message)

    def _check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                raise WeightPubError(f"{self.names[i]} exited with code {code}"
                                     f"{self._log_tails([self.names[i]])}")

    def _log_tails(self, names: list[str], limit: int = 1500) -> str:
        parts = []
        for name in names:
            log = self.logs[self.names.index(name)]
            try:
                text = log.read_bytes().decode(errors="replace")[-limit:]
            except OSError:
                continue
            parts.append(f"\n--- {log} (tail) ---\n{text}")
        return "".join(parts)
