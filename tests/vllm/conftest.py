"""Shared engines for the vLLM tests (starting one costs 15-25 s on 2 cores)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # no shutdown warnings into closed streams


SHM = Path("/dev/shm")


@pytest.fixture(scope="session", autouse=True)
def _remove_vllm_shared_memory_left_behind() -> Iterator[None]:
    """vLLM's CPU shared-memory communicator (TP=2) leaves two 4 MiB ``vllm_dist_*`` files
    per engine in /dev/shm after the engine is gone; a container's 64 MiB /dev/shm fills
    up. Remove the ones that appeared during this session, once every engine is closed."""
    before = set(SHM.glob("vllm_dist_*")) if SHM.is_dir() else set()
    yield
    if SHM.is_dir():
        for path in set(SHM.glob("vllm_dist_*")) - before:
            path.unlink(missing_ok=True)
