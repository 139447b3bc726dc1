"""Child processes forked from a zygote that imported torch and the packages once.

A ``python -m ...`` child spends seconds importing torch before it is ready
(several on a loaded 2-core CI machine); a child forked from a ``forkserver``
that preloaded it starts in milliseconds. ``ForkedProcess`` is the part of
``subprocess.Popen`` (text, line-buffered stdin/stdout pipes) that the tests'
and the fleet simulator's JSON-line children use: pid, stdin, stdout, poll,
wait, kill, returncode. The child is a real process of its own (SIGKILL and
SIGSTOP hit it alone), optionally in a session of its own and inside a network
namespace (``setns``, as ``ip netns exec`` would put it).

The forkserver is one per process (the standard library's): the first user to
start it decides what it preloads; a child imports whatever else it needs.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.context
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import IO, Any

__all__ = ["ForkedProcess", "forkserver"]

_CLONE_NEWNET = 0x40000000


def forkserver(preload: Sequence[str] = ()) -> multiprocessing.context.ForkServerContext:
    """The forkserver context, asking it to preload ``preload`` (effective only if its
    server has not started yet)."""
    ctx = multiprocessing.get_context("forkserver")
    assert isinstance(ctx, multiprocessing.context.ForkServerContext)
    if preload:
        ctx.set_forkserver_preload(list(preload))
    return ctx


def _enter_netns(name: str) -> None:
    """This (single-threaded) process joins network namespace ``name``; threads it starts
    later inherit it."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({name}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def _child_main(target: Callable[..., None], args: tuple[Any, ...], stdin: Connection,
                stdout: Connection, stderr: Connection | None, netns: str | None,
                new_session: bool) -> None:
    """In the forked child: the pipes become fds 0-2, then ``target(*args)``."""
    if stderr is None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    for end, fd in ((stdin, 0), (stdout, 1), (stderr, 2)):
        if end is not None:
            os.dup2(end.fileno(), fd)
            end.close()
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if new_session:
        os.setsid()
    if netns:
        _enter_netns(netns)
    target(*args)


class ForkedProcess:
    """``target(*args)`` in a process forked from the zygote, its stdin/stdout the pipes
    ``stdin``/``stdout`` (text, line-buffered) and its stderr ``stderr`` (a file, or
    nowhere); quacks like the ``subprocess.Popen`` it replaces."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...] = (), *,
                 stderr: IO[Any] | None = None, preload: Sequence[str] = (),
                 netns: str | None = None, new_session: bool = False,
                 name: str = "forked") -> None:
        self.args = [name]
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        ends = [Connection(stdin_r, writable=False), Connection(stdout_w, readable=False)]
        err = None if stderr is None else Connection(os.dup(stderr.fileno()), readable=False)
        try:
            self._process = forkserver(preload).Process(
                target=_child_main, args=(target, args, *ends, err, netns, new_session),
                daemon=True, name=name)
            self._process.start()
        except BaseException:
            os.close(stdin_w)
            os.close(stdout_r)
            raise
        finally:
            for end in [*ends, err]:  # the child has its copies: EOF comes when it exits
                if end is not None:
                    end.close()
        self.stdin: IO[str] | None = open(stdin_w, "w", buffering=1)
        self.stdout: IO[str] | None = open(stdout_r)
        pid = self._process.pid
        assert pid is not None
        self.pid: int = pid
        self._code: int | None = None

    def _exit_code(self) -> int | None:
        """The exit code once the child is gone; then the process handle is closed, so its
        sentinel descriptor does not outlive it (a soak starting hundreds counts them)."""
        if self._code is None:
            self._code = self._process.exitcode
            if self._code is not None:
                self._process.close()
        return self._code

    @property
    def returncode(self) -> int | None:
        return self._exit_code()

    def poll(self) -> int | None:
        return self._exit_code()

    def wait(self, timeout: float | None = None) -> int:
        if self._code is None:
            self._process.join(timeout)
        code = self._exit_code()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._exit_code() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)
