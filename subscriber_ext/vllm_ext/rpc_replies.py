"""Every rank replies to every RPC; a failure is raised by the last rank only, for all of them.

Why: vLLM 0.32's ``MultiprocExecutor.collective_rpc`` reads the ranks' replies in
order and raises at the first failed one, leaving the later ranks' replies in
their queues (vllm-project/vllm#57846, open). At TP >= 2, an RPC that fails on
every rank (a seed RPC refusing a bad tensor) then makes *every later RPC*
return the reply of the one before. So each public RPC of the extension is
wrapped: at world size > 1 the ranks exchange a failed flag and a bounded error
text (fixed-size uint8 tensors over vLLM's world CPU group: never pickle), every
rank but the last returns normally, and the last rank raises one error naming
every rank's failure. The executor reads every reply in order and raises at the
last: nothing is left queued.

A wrapped RPC called from inside another (``weight_version`` commits through
``commit_pending``) runs plainly: only the outermost call exchanges, so every
rank takes the same collectives in the same order.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch

from weightpub_wire.errors import WeightPubError

__all__ = ["MAX_ERROR_BYTES", "RankFailures", "all_ranks_reply"]

logger = logging.getLogger("weightpub.worker")
MAX_ERROR_BYTES = 2048  # per rank, utf-8
EXCHANGE_TIMEOUT_S = 120.0
F = TypeVar("F", bound=Callable[..., Any])
_inside = threading.local()


class RankFailures(WeightPubError):
    """An RPC failed on one or more ranks; the message names each rank's error."""


def _world() -> Any:
    """vLLM's world group, or None where there is none (tests, single process)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
    except (AssertionError, ImportError, AttributeError):
        return None
    return group if group.world_size > 1 else None


def _encode(error: BaseException | None, rank: int) -> torch.Tensor:
    row = torch.zeros(1 + MAX_ERROR_BYTES, dtype=torch.uint8)
    if error is None:
        return row
    text = f"rank {rank}: {type(error).__name__}: {error}".encode(errors="replace")
    text = text[:MAX_ERROR_BYTES]
    row[0] = 1
    row[1: 1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return row


def _decode(row: torch.Tensor) -> str | None:
    if not int(row[0]):
        return None
    raw = bytes(row[1:].tolist()).rstrip(b"\0")
    return raw.decode(errors="replace")


def _exchange(world: Any, error: BaseException | None) -> list[str]:
    """Every rank's error text (failed ranks only), in rank order."""
    import torch.distributed as dist

    mine = _encode(error, world.rank_in_group)
    rows = [torch.empty_like(mine) for _ in range(world.world_size)]
    work = dist.all_gather(rows, mine, group=world.cpu_group, async_op=True)
    assert work is not None
    work.wait(timedelta(seconds=EXCHANGE_TIMEOUT_S))
    return [text for text in map(_decode, rows) if text is not None]


def all_ranks_reply(method: F) -> F:
    """Wrap a worker RPC so a failure never leaves replies queued in vLLM's executor."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "depth", 0):
            return method(self, *args, **kwargs)
        world = _world()
        if world is None:
            return method(self, *args, **kwargs)
        _inside.depth = 1
        try:
            result, error = method(self, *args, **kwargs), None
        except Exception as exc:
            result, error = None, exc
        finally:
            _inside.depth = 0
        failures = _exchange(world, error)
        if not failures:
            return result
        if world.rank_in_group != world.world_size - 1:
            logger.warning("weightpub: %s failed (the last rank raises for all): %s",
                           method.__name__, failures)
            return None
        raise RankFailures(f"{method.__name__} failed on {len(failures)} of "
                           f"{world.world_size} ranks: " + "; ".join(failures)) from error

    return cast(F, wrapper)
