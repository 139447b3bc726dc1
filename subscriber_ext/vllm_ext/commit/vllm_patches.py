"""Every place weightpub patches vLLM, in one module (vLLM 0.32; see ``vllm_compat``).

Three hooks, all installed by ``install`` except the last, which the extension
installs on its own worker. ``register`` is the ``vllm.general_plugins:
weightpub`` entry point vLLM calls in every process (front end, engine core,
workers): it registers the ``weightpub`` weight-transfer backends (by module
path) and installs the hooks only where the process asks for weightpub
(``vllm_plugin.asked_here``: the backend, the ``additional_config`` entry or our
worker extension); every other vLLM process runs untouched. Even in a patched
process, an engine whose own config does not ask gets no slot table, no driver
and no hooks that act (``_setup``). ``install`` also exposes the replica's
Prometheus metrics in the process that serves ``/metrics`` (``observe/``).

1. ``EngineCore`` (engine-core process): ``__init__`` creates the rank slot
   table before workers spawn; ``step`` / ``step_with_batch_queue`` and our RPCs
   commit first (``EngineDriver``); the blocking input-queue ``get`` is woken by a
   rank's slot write (``idle_wake``) so an idle engine commits at once;
   ``_attach_weight_version`` tags outputs of batches queued before a commit
   with the old version. ``WEIGHTPUB_ENGINE_DRIVER=0`` leaves the engine alone
   (ranks then agree among themselves, ``strategies.RankAgreement``). With the
   ``weightpub`` weight-transfer backend: our worker extension is mixed in when
   none is named, vLLM's ``update_weights`` RPC waits (committing) until every
   rank runs the version asked for, beside the step loop (``update_waits``), and
   ``set_weight_version`` cannot relabel outputs away from the version committed.
2. ``WorkerWrapperBase.initialize_from_config`` (worker processes): once the
   model is loaded and the KV cache sized, map the slot table and start the
   subscriber named in ``--additional-config`` (an extension gets no init hook:
   ``WorkerBase.__init__`` does not call ``super().__init__``).
3. The worker's ``execute_model`` (an instance attribute wins over the class
   method): the commit check before each step (``wrap_execute_model``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import sys
import time
from collections.abc import Callable
from typing import Any

from subscriber_ext.observe.replica_metrics import ReplicaCollector
from subscriber_ext.observe.status_board import StatusBoard
from subscriber_ext.vllm_ext.commit.engine_driver import EngineDriver
from subscriber_ext.vllm_ext.commit.idle_wake import WakeListener, wake_address
from subscriber_ext.vllm_ext.commit.shared_slots import ENV, SlotTable
from subscriber_ext.vllm_ext.commit.update_waits import (
    BLOCKING_WAIT_S,
    MAX_TIMEOUT_S,
    UpdateWaits,
)
from subscriber_ext.vllm_ext.commit.vllm_plugin import (
    asked_here,
    ensure_backends,
    uses_backend,
    wants_weightpub,
)
from subscriber_ext.vllm_ext.vllm_compat import check_vllm

__all__ = ["DRIVER_RPCS", "EXTENSION", "install", "installed", "register", "wrap_execute_model"]

logger = logging.getLogger("weightpub.engine")

#: Worker RPCs the engine commits before forwarding (so they see the newest version).
DRIVER_RPCS = frozenset({"weight_version", "commit_pending"})
#: the worker extension mixed in for the ``weightpub`` backend (``subscriber_ext.WORKER_EXTENSION``)
EXTENSION = "subscriber_ext.worker_extension.BatchWeightSyncWorkerExtension"
#: vLLM's RPC that, with the ``weightpub`` backend, means "every rank runs version >= v"
UPDATE_RPC = "update_weights"
_PATCHED = "_weightpub_patched"
_ORIGINAL: dict[str, Any] = {}


# ------------------------------------------------------------------ 1. EngineCore
def _driver(core: Any) -> EngineDriver | None:
    return core.__dict__.get("_wp_driver")


def _original_rpc(core: Any, method: str, args: tuple = ()) -> list[Any]:
    return list(_ORIGINAL["collective_rpc"](core, method, None, args, None))


def _init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
    _setup(self, vllm_config)
    _ORIGINAL["__init__"](self, vllm_config, *args, **kwargs)


def _setup(core: Any, vllm_config: Any) -> None:
    """Create the slot table and export it before ``core`` builds its executor (workers).

    Why an env var: workers are spawned by this process (or live in it) while the
    engine is constructing, and each maps the table at init (``_wp_attach_slots``).
    """
    if not wants_weightpub(vllm_config):
        return  # an engine that did not ask, in a process patched for another one
    par = vllm_config.parallel_config
    if uses_backend(vllm_config) and not par.worker_extension_cls:
        par.worker_extension_cls = EXTENSION  # the backend drives the extension's machinery
    if "_wp_driver" in core.__dict__ or os.environ.get("WEIGHTPUB_ENGINE_DRIVER", "1") == "0":
        return
    nslots = par.tensor_parallel_size * par.pipeline_parallel_size
    if par.world_size != nslots:
        logger.warning("weightpub: world size %d != TP x PP; ranks agree among themselves",
                       par.world_size)
        return
    try:
        table = SlotTable.create(nslots)
    except OSError as exc:
        logger.warning("weightpub: no slot table (%s); ranks agree among themselves", exc)
        return
    atexit.register(table.unlink)
    os.environ[ENV] = table.env_value()
    core._wp_driver = EngineDriver(table, _original_rpc)
    core._wp_waits = UpdateWaits()
    _wrap_input_queue(core, table.path)


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
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _wrap_input_queue(core: Any, table_path: str) -> None:
    """Let an idle engine commit, and serve the deferred ``update_weights`` calls while idle.

    ``idle_wake.WakeListener`` puts vLLM's own ``WAKEUP`` request into the queue
    when a rank advertises; the wait below commits before it blocks and whenever it
    wakes. ``WEIGHTPUB_IDLE_POLL_S`` is only a backstop (default 1 s; 0.05 s if the
    listener could not bind, the old polling; 0: no idle commits, tests). While an
    ``update_weights`` call waits (``update_waits``) the wait is bounded so that call
    is finished on time even when nothing else wakes the engine.
    """
    q = getattr(core, "input_queue", None)
    if not isinstance(q, queue.Queue):
        return
    backstop = os.environ.get("WEIGHTPUB_IDLE_POLL_S")
    idle = backstop is None or float(backstop) > 0  # 0: commit only at steps and our RPCs
    listener: WakeListener | None = None
    if idle:
        from vllm.v1.engine import EngineCoreRequestType

        def wake() -> None:
            q.put_nowait((EngineCoreRequestType.WAKEUP, None))

        try:
            listener = WakeListener(wake_address(table_path), wake)
        except OSError as exc:
            logger.warning("weightpub: no idle wake-up socket (%s); polling instead", exc)
    poll_s = (float(backstop) if backstop is not None else 1.0 if listener else 0.05) \
        if idle else None
    if listener is not None:
        atexit.register(listener.close)
        core._wp_waker = listener
    waits: UpdateWaits = core._wp_waits
    get = q.get

    def idle_get(block: bool = True, timeout: float | None = None) -> Any:
        if not block or timeout is not None:
            _serve_waits(core)
            return get(block, timeout)
        while True:
            if listener is not None:
                listener.taken()  # armed before we look: a later advertisement wakes us
            if idle:
                _idle_commit(core)  # also when client calls keep waking us
            _serve_waits(core)
            try:
                return get(True, waits.poll_s(poll_s))
            except queue.Empty:
                continue

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
    """The weights are offloaded (vLLM sleep level >= 1): nothing to commit into.

    Not ``EngineCore.is_sleeping()``, which is also true while the scheduler is
    paused (``/pause``, sleep level 0): a paused engine commits (idle or on our
    RPCs), so ``update_weights`` works during ``/pause?mode=keep``.
    """
    executor = getattr(core, "model_executor", None)
    try:
        if executor is not None:
            return bool(executor.is_sleeping)
        return bool(core.is_sleeping())
    except Exception:
        return False


def _step(self: Any) -> Any:
    driver = _driver(self)
    if driver is not None:
        driver.maybe_commit(self)
        _serve_waits(self)
    return _ORIGINAL["step"](self)


def _step_with_batch_queue(self: Any) -> Any:
    driver = _driver(self)
    if driver is not None:
        driver.maybe_commit(self)
        _serve_waits(self)
    return _ORIGINAL["step_with_batch_queue"](self)


def _attach_weight_version(self: Any, outputs: dict[int, Any]) -> None:
    driver = _driver(self)
    if driver is None or not driver.tag_lag:
        return _ORIGINAL["_attach_weight_version"](self, outputs)
    tag = driver.weight_version_tag(self._weight_version)
    for eco in outputs.values():
        eco.weight_version = tag


def _collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                    kwargs: dict[str, Any] | None = None) -> Any:
    driver = _driver(self)
    if driver is not None and method in DRIVER_RPCS and not _is_sleeping(self):
        driver.maybe_commit(self)
    if driver is not None and method == UPDATE_RPC and uses_backend(self.vllm_config):
        return _update_weights(self, driver, timeout, args, kwargs)
    return _ORIGINAL["collective_rpc"](self, method, timeout, args, kwargs)


def _update_info(args: tuple, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The ``update_info`` of vLLM's ``update_weights`` RPC (one dict, or one per rank)."""
    info = (kwargs or {}).get("update_info", args[0] if args else None)
    if isinstance(info, list):
        info = max((i for i in info if isinstance(i, dict)),
                   key=lambda i: int(i.get("version", 0)), default=None)
    return info if isinstance(info, dict) else {}


