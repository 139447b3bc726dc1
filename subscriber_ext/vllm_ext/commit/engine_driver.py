"""The engine core decides when a staged weight version is committed (engine-driven mode).

Why: only the engine core sees the scheduler, so only it can (1) commit before
``scheduler.schedule()`` so that no request of that step was matched against the
prefix cache with the old weights, (2) make sure new requests never reuse prefix
cache blocks computed with older weights, and (3) tag every ``EngineCoreOutputs``
with the version (``CompletionOutput.weight_versions``). It also removes the
per-step agreement collective: ranks advertise their staged versions in a shared
memory table (``shared_slots.py``) that the engine reads in about a microsecond.

This module is the policy; ``vllm_patches.py`` hooks it into ``EngineCore``.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from subscriber_ext.vllm_ext.commit.shared_slots import SlotReader, SlotTable, common_version, fence

__all__ = ["COMMIT_RPC", "EngineDriver", "invalidate_prefix_cache"]

logger = logging.getLogger("weightpub.engine")

#: The worker RPC the engine calls to commit one version on every rank.
COMMIT_RPC = "weightpub_commit_version"

Rpc = Callable[..., list[Any]]  # (core, method, args=...) -> one result per rank


class EngineDriver:
    """Per-``EngineCore`` state: the slot table and the commit step."""

    def __init__(self, table: SlotTable, rpc: Rpc) -> None:
        self.table = table
        self.rpc = rpc  # the engine's own (unpatched) collective_rpc
        self.reader = SlotReader(table)
        self.seen = b""  # slot sequence counters at the last look
        self.applied: tuple[int, int] | None = None  # (publisher hash, version)
        self.reset_prefix = os.environ.get("WEIGHTPUB_PREFIX_RESET", "1") != "0"
        self.tag_lag: collections.deque[str] = collections.deque()
        self.commits: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self.checks = 0
        self.check_s = 0.0
        self.unlinked = False

    def maybe_commit(self, core: Any) -> bool:
        """Commit the newest version every rank holds, if any; cheap when nothing changed."""
        t0 = time.perf_counter()
        self.checks += 1
        if not self.unlinked:  # the engine is built: every worker has mapped the table
            self.table.unlink()
            self.unlinked = True
        seqs = self.reader.seqs()
        if seqs == self.seen:
            self.check_s += time.perf_counter() - t0
            return False
        self.seen = seqs
        snap = self.reader.snapshot()
        pick = common_version(snap) if snap is not None else None
        if pick is None or pick == self.applied:
            if snap is None:
                self.seen = b""  # writers raced us: look again next time
            self.check_s += time.perf_counter() - t0
            return False
        return self._commit(core, pick, t0)

    def _commit(self, core: Any, pick: tuple[int, int], t0: float) -> bool:
        pid, version = pick
        table = self.table
        table.intent = version
        fence()
        snap = self.reader.snapshot()  # still held everywhere now that the intent is visible?
        if snap is None or not all(p == pid and version in h for p, _, h in snap):
            table.intent = -1
            self.seen = b""
            return False
        try:
            results = self.rpc(core, COMMIT_RPC, args=(version, pid))
        finally:
            table.intent = -1
        t1 = time.perf_counter()
        applied = set(results)
        if applied != {version}:
            logger.error("weightpub: ranks report %s after committing %d", applied, version)
            if version not in applied:
                return False
        self.applied = pick
        batch_queue = getattr(core, "batch_queue", None)
        in_flight = len(batch_queue) if batch_queue else 0
        old = str(core._weight_version)
        while len(self.tag_lag) < in_flight:  # batches already queued ran the old weights
            self.tag_lag.append(old)
        how = "off"
        if self.reset_prefix:
            how = invalidate_prefix_cache(core.scheduler, f"{pid}:{version}")
        core._weight_version = str(version)
        t2 = time.perf_counter()
        self.commits.append(
            {"version": version, "rpc_s": t1 - t0, "prefix": how, "prefix_s": t2 - t1}
        )
        logger.info(
            "weightpub: engine committed version %d (rpc %.3f s, prefix cache %s %.4f s)",
            version,
            t1 - t0,
            how,
            t2 - t1,
        )
        return True

    def weight_version_tag(self, current: str) -> str:
        return self.tag_lag.popleft() if self.tag_lag else current


def invalidate_prefix_cache(scheduler: Any, salt: str) -> str:
    """Make sure no later request hits a block computed with the old weights.

    Idle cache (no block in use): the scheduler's own ``reset_prefix_cache``.
    Busy: vLLM's reset refuses while running requests hold blocks, so drop every
    block hash from the pools (``evict_blocks``: blocks in use stay allocated and
    keep serving their requests, they just can no longer be matched), and salt the
    block-hash chains of the running requests, so the blocks they fill from now on
    (computed partly from old-weight KV) never match a new request either.
    Returns ``"reset"``, ``"evicted"`` or ``"none"`` (prefix caching off).
    """
    kvm = getattr(scheduler, "kv_cache_manager", None)
    coordinator = getattr(kvm, "coordinator", None)
    if coordinator is None or not getattr(kvm, "enable_caching", True):
        return "none"
    managers = coordinator.single_type_managers
    pools = list({id(m.block_pool): m.block_pool for m in managers}.values())
    if all(p.get_num_free_blocks() == p.num_gpu_blocks - 1 for p in pools):
        if scheduler.reset_prefix_cache(False, True):
            return "reset"
    for pool in pools:
        ids = {b.block_id for b in pool.blocks if b.block_hash is not None}
        ids.update(pool.cached_block_hashes_by_block)
        if ids:
            pool.evict_blocks(ids)
    key = hashlib.blake2b(salt.encode(), digest_size=32).digest()
    for request in list(getattr(scheduler, "running", ())):
        hashes = request.block_hashes
        hashes[:] = [_salted(h, key) for h in hashes]
    return "evicted"


def _salted(block_hash: Any, key: bytes) -> Any:
    if not isinstance(block_hash, bytes):
        return block_hash
    size = len(block_hash) if 1 <= len(block_hash) <= 64 else 32
    return hashlib.blake2b(block_hash, digest_size=size, key=key).digest()


