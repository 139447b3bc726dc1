"""Test children forked from a zygote that has imported torch and our packages once.

A ``python -m tests.transport.procs`` child spends seconds importing torch before
it says ready (several on a loaded 2-core CI machine) and again tearing it down;
a child forked from a ``forkserver`` that preloaded them starts in milliseconds
and ends with ``os._exit``. ``ForkedProcess`` is the part of ``subprocess.Popen``
that ``Child`` and its users touch (pid, the stdin/stdout pipes, poll, wait, kill,
returncode), so a forked child speaks the same JSON lines and is a real process
of its own: SIGKILL and SIGSTOP hit it alone.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import IO, Any

__all__ = ["ForkedProcess", "context"]

PRELOAD = ["torch", "zmq", "msgspec", "xxhash", "publisher", "publisher.sharded_publisher",
           "subscriber_ext", "tests.transport.procs", "tests.transport.shard_procs",
           "tests.transport.peer_procs"]

_CONTEXT: multiprocessing.context.ForkServerContext | None = None


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context; its server (one per process, shared with other users of
    ``forkserver``) preloads ``PRELOAD`` if this is the first to start it."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        assert isinstance(ctx, multiprocessing.context.ForkServerContext)
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _child_main(role: str, args: dict[str, Any], stdin: Connection, stdout: Connection,
                stderr: Connection) -> None:
    """In the forked child: the pipes become fds 0-2, then ``procs.main`` as if run with
    ``python -m tests.transport.procs <role> <args>``."""
    for end, fd in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(end.fileno(), fd)
        end.close()
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    from tests.transport import procs

    sys.argv = ["tests.transport.procs", role, json.dumps(args)]
    procs.main()


class ForkedProcess:
    """``python -m tests.transport.procs role args``, forked from the zygote instead;
    quacks like the ``subprocess.Popen`` (text, line-buffered pipes) ``Child`` had."""

    def __init__(self, role: str, args: dict[str, Any], stderr: IO[bytes]) -> None:
        self.args = ["tests.transport.procs", role]
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        ends = [Connection(stdin_r, writable=False), Connection(stdout_w, readable=False),
                Connection(os.dup(stderr.fileno()), readable=False)]
        try:
            self._process = context().Process(target=_child_main, args=(role, args, *ends),
                                              daemon=True, name=f"test-{role}")
            self._process.start()
        except BaseException:
            os.close(stdin_w)
            os.close(stdout_r)
            raise
        finally:
            for end in ends:  # the child has its copies: EOF comes when it exits
                end.close()
        self.stdin: IO[str] | None = open(stdin_w, "w", buffering=1)
        self.stdout: IO[str] | None = open(stdout_r)
        pid = self._process.pid
        assert pid is not None
        self.pid: int = pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)