def _update_weights(core: Any, driver: EngineDriver, timeout: float | None, args: tuple,
                    kwargs: dict[str, Any] | None) -> Any:
    """vLLM's ``update_weights`` RPC: "every rank runs version >= ``info["version"]``".

    The engine commits (engine-driven, on every rank at once) until that version is
    live or the info's ``timeout`` ends, then forwards the RPC: each worker only checks
    what is live and names what is missing (``WeightpubWeightTransferEngine``). Why the
    wait is here: the workers cannot wait for a commit the engine would issue while it
    waits for their reply. It never holds the step loop: in an engine-core process the
    call returns a future the step and idle hooks finish (``update_waits``), so requests
    and other RPCs keep being served; an in-process engine core waits at most
    ``BLOCKING_WAIT_S``. A timeout outside (0, ``MAX_TIMEOUT_S``] is forwarded at once
    (the workers' parser names it).
    """
    info = _update_info(args, kwargs)

    def forward(a: tuple = args, kw: dict[str, Any] | None = kwargs) -> Any:
        return _ORIGINAL["collective_rpc"](core, UPDATE_RPC, timeout, a, kw)

    try:
        version = int(info.get("version", 0))
        wait_s = float(info.get("timeout", 120.0))
    except (TypeError, ValueError):
        return forward()  # the workers' parser names the bad field
    if not 0 < wait_s <= MAX_TIMEOUT_S:
        return forward()
    if _defers_utilities(core):
        return core._wp_waits.add(version, wait_s, forward)
    held = min(wait_s, BLOCKING_WAIT_S)
    deadline = time.monotonic() + held
    while not _is_sleeping(core):
        driver.maybe_commit(core)
        if _live(driver) >= version or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    if held < wait_s:  # the workers' error then says how long it was
        logger.warning("weightpub: an in-process engine core waits at most %gs in "
                       "update_weights (asked %gs)", held, wait_s)
        return forward(*_with_timeout(args, kwargs, held))
    return forward()


