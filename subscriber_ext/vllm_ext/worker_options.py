"""``WorkerOptions``: one rank's ``start_weight_subscriber`` options, as one checked object.

Why: ``start_weight_subscriber(endpoint, **options)`` (and the
``additional_config.weightpub`` YAML section that reaches it) mixes the
extension's own options (how and when to commit) with the subscriber's
(``SubscriberOptions``: transport, staging, peers). ``from_keywords`` splits them
by this class's fields, checks both (``ConfigError`` naming the keyword, the
same on every rank, before anything starts), and the result is passed whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from subscriber_ext.transport.subscriber_options import SubscriberOptions
from subscriber_ext.vllm_ext.apply.applier import APPLY_MODES
from weightpub_wire.errors import ConfigError

__all__ = ["DEFAULT_SOURCE", "CommitSettings", "WorkerOptions"]

DEFAULT_SOURCE = "subscriber_ext.transport.subscriber:WeightSubscriber"
LORA_MODES = ("auto", "serve", "merge")


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


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOptions:
    """What ``start_weight_subscriber`` was asked for (its docstring says what each does)."""

    apply_mode: str = "auto"
    keep: int = 2
    prepare: bool | None = None  # None: prepare while the engine is busy, in reload mode
    prepare_while_arriving: bool = True
    #: bytes of prepared shadows per rank; None: 0 (none: the commit writes the staged
    #: bytes into the live weights), or unbounded with ``prepare=True``
    prepare_budget_bytes: int | None = None
    #: after each commit, give the heap memory it freed back to the OS (glibc malloc_trim)
    trim_heap: bool = True
    #: fix glibc's mmap threshold in this worker (None: glibc's dynamic default)
    mmap_threshold_bytes: int | None = None
    record_requests: bool = True
    request_log_size: int = 65536
    subscriber_cls: str = DEFAULT_SOURCE  # "module:Class" of a ``VersionSource``
    node_staging: bool | None = None  # None: on when the replica has more than one rank
    #: LoRA adapter versions: "serve" them by name (engine with enable_lora), "merge" one
    #: into the base weights, "auto": serve when the engine has LoRA enabled, else merge
    lora_mode: str = "auto"
    merge_adapter: str | None = None  # the adapter merged when a version holds several
    subscriber: SubscriberOptions = field(default_factory=SubscriberOptions)

    def __post_init__(self) -> None:
        if self.apply_mode not in APPLY_MODES:
            raise ConfigError(f"apply_mode: expected one of {APPLY_MODES}, "
                              f"got {self.apply_mode!r}")
        for name in ("keep", "request_log_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: {value!r} is not a positive integer")
        for name in ("prepare_while_arriving", "record_requests", "trim_heap"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not true or false")
        for name in ("prepare", "node_staging"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not true, false or "
                                  "None (the default)")
        if self.lora_mode not in LORA_MODES:
            raise ConfigError(f"lora_mode: expected one of {LORA_MODES}, got {self.lora_mode!r}")
        if self.merge_adapter is not None and (not isinstance(self.merge_adapter, str)
                                               or not self.merge_adapter):
            raise ConfigError(f"merge_adapter: {self.merge_adapter!r} is not an adapter name")
        budget = self.prepare_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise ConfigError(f"prepare_budget_bytes: {budget!r} is not a number of bytes "
                              "(0 or more) or None")
        threshold = self.mmap_threshold_bytes
        if threshold is not None and (isinstance(threshold, bool)
                                      or not isinstance(threshold, int)
                                      or not 0 < threshold <= 32 << 20):
            raise ConfigError(f"mmap_threshold_bytes: {threshold!r} is not a number of bytes "
                              "in 1..32 MiB or None")
        if self.prepare is True and budget == 0:
            raise ConfigError("prepare_budget_bytes: 0 leaves nothing to prepare with "
                              "prepare=True; raise it or leave it unset (unbounded)")
        if not isinstance(self.subscriber_cls, str) or ":" not in self.subscriber_cls:
            raise ConfigError(f"subscriber_cls: {self.subscriber_cls!r} is not "
                              "'module:Class'")

    @classmethod
    def from_keywords(cls, **keywords: Any) -> WorkerOptions:
        """Split ``start_weight_subscriber``'s keywords: ours, and the subscriber's."""
        own = {name: keywords.pop(name) for name in list(keywords)
               if name in cls.__dataclass_fields__ and name != "subscriber"}
        return cls(**own, subscriber=SubscriberOptions.from_keywords(**keywords))

    @property
    def commit(self) -> CommitSettings:
        budget = self.prepare_budget_bytes
        if budget is None:
            budget = None if self.prepare is True else 0
        return CommitSettings(self.apply_mode, self.keep, self.prepare,
                              self.prepare_while_arriving, budget, self.trim_heap)
