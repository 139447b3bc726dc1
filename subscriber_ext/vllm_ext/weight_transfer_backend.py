"""weightpub as a backend of vLLM's own weight-transfer API (receiver side).

``--weight-transfer-config '{"backend": "weightpub"}'`` (or ``LLM(...,
weight_transfer_config={"backend": "weightpub"})``) makes vLLM create this engine in
every worker; the plugin registered it (``commit/vllm_plugin.py``) and mixed our
worker extension into the worker (``commit/vllm_patches._setup``). It is a thin
adapter: subscribing, staging, preparing and the engine-driven commit are the
extension's (``start_weight_subscriber``); nothing is received *through* vLLM's
RPCs. What the framework's calls mean here:

* ``init_weight_transfer_engine({"endpoint": ..., "options": {...}})``: subscribe
  every rank (options as ``start_weight_subscriber``'s, each checked by its declaration
  in ``WorkerOptions``; the Python-only ones, ``subscriber_cls`` among them, refused).
  Without it, the ``--additional-config '{"weightpub": {"endpoint": ...}}'`` entry has already
  subscribed the replica at start.
* ``start_weight_update`` / ``finish_weight_update``: nothing to do. weightpub
  commits between two steps with requests running (the engine invalidates the
  prefix cache and tags outputs), so no ``/pause`` is needed; ``keep`` is
  harmless (frozen requests resume on the version live then, their spans show it).
* ``update_weights({"version": v, "publisher_id": ..., "timeout": s})``: returns
  when every rank runs version >= v, or raises naming each rank's state after
  ``timeout`` (at most ``MAX_TIMEOUT_S``). The engine core waits beside its step
  loop (``commit/update_waits.py``: requests and other RPCs are served meanwhile)
  and commits; where it cannot (an in-process engine core, or no engine driver,
  when the ranks agree here in lockstep) the wait holds the step loop at most
  ``BLOCKING_WAIT_S`` and the error says so. The version label outputs carry is
  the engine's committed version.

Why a mixin rather than our own copy: the extension already owns the worker
state, the hooks and the RPCs; the backend calls it (the worker reaches us
through ``attach_worker``, ``vllm_patches`` hook 2).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from subscriber_ext.vllm_ext.commit.update_waits import BLOCKING_WAIT_S, MAX_TIMEOUT_S
from subscriber_ext.vllm_ext.commit.vllm_plugin import BACKEND
from subscriber_ext.vllm_ext.rpc_replies import all_ranks_reply
from subscriber_ext.vllm_ext.worker_options import WorkerOptions
from weightpub_wire.errors import ConfigError, WeightPubTimeout

__all__ = ["WeightpubInitInfo", "WeightpubUpdateInfo", "WeightpubWeightTransferEngine"]

logger = logging.getLogger("weightpub.worker")
#: without the engine driver, ranks agree every POLL_S (a collective per round)
POLL_S = 0.01


@dataclass
class WeightpubInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s info: where to subscribe, and how."""

    endpoint: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint is not None and not isinstance(self.endpoint, str):
            raise ConfigError("weightpub init_info.endpoint: expected a string")
        if not isinstance(self.options, dict):
            raise ConfigError("weightpub init_info.options: expected a mapping")
        # every option checked by its declaration now; Python-only ones (subscriber_cls,
        # which names code to import) are refused before anything is imported
        WorkerOptions.from_wire(self.options, "weightpub init_info.options")


@dataclass
class WeightpubUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``' info: the version every rank must run when the call returns."""

    version: int
    publisher_id: str | None = None
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) \
                or self.version < 1:
            raise ConfigError(f"weightpub update_info.version: {self.version!r} is not an "
                              "integer >= 1")
        if not 0 < float(self.timeout) <= MAX_TIMEOUT_S:
            raise ConfigError(f"weightpub update_info.timeout: {self.timeout!r} is outside "
                              f"(0, {MAX_TIMEOUT_S:g}]")


