"""``WorkerOptions``: one rank's ``start_weight_subscriber`` options, declared once, checked once.

Why: ``start_weight_subscriber(endpoint, **options)`` (and the
``additional_config.weightpub`` section and vLLM's ``init_info`` that reach it) takes
the extension's own options (how and when to commit) beside the subscriber's, under
the same flat names. So ``WorkerOptions`` *is* ``SubscriberOptions`` plus the fields
below, one ``OptionSet``: each option is declared once, with its bound, default, unit
and doc, and checked the same (``ConfigError`` naming it) from every door, on every
rank, before anything starts.

What arrives from outside the process (``init_info``, ``--additional-config``) goes
through ``from_wire``: the Python-only options are refused there, ``subscriber_cls``
first, so no module is ever imported by a name that came over the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Self, get_args

from pydantic import Field, model_validator

from subscriber_ext.transport.subscriber_options import SubscriberKeywords, SubscriberOptions
from subscriber_ext.vllm_ext.apply.applier import ApplyMode
from subscriber_ext.vllm_ext.receive_choice import ReceiveMode
from weightpub_wire.option_set import MiB, unit

__all__ = ["DEFAULT_SOURCE", "CommitSettings", "WorkerKeywords", "WorkerOptions"]

DEFAULT_SOURCE = "subscriber_ext.transport.subscriber:WeightSubscriber"
LoraMode = Literal["auto", "serve", "merge"]
LORA_MODES: tuple[str, ...] = get_args(LoraMode)


@dataclass(frozen=True, slots=True)
class CommitSettings:
    """The options a rank's ``CommitCoordinator`` is built with: a change rebuilds it."""

    apply_mode: str
    keep: int
    prepare: bool | None
    prepare_while_arriving: bool
    #: bytes prepared shadows may hold on a rank (None: unbounded; 0: none prepared)
    prepare_budget_bytes: int | None = 0
    trim_heap: bool = True


class WorkerOptions(SubscriberOptions):
    """What ``start_weight_subscriber`` was asked for (its docstring says what each does)."""

    option_owner = "start_weight_subscriber"

    apply_mode: ApplyMode = Field(
        "auto", description="how tensors reach vLLM's parameters: in_place, reload, or auto "
                            "(chosen per model and backend)")
    keep: int = Field(2, ge=1, json_schema_extra=unit("versions"),
                      description="staged versions held per rank")
    prepare: bool | None = Field(
        None, description="build kernel-format weights off the step path and only copy them "
                          "in at commit (None: in reload mode while the engine is busy)")
    prepare_while_arriving: bool = Field(
        True, description="with prepare on, prepare each layer as soon as its bytes verify")
    prepare_budget_bytes: int | None = Field(
        None, ge=0, json_schema_extra=unit("bytes"),
        description="prepared shadows per rank (None: 0, none, or unbounded with "
                    "prepare=True)")
    trim_heap: bool = Field(
        True, description="after each commit, give the heap memory it freed back to the OS "
                          "(glibc malloc_trim)")
    mmap_threshold_bytes: int | None = Field(
        None, gt=0, le=32 * MiB, json_schema_extra=unit("bytes"),
        description="fix glibc's mmap threshold in this worker (None: glibc's dynamic "
                    "default)")
    record_requests: bool = Field(
        True, description="record which version each request was served with")
    request_log_size: int = Field(65536, ge=1, json_schema_extra=unit("requests"),
                                  description="requests remembered for that record")
    subscriber_cls: str = Field(
        DEFAULT_SOURCE, pattern=r"^[\w.]+:\w+$", json_schema_extra=unit("", python_only=True),
        description="'module:Class' of a VersionSource (a test stand-in); imported, so only "
                    "from Python, never from init_info or a file")
    node_staging: bool | None = Field(
        None, description="the ranks on one node share one subscription and staged copy "
                          "(None: when the replica has more than one rank)")
    receive: ReceiveMode = Field(
        "auto", description="slices: each rank fetches only the bytes its weight loaders "
                            "read, with its own receiver; whole: whole versions (node "
                            "staging as node_staging says); auto: slices when the replica "
                            "has more than one rank and every rank needs below 0.9x of a "
                            "version, else whole; without a local checkpoint's layout it "
                            "decides at the first version, once (weight_status()['receive'] "
                            "says which and why, per rank)")
    lora_mode: LoraMode = Field(
        "auto", description="LoRA adapter versions: serve them by name (an engine with "
                            "enable_lora), merge one into the base weights, or auto (serve "
                            "when the engine has LoRA enabled, else merge)")
    merge_adapter: str | None = Field(
        None, min_length=1, description="the adapter merged when a version holds several")

    @model_validator(mode="after")
    def _budget_for_prepare(self) -> Self:
        if self.prepare is True and self.prepare_budget_bytes == 0:
            raise ValueError("prepare_budget_bytes: 0 leaves nothing to prepare with "
                             "prepare=True; raise it or leave it unset (unbounded)")
        if self.receive == "slices" and self.node_staging:
            raise ValueError("node_staging: True stages whole versions per node; receive "
                             "'slices' gives every rank its own receiver (choose one)")
        if self.receive == "slices" and self.collective:
            raise ValueError("receive: 'slices' with collective=True; a rank's slices are "
                             "not served by collective yet (receive 'auto' chooses whole)")
        return self

    @property
    def subscriber(self) -> SubscriberOptions:
        """The subscriber's share of these options."""
        return SubscriberOptions(**self.given(SubscriberOptions.model_fields))

    @property
    def commit(self) -> CommitSettings:
        budget = self.prepare_budget_bytes
        if budget is None:
            budget = None if self.prepare is True else 0
        return CommitSettings(self.apply_mode, self.keep, self.prepare,
                              self.prepare_while_arriving, budget, self.trim_heap)


class WorkerKeywords(SubscriberKeywords, total=False):
    """``start_weight_subscriber``'s option keywords, for type checkers; a test holds it
    equal to ``WorkerOptions``' declaration."""

    apply_mode: ApplyMode
    keep: int
    prepare: bool | None
    prepare_while_arriving: bool
    prepare_budget_bytes: int | None
    trim_heap: bool
    mmap_threshold_bytes: int | None
    record_requests: bool
    request_log_size: int
    subscriber_cls: str
    node_staging: bool | None
    receive: ReceiveMode
    lora_mode: LoraMode
    merge_adapter: str | None