def _with_timeout(args: tuple, kwargs: dict[str, Any] | None,
                  seconds: float) -> tuple[tuple, dict[str, Any] | None]:
    """``update_weights``' arguments with every info's ``timeout`` set to ``seconds``."""
    def fix(info: Any) -> Any:
        if isinstance(info, list):
            return [fix(i) for i in info]
        return {**info, "timeout": seconds} if isinstance(info, dict) else info

    if kwargs and "update_info" in kwargs:
        return args, {**kwargs, "update_info": fix(kwargs["update_info"])}
    return (fix(args[0]), *args[1:]) if args else args, kwargs


def _live(driver: EngineDriver) -> int:
    return -1 if driver.applied is None else driver.applied[1]


def _serve_waits(core: Any) -> None:
    """Finish the deferred ``update_weights`` calls that are due (busy-loop thread)."""
    waits: UpdateWaits | None = core.__dict__.get("_wp_waits")
    driver = _driver(core)
    if driver is None or waits is None or not len(waits):
        return
    sleeping = _is_sleeping(core)
    if not sleeping:
        try:
            driver.maybe_commit(core)
        except Exception:
            logger.exception("weightpub: commit for a waiting update_weights failed")
    waits.serve(_live(driver), stop=sleeping)


def _defers_utilities(core: Any) -> bool:
    """Whether ``core`` runs vLLM's busy loop, which defers a utility call that returns a
    future until it is done (``EngineCoreProc._invoke_utility_method``)."""
    from vllm.v1.engine.core import EngineCoreProc

    return isinstance(core, EngineCoreProc)


