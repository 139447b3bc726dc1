"""Per-worker state of the extension, and the typed surface a weight source must offer.

Why a separate object: vLLM mixes the extension into its worker class and never
calls an extension constructor, so the state is created lazily, once per
worker, and lives in ``worker.__dict__``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from subscriber_ext.observe.replica_metrics import RankMetrics
from subscriber_ext.vllm_ext.apply.applier import WeightApplier
from subscriber_ext.vllm_ext.apply.names import Target
from subscriber_ext.vllm_ext.apply.slice_plan import SlicePlan
from subscriber_ext.vllm_ext.commit.coordinator import CommitCoordinator, StagedLike
from subscriber_ext.vllm_ext.commit.shared_slots import SlotTable
from subscriber_ext.vllm_ext.lora.merged import AdapterMerger
from subscriber_ext.vllm_ext.lora.served import AdapterServer
from subscriber_ext.vllm_ext.receive_choice import ReceiveChoice
from subscriber_ext.vllm_ext.seed.communicator import WeightCommunicator
from subscriber_ext.vllm_ext.worker_options import WorkerOptions
from weightpub_wire.errors import WeightPubError

__all__ = ["StateAccess", "VersionSource", "VersionSourceFactory", "WorkerState"]


@runtime_checkable
class VersionSource(Protocol):
    """What a worker subscribes with (``WeightSubscriber``, or a test's stand-in)."""

    def status(self) -> dict[str, Any]:
        """A small JSON-able report (crosses the RPC boundary)."""
        ...

    def mark_applied(self, version: int, error: str | WeightPubError | None = None) -> None:
        """Back-channel: ``version`` is live here (0 with ``error``: it could not be)."""
        ...

    def close(self) -> None: ...


#: ``cls(endpoint, on_version=..., options=SubscriberOptions)``
VersionSourceFactory = Callable[..., VersionSource]
OnVersion = Callable[[StagedLike], None]


class WorkerState:
    """Everything one worker rank keeps for weightpub."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.applier: WeightApplier | None = None
        self.options = WorkerOptions()  # what start_weight_subscriber was last asked for
        self.coordinator: CommitCoordinator | None = None
        self.source: VersionSource | None = None
        self.endpoint: str | None = None
        self.communicator: WeightCommunicator | None = None
        self.seed_pending: dict[str, tuple[Target, torch.Tensor]] = {}
        self.seed_tensors = 0
        self.hooked = False
        self.requests: collections.OrderedDict[str, list[int | None]] = \
            collections.OrderedDict()
        self.last_error: str | None = None
        self.step_check_s = 0.0
        self.slots: SlotTable | None = None  # engine-driven commit, see _wp_attach_slots
        self.slot_index = 0
        self.metrics = RankMetrics()
        self.status_writer: threading.Thread | None = None
        #: LoRA adapter versions: served by name (kept for the worker's life: it wraps the
        #: LoRA manager's loader) or merged (rebuilt with the options)
        self.adapter_server: AdapterServer | None = None
        self.adapter_merger: AdapterMerger | None = None
        self.adapter_mode: str | None = None  # how the last adapter version was applied
        #: how this rank receives (``receive_choice.py``), its slice plans by layout key,
        #: and how often ``receive: auto`` fell back to whole versions, by cause
        self.receive: ReceiveChoice | None = None
        self.slice_plans: dict[str, SlicePlan] = {}
        self.receive_fallbacks: dict[str, int] = {}

    def record_step(self, scheduler_output: Any, version: int | None) -> None:
        """Remember, per request id, the first and last version its steps ran with."""
        reqs = self.requests
        for req_id in getattr(scheduler_output, "num_scheduled_tokens", ()) or ():
            span = reqs.get(req_id)
            if span is None:
                reqs[req_id] = [version, version]
                if len(reqs) > self.options.request_log_size:
                    reqs.popitem(last=False)
            else:
                span[1] = version


class StateAccess:
    """Base of the extension's mixins: the worker attributes they use, and the state."""

    # provided by vLLM's worker (annotations only: vLLM forbids clashing attributes)
    model_runner: Any
    vllm_config: Any
    rank: int
    device: Any

    def _wp(self) -> WorkerState:
        state = self.__dict__.get("_wp_state")
        if state is None:
            state = self.__dict__["_wp_state"] = WorkerState()
        return state

    def _wp_applier(self) -> WeightApplier:
        st = self._wp()
        if st.applier is None:
            st.applier = WeightApplier(self.model_runner, self.vllm_config,
                                       st.options.apply_mode)
        return st.applier
