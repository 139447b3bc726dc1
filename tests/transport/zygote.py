"""Test children forked from a zygote that has imported torch and our packages once.

A ``python -m tests.transport.procs`` child spends seconds importing torch before
it says ready (several on a loaded 2-core CI machine) and again tearing it down;
a child forked from a ``forkserver`` that preloaded them starts in milliseconds
and ends with ``os._exit``. ``ForkedProcess`` (``weightpub.bench.forked``) is the
part of ``subprocess.Popen`` that ``Child`` and its users touch, so a forked
child speaks the same JSON lines and is a real process of its own: SIGKILL and
SIGSTOP hit it alone.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any

from weightpub.bench.forked import ForkedProcess

__all__ = ["PRELOAD", "forked_child"]

PRELOAD = ["torch", "zmq", "msgspec", "xxhash", "publisher", "publisher.sharded_publisher",
           "subscriber_ext", "tests.transport.procs", "tests.transport.shard_procs",
           "tests.transport.peer_procs", "tests.transport.relay_procs"]


def _run_role(role: str, args: dict[str, Any]) -> None:
    """In the forked child: ``procs.main`` as if run with ``python -m
    tests.transport.procs <role> <args>``."""
    os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    from tests.transport import procs

    sys.argv = ["tests.transport.procs", role, json.dumps(args)]
    procs.main()


def forked_child(role: str, args: dict[str, Any], stderr: IO[bytes]) -> ForkedProcess:
    """``python -m tests.transport.procs role args``, forked from the zygote instead."""
    return ForkedProcess(_run_role, (role, args), stderr=stderr, preload=PRELOAD,
                         name=f"test-{role}")
