"""vLLM worker extension: subscribe to a publisher and keep the seed's weight-sync API.

Use as ``worker_extension_cls="subscriber_ext.worker_extension.BatchWeightSyncWorkerExtension"``.
vLLM mixes this class into its worker *after* the worker's own bases, so it may
only add names (vLLM asserts on a clash); everything here is prefixed ``_wp``
or is a public RPC name. Each method runs on every rank through
``collective_rpc``, between two steps (a worker serves RPCs and
``execute_model`` from one queue, in order).

Step-boundary commit: ``start_weight_subscriber`` replaces the worker's
``execute_model`` by an instance attribute that first runs the commit check
(see ``commit.py``). With ``vllm serve --additional-config
'{"weightpub": {"endpoint": "tcp://host:port", ...}}'`` the subscriber starts by
itself once the engine is ready (see ``_install_autostart_hook``).

Engine-driven commit (default once the ``weightpub`` vLLM plugin is installed):
the engine core creates a shared-memory slot table and names it in
``WEIGHTPUB_SLOTS``; each rank maps it at init and advertises its staged
versions there; the engine core commits (``commit_pending(version)``), resets
its prefix cache and tags outputs with the version before scheduling a step
(see ``engine_plugin.py``). Workers then never commit on their own and run no
per-step collective.

Fallback (plugin absent): the commit is decided here, at the start of
``execute_model`` (``commit.py``). A worker cannot reset the scheduler's prefix
cache (it lives in the engine core); after such a commit, requests that share a
cached prefix reuse KV computed with the old weights until the engine side calls
``llm.reset_prefix_cache()`` (or ``POST /reset_prefix_cache``).
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import socket
import threading
import time
from typing import Any

import torch

from publisher.errors import ApplyError, ConfigError

from .apply import WeightApplier, parse_dtype
from .commit import CommitCoordinator
from .communicator import WeightCommunicator
from .names import Target
from .shared_slots import SlotTable, SlotWriter
from .subscriber import WeightSubscriber
from .tensor_bytes import decode_many, decode_one

__all__ = ["BatchWeightSyncWorkerExtension"]

logger = logging.getLogger("weightpub.worker")

_EXT_OPTIONS = (
    "apply_mode", "keep", "subscriber_cls", "record_requests", "request_log_size", "prepare",
)


class _State:
    """Per-worker state, created lazily (the extension cannot define ``__init__``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.applier: WeightApplier | None = None
        self.apply_mode = "auto"
        self.prepare: bool | None = None  # None: on in reload mode (see _wp_coordinator)
        self.coordinator: CommitCoordinator | None = None
        self.subscriber: Any = None
        self.endpoint: str | None = None
        self.communicator: WeightCommunicator | None = None
        self.seed_pending: dict[str, tuple[Target, torch.Tensor]] = {}
        self.seed_tensors = 0
        self.hooked = False
        self.record_requests = True
        self.requests: collections.OrderedDict[str, list[int | None]] = collections.OrderedDict()
        self.request_log_size = 65536
        self.last_error: str | None = None
        self.step_check_s = 0.0
        self.slots: SlotTable | None = None  # engine-driven commit, see _wp_attach_slots
        self.slot_index = 0


class BatchWeightSyncWorkerExtension:
    """Worker extension adding subscription, step-boundary commit and the seed API."""

    # ------------------------------------------------------------ internals
    def _wp(self) -> _State:
        state = self.__dict__.get("_wp_state")
        if state is None:
            state = self.__dict__["_wp_state"] = _State()
        return state

    def _wp_applier(self) -> WeightApplier:
        st = self._wp()
        if st.applier is None:
            st.applier = WeightApplier(self.model_runner, self.vllm_config, st.apply_mode)
        return st.applier

    def _wp_groups(self) -> list[Any]:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return [get_tp_group().cpu_group, get_pp_group().cpu_group]

    def _wp_coordinator(self, keep: int = 2) -> CommitCoordinator:
        st = self._wp()
        if st.coordinator is None:
            applier = self._wp_applier()
            slot = SlotWriter(st.slots, st.slot_index) if st.slots is not None else None
            prepare = st.prepare if st.prepare is not None else applier.mode() == "reload"
            st.coordinator = CommitCoordinator(
                applier.apply, groups=self._wp_groups(), keep=keep, slot=slot,
                on_commit=self._wp_report_applied, on_failure=self._wp_report_failed,
                prepare=self._wp_prepare if prepare else None,
                apply_prepared=applier.swap if prepare else None,
                prepare_policy="always" if st.prepare else "auto",
            )
        return st.coordinator

    def _wp_prepare(self, staged: Any) -> Any:
        """Preparer thread: kernel-format shadows of ``staged`` (see ``prepare.py``)."""
        return self._wp_applier().prepare(
            staged.tensors, version=staged.version, publisher_id=staged.publisher_id
        )

    def _wp_report_applied(self, version: int) -> None:
        """Back-channel: tell the publisher this rank now runs ``version``."""
        sub = self._wp().subscriber
        if sub is not None and hasattr(sub, "mark_applied"):
            sub.mark_applied(version)

    def _wp_report_failed(self, version: int, error: str) -> None:
        sub = self._wp().subscriber
        if sub is not None and hasattr(sub, "mark_applied"):
            sub.mark_applied(0, error)

    def _wp_attach_slots(self) -> None:
        """Map the engine core's slot table (``WEIGHTPUB_SLOTS``), if the plugin made one.

        Called once at init, while the engine that spawned us is still constructing,
        so the variable names *our* engine's table even if the process hosts several.
        """
        from .shared_slots import ENV

        st = self._wp()
        value = os.environ.get(ENV)
        if not value or st.slots is not None:
            return
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp = get_tp_group()
            index = get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group
            table = SlotTable.from_env(value)
            if table is None or index >= table.nslots:
                raise ValueError(f"rank index {index} does not fit {value!r}")
        except (OSError, ValueError, AssertionError) as exc:
            logger.warning("weightpub: engine-driven commit unavailable (%s); worker-side", exc)
            return
        st.slots, st.slot_index = table, index

    def _wp_install_hook(self) -> None:
        st = self._wp()
        if st.hooked:
            return
        original = self.execute_model  # bound method of the worker class

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._wp_before_step(scheduler_output)
            return original(scheduler_output, *args, **kwargs)

        self.execute_model = execute_model  # instance attribute wins over the class method
        st.hooked = True

    def _wp_before_step(self, scheduler_output: Any) -> None:
        st = self._wp()
        t0 = time.perf_counter()
        if st.seed_pending:
            self._wp_flush_seed()
        coord = st.coordinator
        if coord is not None:
            coord.before_step()
            if st.record_requests:
                version = coord.applied_version
                reqs = st.requests
                for req_id in getattr(scheduler_output, "num_scheduled_tokens", ()) or ():
                    span = reqs.get(req_id)
                    if span is None:
                        reqs[req_id] = [version, version]
                        if len(reqs) > st.request_log_size:
                            reqs.popitem(last=False)
                    else:
                        span[1] = version
        st.step_check_s += time.perf_counter() - t0

    def _wp_autostart(self) -> None:
        """Start the subscriber named in ``additional_config["weightpub"]``, if any."""
        extra = getattr(self.vllm_config, "additional_config", None) or {}
        cfg = extra.get("weightpub") if isinstance(extra, dict) else None
        if not cfg:
            return
        if not isinstance(cfg, dict) or not isinstance(cfg.get("endpoint"), str):
            raise ConfigError("additional_config.weightpub.endpoint: expected a string")
        options = {k: v for k, v in cfg.items() if k != "endpoint"}
        self.start_weight_subscriber(cfg["endpoint"], **options)

    # --------------------------------------------------------- subscription
    def start_weight_subscriber(self, endpoint: str, **options: Any) -> dict[str, Any]:
        """Subscribe this rank to ``endpoint``; idempotent for the same endpoint.

        Extension options: ``apply_mode`` (auto|in_place|reload), ``keep`` (staged
        versions held per rank, default 2), ``prepare`` (build kernel-format weights
        on a background thread and only swap them in at commit; default: on in
        reload mode while the engine is busy, so a commit never stalls generation,
        and off while it is idle, where a direct reload is sooner; ``True`` always;
        costs one extra copy of the weights per rank), ``subscriber_cls``
        ("module:Class", default ``subscriber_ext.subscriber:WeightSubscriber``),
        ``record_requests``.
        Everything else goes to the subscriber.
        """
        st = self._wp()
        with st.lock:
            if st.subscriber is not None:
                if st.endpoint == endpoint:
                    return self.weight_version()
                self.stop_weight_subscriber()
            ext = {k: options.pop(k) for k in _EXT_OPTIONS if k in options}
            mode = ext.get("apply_mode", st.apply_mode)
            prepare = ext.get("prepare", st.prepare)
            prepare = None if prepare is None else bool(prepare)
            if st.applier is not None and mode != st.apply_mode:
                st.applier = None
                st.coordinator = None
            if st.coordinator is not None and prepare != st.prepare:
                st.coordinator.close()
                st.coordinator = None
            st.apply_mode = mode
            st.prepare = prepare
            st.record_requests = bool(ext.get("record_requests", True))
            st.request_log_size = int(ext.get("request_log_size", st.request_log_size))
            coord = self._wp_coordinator(keep=int(ext.get("keep", 2)))
            qual = ext.get("subscriber_cls", "subscriber_ext.subscriber:WeightSubscriber")
            module_name, _, cls_name = str(qual).partition(":")
            try:
                cls = getattr(importlib.import_module(module_name), cls_name)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"subscriber_cls: cannot import {qual!r}") from exc
            self._wp_install_hook()
            if cls is WeightSubscriber:
                options.setdefault("subscriber_id",
                                   f"{socket.gethostname()}-{os.getpid()}-rank{self.rank}")
            st.subscriber = cls(endpoint, on_version=coord.offer, **options)
            st.endpoint = endpoint
            logger.info("weightpub: rank %s subscribed to %s", self.rank, endpoint)
        return self._wp_status()

    def stop_weight_subscriber(self) -> None:
        """Close the subscriber; staged but uncommitted versions are dropped."""
        st = self._wp()
        with st.lock:
            if st.subscriber is not None:
                try:
                    st.subscriber.close()
                finally:
                    st.subscriber = None
                    st.endpoint = None
            if st.coordinator is not None:
                st.coordinator.close()

    def commit_pending(
        self, version: int | None = None, publisher_hash: int | None = None
    ) -> int | None:
        """Commit a staged version; returns this rank's applied version.

        ``version`` given (the engine-core driver): apply exactly that one, no
        collective. Not given: worker-side mode agrees on the newest version all
        ranks hold (collective); engine-driven mode does nothing here, because the
        engine core already committed before forwarding this RPC.
        """
        st = self._wp()
        if st.seed_pending:
            self._wp_flush_seed()
        if st.coordinator is None:
            return None
        if version is not None:
            return st.coordinator.commit_version(int(version), publisher_hash)
        if not st.coordinator.driven:
            st.coordinator.commit_now()
        return st.coordinator.applied_version

    def weight_version(self) -> dict[str, Any]:
        """Commit what is pending, then report this rank's state."""
        self.commit_pending()
        return self._wp_status()

    def weight_status(self) -> dict[str, Any]:
        """Report this rank's state without committing anything."""
        return self._wp_status()

    def _wp_status(self) -> dict[str, Any]:
        st = self._wp()
        coord = st.coordinator
        applier = st.applier
        report = applier.last_report if applier else None
        sub_status = None
        if st.subscriber is not None and hasattr(st.subscriber, "status"):
            try:
                sub_status = st.subscriber.status()
            except Exception as exc:
                sub_status = {"error": str(exc)}
        return {
            "rank": self.rank,
            "endpoint": st.endpoint,
            "applied_version": coord.applied_version if coord else None,
            "staged_version": coord.staged_version() if coord else None,
            "publisher_id": coord.publisher_id if coord else None,
            "last_error": (coord.last_error if coord else None) or st.last_error,
            "apply_mode": applier.mode() if applier else st.apply_mode,
            "last_apply_s": report.seconds if report else None,
            # the newest few: this dict crosses the RPC boundary on every poll
            "commits": list(coord.commit_log)[-16:] if coord else [],
            "commit_count": coord.commit_count if coord else 0,
            "prepare": coord.prepare_status() if coord else None,
            "step": coord.step if coord else 0,
            "step_check_s": st.step_check_s,
            "driven": bool(coord.driven) if coord else st.slots is not None,
            "collectives": coord.collectives if coord else 0,
            "seed_tensors": st.seed_tensors,
            "seed_pending": sorted(st.seed_pending),
            "subscriber": sub_status,
        }

    def weight_request_versions(self, req_ids: list[str] | None = None) -> dict[str, list]:
        """``req_id -> [first, last]`` applied version of the steps that ran it."""
        reqs = self._wp().requests
        if req_ids is None:
            return {k: list(v) for k, v in reqs.items()}
        return {k: list(reqs[k]) for k in req_ids if k in reqs}

    # --------------------------------------------------------------- seed API
    def init_communicator(
        self, host: str, port: int, world_size: int, client_device_uuid: str | None = None
    ) -> None:
        """Join the trainer's broadcast group (trainer = last rank); closes a stale one first."""
        st = self._wp()
        if st.communicator is not None:
            self.close_communicator()
        device = self.device if self.device is not None else torch.device("cpu")
        if device.type == "cuda" and client_device_uuid is not None:
            if client_device_uuid == str(torch.cuda.get_device_properties(device).uuid):
                raise RuntimeError(
                    "the trainer and this vLLM worker share a GPU; NCCL cannot broadcast "
                    "within one device"
                )
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank
        st.communicator = WeightCommunicator(host, int(port), rank, int(world_size), device)

    def close_communicator(self) -> None:
        st = self._wp()
        if st.communicator is not None:
            try:
                st.communicator.close()
            finally:
                st.communicator = None

    def _wp_receive(self, name: str, dtype: str, shape: Any) -> torch.Tensor:
        st = self._wp()
        if st.communicator is None:
            raise RuntimeError("communicator not initialized; call init_communicator first")
        device = st.communicator.device
        weight = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)
        st.communicator.broadcast(weight, src=st.communicator.client_rank)
        return weight

    def update_named_param(self, name: str, dtype: str, shape: Any) -> None:
        """Receive one tensor by broadcast and set it (``_direct_set_weight``)."""
        weight = self._wp_receive(name, dtype, shape)
        self._direct_set_weight(name, weight)

    def batch_update_named_params(self, params_list: list[tuple[str, str, Any]]) -> None:
        """Receive several tensors (``(name, dtype_str, shape)`` each, in order), then set them.

        Every tensor is received first (the trainer broadcasts them all), then all are
        checked and applied together: one bad tensor leaves the weights unchanged.
        """
        received = [(n, self._wp_receive(n, d, s)) for n, d, s in params_list]
        self._wp_set_many(received)

    def http_load_weight(self, **kwargs: Any) -> None:
        """Load one tensor sent as bytes: ``name``, ``dtype``, ``shape``, ``data``.

        ``data`` is raw bytes (or base64 str); tensors do not survive vLLM's IPC.
        See ``tensor_bytes`` for the accepted forms.
        """
        name, tensor = decode_one(kwargs)
        self._direct_set_weight(name, tensor)

    def http_load_weights(self, weights: Any) -> None:
        """Load tensors sent as bytes: a list of dicts/tuples (see ``tensor_bytes``)."""
        self._wp_set_many(decode_many(weights))

    def http_load_weights_batch(self, params: Any) -> None:
        """Load many tensors in one IPC call: checked together, applied together."""
        self._wp_set_many(decode_many(params))

    def _direct_set_weight(self, name: str, weight: torch.Tensor) -> None:
        """Write one checkpoint-named tensor into vLLM's (maybe fused, TP-sharded) parameter.

        In place mode: the parameter's own ``weight_loader`` with the shard id
        (q/k/v, 0/1), so TP slicing and GQA head replication are right. Reload
        mode (CPU backend, quantized): the tensor waits until its layer is
        complete and is applied by layerwise reload at the next flush (end of a
        batch call, next step, or ``commit_pending``).
        """
        self._wp_set_many([(name, weight)], flush=False)

    def _wp_set_many(self, named: list[tuple[str, torch.Tensor]], flush: bool = True) -> None:
        st = self._wp()
        applier = self._wp_applier()
        from .apply import TensorSpec

        checked = applier.check([TensorSpec.of(n, t) for n, t in named], whole_layers=False)
        st.seed_tensors += len(named)
        if applier.mode() == "in_place":
            applier.apply(named)
            return
        for (spec, target), (_, tensor) in zip(checked, named, strict=True):
            if target is not None:
                st.seed_pending[spec.name] = (target, tensor.to("cpu", copy=True))
        if flush:
            self._wp_flush_seed()

    def _wp_flush_seed(self) -> None:
        """Apply every complete layer among the seed tensors waiting for reload."""
        st = self._wp()
        applier = self._wp_applier()
        pending = st.seed_pending
        missing = applier.missing_parts(t for t, _ in pending.values())
        ready = [(n, x) for n, (t, x) in pending.items() if t.module_name not in missing]
        if not ready:
            return
        try:
            applier.apply(ready)
        except ApplyError as exc:
            st.last_error = str(exc)
            raise
        finally:
            for n, _ in ready:
                pending.pop(n, None)


def _install_autostart_hook() -> None:
    """Start ``additional_config["weightpub"]`` subscriptions without any RPC.

    vLLM 0.32 gives an extension no init hook (``WorkerBase.__init__`` does not
    call ``super().__init__`` and extensions may not override worker methods),
    but it imports this module in each worker process before building the
    worker. We wrap ``WorkerWrapperBase.initialize_from_config`` (run once, after
    the model is loaded and the KV cache is sized) to call ``_wp_autostart``.
    """
    try:
        from vllm.v1.worker.worker_base import WorkerWrapperBase
    except ImportError:  # pragma: no cover
        return
    original = WorkerWrapperBase.initialize_from_config
    if getattr(original, "_weightpub_hook", False):
        return

    def initialize_from_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        attach = getattr(self.worker, "_wp_attach_slots", None)
        if attach is not None:
            attach()
        start = getattr(self.worker, "_wp_autostart", None)
        if start is not None:
            start()
        return out

    initialize_from_config._weightpub_hook = True  # type: ignore[attr-defined]
    WorkerWrapperBase.initialize_from_config = initialize_from_config  # type: ignore[method-assign]


_install_autostart_hook()