class WeightpubWeightTransferEngine(WeightTransferEngine[WeightpubInitInfo,
                                                         WeightpubUpdateInfo]):
    """vLLM's receiver interface over the worker extension's subscription."""

    init_info_cls = WeightpubInitInfo
    update_info_cls = WeightpubUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._worker: Any = None

    def attach_worker(self, worker: Any) -> None:
        """The worker this engine serves (called once vLLM has initialised it)."""
        if not callable(getattr(worker, "start_weight_subscriber", None)):
            raise ConfigError(
                f"weight transfer backend {BACKEND!r} needs weightpub's worker extension; "
                f"worker_extension_cls={self.parallel_config.worker_extension_cls!r} is not "
                "(a subclass of) subscriber_ext.worker_extension.BatchWeightSyncWorkerExtension")
        self._worker = worker

    def _w(self) -> Any:
        if self._worker is None:
            raise ConfigError(
                f"weight transfer backend {BACKEND!r}: the worker is not attached, so "
                "weightpub's hooks are not installed in this process. vLLM loads plugins "
                "once per process and a forked engine inherits that: a process whose first "
                "vLLM engine did not ask for weightpub stays untouched. Set "
                "WEIGHTPUB_VLLM_PATCHES=1 (or VLLM_WORKER_MULTIPROC_METHOD=spawn)")
        return self._worker

    # ------------------------------------------------------------ vLLM's interface
    def init_transfer_engine(self, init_info: WeightpubInitInfo) -> None:
        """Subscribe this rank (every rank runs this; idempotent for the same endpoint)."""
        worker = self._w()
        extra = getattr(self.vllm_config, "additional_config", None) or {}
        configured = extra.get(BACKEND) if isinstance(extra, dict) else None
        base = dict(configured) if isinstance(configured, dict) else {}
        endpoint = init_info.endpoint or base.pop("endpoint", None)
        base.pop("endpoint", None)
        if not isinstance(endpoint, str):
            raise ConfigError(
                f"weight transfer backend {BACKEND!r}: no endpoint; pass init_info "
                '{"endpoint": "tcp://host:port"} or --additional-config '
                '\'{"weightpub": {"endpoint": "tcp://host:port"}}\'')
        options = {**base, **init_info.options}
        WorkerOptions.from_wire(options, "weightpub init_info.options")  # (with the file's)
        worker.start_weight_subscriber(endpoint, **options)

    def start_weight_update(self) -> None:
        """Nothing to prepare: versions are staged and prepared while the engine serves."""

    def finish_weight_update(self) -> None:
        """Nothing to finalise: ``update_weights`` returned only once the version is live."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's, without its device synchronize: our commit is synchronous on every
        device, and ``torch.accelerator.synchronize()`` raises on CPU.

        A failure is raised once, by the replica's last rank, naming every rank's
        (``rpc_replies``: vLLM's executor stops reading replies at the first error, and
        an error on every rank made each later RPC get the previous call's answers).
        The other ranks end their update session as vLLM's worker does on an error."""
        if self.receive_on_every_rank(update_info) is None:  # failed; the last rank raised
            worker = self._w()
            if hasattr(worker, "_weight_update_active"):
                worker._weight_update_active = False
            self.reset_weight_update_target()

    @all_ranks_reply
    def receive_on_every_rank(self, update_info: dict[str, Any]) -> bool:
        """``receive_weights`` on this rank; True once this rank runs the version."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()
        return True

    def receive_weights(self, update_info: WeightpubUpdateInfo) -> None:
        """Return when this rank runs version >= ``update_info.version``; else raise."""
        worker = self._w()
        st = worker._wp()
        if st.source is None:
            raise ConfigError(f"weight transfer backend {BACKEND!r}: rank {worker.rank} "
                              "follows no publisher; call init_weight_transfer_engine "
                              '({"endpoint": ...}) first')
        waited, held = update_info.timeout, ""
        if st.slots is None:  # no engine driver: the ranks agree here, in lockstep, holding
            waited = min(waited, BLOCKING_WAIT_S)  # the step loop: so only a short while
            if waited < update_info.timeout:
                held = (f" (without the engine driver a replica waits at most "
                        f"{BLOCKING_WAIT_S:g}s in update_weights: wait for it to stage the "
                        "version first, e.g. the trainer's wait_replicas)")
            for _ in range(max(1, int(waited / POLL_S))):
                if _reached(worker.commit_pending(), st, update_info):
                    break
                time.sleep(POLL_S)
        coord = st.coordinator
        if coord is not None and _reached(coord.applied_version, st, update_info):
            return
        status = worker._wp_status()
        raise WeightPubTimeout(
            f"weightpub: rank {worker.rank} runs version {status.get('applied_version')} "
            f"(staged {status.get('staged_version')}, publisher "
            f"{status.get('publisher_id')}), not >= {update_info.version}"
            + (f" of {update_info.publisher_id}" if update_info.publisher_id else "")
            + f" after {waited:g}s{held}; endpoint {status.get('endpoint')}; "
            f"last error: {status.get('last_error')}")

    def shutdown(self) -> None:
        """Stop following the publisher; the model keeps the version it runs."""
        worker = self._worker
        stop = getattr(type(worker), "stop_weight_subscriber", None) if worker else None
        if stop is None:
            return
        plain = getattr(stop, "__wrapped__", stop)  # no cross-rank exchange at teardown
        try:
            plain(worker)
        except Exception:
            logger.exception("weightpub: closing the subscriber failed")


def _reached(applied: object, st: Any, info: WeightpubUpdateInfo) -> bool:
    if not isinstance(applied, int) or applied < info.version:
        return False
    coord = st.coordinator
    return info.publisher_id is None or (coord is not None
                                         and coord.publisher_id == info.publisher_id)

