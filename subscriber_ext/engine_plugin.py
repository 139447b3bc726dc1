"""vLLM general plugin: the engine core decides when a staged weight version is committed.

Why: only the engine core sees the scheduler, so only it can (1) commit before
``scheduler.schedule()`` so that no request of that step was matched against the
prefix cache with the old weights, (2) make sure new requests never reuse prefix
cache blocks computed with older weights, and (3) tag every ``EngineCoreOutputs``
with the version (``CompletionOutput.weight_versions``). It also removes the
per-step agreement collective: ranks advertise their staged versions in a shared
memory table (``shared_slots.py``) that the engine reads in about a microsecond.

Registered as ``vllm.general_plugins: weightpub``; vLLM calls ``register`` in every
process (front end, engine core, workers). It only patches ``EngineCore`` once.
Set ``WEIGHTPUB_ENGINE_DRIVER=0`` to keep the worker-side commit.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import logging
import os
import queue
import sys
import time
from typing import Any

from .shared_slots import ENV, SlotReader, SlotTable, common_version, fence

__all__ = ["EngineDriver", "invalidate_prefix_cache", "register"]

logger = logging.getLogger("weightpub.engine")

_RPCS = frozenset({"weight_version", "commit_pending"})  # commit before forwarding these
_PATCHED = "_weightpub_patched"


class EngineDriver:
    """Per-``EngineCore`` state: the slot table and the commit step."""

    def __init__(self, table: SlotTable) -> None:
        self.table = table
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
            results = _ORIGINAL["collective_rpc"](core, "commit_pending", args=(version, pid))
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


# ------------------------------------------------------------------ patches
_ORIGINAL: dict[str, Any] = {}


def _driver(core: Any) -> EngineDriver | None:
    return core.__dict__.get("_wp_driver")


def _init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
    _setup(self, vllm_config)
    _ORIGINAL["__init__"](self, vllm_config, *args, **kwargs)


def _setup(core: Any, vllm_config: Any) -> None:
    """Create the slot table and export it before ``core`` builds its executor (workers).

    Why an env var: workers are spawned by this process (or live in it) while the
    engine is constructing, and each maps the table at init (``_wp_attach_slots``).
    """
    if "_wp_driver" in core.__dict__ or os.environ.get("WEIGHTPUB_ENGINE_DRIVER", "1") == "0":
        return
    par = vllm_config.parallel_config
    nslots = par.tensor_parallel_size * par.pipeline_parallel_size
    if par.world_size != nslots:
        logger.warning("weightpub: world size %d != TP x PP; worker-side commit", par.world_size)
        return
    try:
        table = SlotTable.create(nslots)
    except OSError as exc:
        logger.warning("weightpub: no slot table (%s); worker-side commit", exc)
        return
    atexit.register(table.unlink)
    os.environ[ENV] = table.env_value()
    core._wp_driver = EngineDriver(table)
    _wrap_input_queue(core)


def _constructing_core() -> tuple[Any, Any] | None:
    """The ``EngineCore`` whose ``__init__`` is running below us, with its config.

    Why: in a spawned engine-core process vLLM loads plugins from inside
    ``EngineCore.__init__``, too late for a class patch of ``__init__`` but still
    before the executor (and its workers) is created.
    """
    code = getattr(_ORIGINAL.get("__init__"), "__code__", None)
    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return None
        if frame.f_code is code:
            loc = frame.f_locals
            if "self" in loc and "vllm_config" in loc:
                return loc["self"], loc["vllm_config"]
        frame = frame.f_back
    return None


def _wrap_input_queue(core: Any) -> None:
    """Let an idle engine commit: wake from the blocking input-queue wait every poll_s."""
    q = getattr(core, "input_queue", None)
    poll_s = float(os.environ.get("WEIGHTPUB_IDLE_POLL_S", "0.05"))
    if not isinstance(q, queue.Queue) or poll_s <= 0:
        return
    get = q.get

    def idle_get(block: bool = True, timeout: float | None = None) -> Any:
        if not block or timeout is not None:
            return get(block, timeout)
        _idle_commit(core)  # also when client calls keep waking us before poll_s
        while True:
            try:
                return get(True, poll_s)
            except queue.Empty:
                _idle_commit(core)

    q.get = idle_get  # type: ignore[method-assign]


def _idle_commit(core: Any) -> None:
    driver = _driver(core)
    if driver is None or _is_sleeping(core):
        return
    try:
        driver.maybe_commit(core)
    except Exception:
        logger.exception("weightpub: idle commit failed")


def _is_sleeping(core: Any) -> bool:
    try:
        return bool(core.is_sleeping())
    except Exception:
        return False


def _step(self: Any) -> Any:
    driver = self.__dict__.get("_wp_driver")
    if driver is not None:
        driver.maybe_commit(self)
    return _ORIGINAL["step"](self)


def _step_with_batch_queue(self: Any) -> Any:
    driver = self.__dict__.get("_wp_driver")
    if driver is not None:
        driver.maybe_commit(self)
    return _ORIGINAL["step_with_batch_queue"](self)


def _attach_weight_version(self: Any, outputs: dict[int, Any]) -> None:
    driver = self.__dict__.get("_wp_driver")
    if driver is None or not driver.tag_lag:
        return _ORIGINAL["_attach_weight_version"](self, outputs)
    tag = driver.weight_version_tag(self._weight_version)
    for eco in outputs.values():
        eco.weight_version = tag


def _collective_rpc(
    self: Any,
    method: Any,
    timeout: float | None = None,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:
    driver = self.__dict__.get("_wp_driver")
    if driver is not None and method in _RPCS and not _is_sleeping(self):
        driver.maybe_commit(self)
    return _ORIGINAL["collective_rpc"](self, method, timeout, args, kwargs)


def _weightpub_driver_status(self: Any) -> dict[str, Any]:
    """Engine-side state (``LLM.llm_engine.engine_core.call_utility`` / tests)."""
    driver = _driver(self)
    if driver is None:
        return {"active": False}
    return {
        "active": True,
        "applied": driver.applied,
        "commits": list(driver.commits)[-16:],
        "checks": driver.checks,
        "check_s": driver.check_s,
        "weight_version": self._weight_version,
    }


def register() -> None:
    """vLLM plugin entry point: patch ``EngineCore`` once per process (idempotent, cheap)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # pragma: no cover - vLLM without the v1 engine
        return
    if getattr(EngineCore, _PATCHED, False):
        found = _constructing_core()
        if found is not None:
            _setup(*found)
        return
    for name in ("__init__", "step", "step_with_batch_queue", "collective_rpc"):
        _ORIGINAL[name] = getattr(EngineCore, name)
    _ORIGINAL["_attach_weight_version"] = getattr(EngineCore, "_attach_weight_version", None)
    EngineCore.__init__ = _init
    EngineCore.step = _step
    EngineCore.step_with_batch_queue = _step_with_batch_queue
    EngineCore.collective_rpc = _collective_rpc
    if _ORIGINAL["_attach_weight_version"] is not None:
        EngineCore._attach_weight_version = _attach_weight_version
    EngineCore.weightpub_driver_status = _weightpub_driver_status
    setattr(EngineCore, _PATCHED, True)
    found = _constructing_core()
    if found is not None:
        _setup(*found)