def _set_weight_version(self: Any, weight_version: str) -> None:
    """Keep the label on the version actually committed (engine-driven ``weightpub``)."""
    driver = _driver(self)
    if driver is not None and driver.applied is not None and uses_backend(self.vllm_config):
        if str(weight_version) != str(self._weight_version):
            logger.warning("weightpub: outputs stay labelled %s (the version committed), "
                           "not %r", self._weight_version, weight_version)
        return
    _ORIGINAL["set_weight_version"](self, weight_version)


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
        "idle_wakes": getattr(getattr(self, "_wp_waker", None), "wakes", None),
        "update_waits": len(self.__dict__.get("_wp_waits") or ()),
        "weight_version": self._weight_version,
    }


def _patch_engine_core() -> None:
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, _PATCHED, False):
        return
    for name in ("__init__", "step", "step_with_batch_queue", "collective_rpc",
                 "_attach_weight_version", "set_weight_version"):
        _ORIGINAL[name] = getattr(EngineCore, name)
    EngineCore.__init__ = _init
    EngineCore.step = _step
    EngineCore.step_with_batch_queue = _step_with_batch_queue
    EngineCore.collective_rpc = _collective_rpc
    EngineCore._attach_weight_version = _attach_weight_version
    EngineCore.set_weight_version = _set_weight_version
    EngineCore.weightpub_driver_status = _weightpub_driver_status
    setattr(EngineCore, _PATCHED, True)


# ------------------------------------------------------------------ 2. worker init
def _patch_worker_init() -> None:
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    original = WorkerWrapperBase.initialize_from_config
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)  # keeps vLLM's signature visible (``vllm_compat`` reads it)
    def initialize_from_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        attach = getattr(getattr(self.worker, "weight_transfer_engine", None),
                         "attach_worker", None)
        if attach is not None:  # our backend needs the worker it serves
            attach(self.worker)
        started = getattr(self.worker, "_wp_started", None)
        if started is not None:  # only workers that carry our extension
            started()
        return out

    setattr(initialize_from_config, _PATCHED, True)
    WorkerWrapperBase.initialize_from_config = initialize_from_config


# ------------------------------------------------------------------ 3. execute_model
def wrap_execute_model(worker: Any, before_step: Callable[[Any], None]) -> None:
    """Run ``before_step(scheduler_output)`` at the start of each of ``worker``'s steps."""
    original = worker.execute_model  # bound method of the worker class

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        before_step(scheduler_output)
        return original(scheduler_output, *args, **kwargs)

    worker.execute_model = execute_model


def _expose_metrics() -> None:
    """In a replica's first process (the ``vllm serve`` front end, or an ``LLM`` user's):
    create the rank status board, exported to the engine and workers it spawns, and
    serve it in the default Prometheus registry, which ``/metrics`` exposes."""
    if StatusBoard.from_env() is not None:
        return  # a child of a process that already did this
    import prometheus_client

    prometheus_client.REGISTRY.register(ReplicaCollector(StatusBoard.create()))


def installed() -> dict[str, bool]:
    """Which of our hooks this process carries (tests: an untouched process has none)."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    return {
        "engine_core": bool(getattr(EngineCore, _PATCHED, False)),
        "worker_init": bool(getattr(WorkerWrapperBase.initialize_from_config, _PATCHED, False)),
        "slot_table": ENV in os.environ,
    }


def register() -> None:
    """vLLM plugin entry point: register the backends; patch only where weightpub is asked for.

    Idempotent and cheap: vLLM may call it more than once in a process.
    """
    try:
        import vllm.v1.engine.core  # noqa: F401
    except ImportError:  # pragma: no cover - vLLM without the v1 engine
        return
    ensure_backends()
    if asked_here():
        install()


def install() -> None:
    """Check vLLM and install every hook in this process (idempotent)."""
    check_vllm()
    _expose_metrics()
    _patch_engine_core()
    _patch_worker_init()
    found = _constructing_core()
    if found is not None:
        _setup(*found)
