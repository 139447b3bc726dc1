"""Where every weight lives: each rank's parameter and buffer storage, read over an RPC.

Why: captured CUDA graphs keep the addresses of the weights they read, so a commit must
write into the existing storage (vLLM's layerwise reload does, 'preserves cudagraph
refs'). The tests record every address before commits and compare after.
``collective_rpc(callable)`` needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the engine
and the caller: start the engine inside ``callable_rpcs()`` and keep it there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_KEY = "VLLM_ALLOW_INSECURE_SERIALIZATION"

#: name -> (data_ptr, shape, dtype)
Storage = dict[str, tuple[int, tuple[int, ...], str]]


def storage_of(worker: Any) -> Storage:
    """Worker side: every parameter's and buffer's storage (shared ones under each name)."""
    model = worker.model_runner.get_model()
    out: Storage = {}
    for kind, items in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            out[f"{kind} {name}"] = (t.data_ptr(), tuple(t.shape), str(t.dtype))
    return out


@contextmanager
def callable_rpcs() -> Iterator[None]:
    """Engines started (and RPCs sent) inside accept a callable in ``collective_rpc``."""
    old = os.environ.get(_KEY)
    os.environ[_KEY] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_KEY, None)
        else:
            os.environ[_KEY] = old


def storages(llm: Any) -> list[Storage]:
    """Every rank's ``storage_of``."""
    return list(llm.collective_rpc(storage_of))


def assert_same_storage(before: list[Storage], after: list[Storage]) -> None:
    """Every tensor of every rank still lives where it did (same shape and dtype too)."""
    for rank, (b, a) in enumerate(zip(before, after, strict=True)):
        assert b.keys() == a.keys(), f"rank {rank}: tensors came or went: {b.keys() ^ a.keys()}"
        moved = sorted(n for n in b if a[n] != b[n])
        assert not moved, f"rank {rank}: {len(moved)} of {len(b)} tensors moved: {moved}"
