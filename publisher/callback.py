"""``PublishCallback``: publish from a transformers ``Trainer`` (or any TRL trainer) in one line.

::

    trainer = Trainer(..., callbacks=[PublishCallback(publisher, every_n_steps=10)])

After every ``every_n_steps`` optimizer steps (``on_step_end``, so gradient
accumulation is already folded in) and once more when training ends, the model
is published. Only the world process zero publishes; the other ranks must run
the same callback (with ``publisher=None``) because gathering sharded weights
is a collective:

- FSDP2 / tensor parallel (``DTensor`` parameters): rank 0 ``publish(model)``,
  the others ``gather_full_tensors(model)`` at the same moment;
- DeepSpeed ZeRO-3 (partitioned parameters): every rank enters
  ``deepspeed.zero.GatheredParameters`` (all parameters at once, so each rank
  briefly holds the full model) and rank 0 publishes inside it;
- FSDP1 wrappers: refused with a clear error (the callback is handed the
  unwrapped module, whose state dict is not the model's); use FSDP2.

With a ``ShardedPublisher`` on every rank instead, every rank publishes its own
shard (no rank holds the whole model) and the version is ``global_step``, the
one number every rank agrees on.

This is the one module of ``publisher`` that imports transformers; ``import
publisher`` loads it only when ``PublishCallback`` is asked for.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from publisher.adapters import AdapterSpec
from publisher.sharded_publisher import ShardedPublisher
from publisher.sources.shard_owners import owner_ranks
from publisher.sources.streamed_copy import gather_full_tensors
from publisher.store.snapshot import WeightsLike
from publisher.weight_publisher import WeightPublisher
from weightpub_wire.errors import ConfigError

__all__ = ["PublishCallback"]

log = logging.getLogger("weightpub.publisher")


class PublishCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that publishes the model every N optimizer steps.

    ``publisher`` is the ``WeightPublisher`` on the world process zero and ``None``
    on every other rank, or every rank's own ``ShardedPublisher`` (versions are
    then ``global_step``). ``weights`` maps the model to what is published (default:
    the model itself, i.e. its ``state_dict()``; e.g. merge LoRA adapters here); it
    runs on every rank, so collectives inside it line up.
    ``step_as_version`` numbers versions by ``state.global_step``, so a resumed run
    keeps its numbers monotonic. ``published`` lists ``(global_step, version)``.
    ``adapter``: publish only the LoRA adapter of a PEFT model, as an adapter version
    (``publisher.adapters``): an ``AdapterSpec``, or a name (the config is then read from
    the model's ``peft_config`` of its active adapter); a ``WeightPublisher`` only.
    """

    def __init__(self, publisher: WeightPublisher | ShardedPublisher | None,
                 every_n_steps: int = 1, *,
                 publish_on_train_end: bool = True, step_as_version: bool = False,
                 weights: Callable[[torch.nn.Module], WeightsLike] | None = None,
                 adapter: AdapterSpec | str | None = None) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) \
                or every_n_steps < 1:
            raise ConfigError(f"every_n_steps: {every_n_steps!r} must be an int >= 1")
        if publisher is not None and not isinstance(publisher, (WeightPublisher,
                                                                 ShardedPublisher)):
            raise ConfigError(f"publisher: expected a WeightPublisher, a ShardedPublisher or "
                              f"None, got {type(publisher).__name__}")
        if adapter is not None and isinstance(publisher, ShardedPublisher):
            raise ConfigError("adapter: a ShardedPublisher publishes model shards; publish "
                              "adapters from a WeightPublisher on rank 0")
        self.adapter = adapter
        self.publisher = publisher
        self.every_n_steps = every_n_steps
        self.publish_on_train_end = publish_on_train_end
        self.step_as_version = step_as_version
        self.weights = weights
        self.published: list[tuple[int, int]] = []
        self._last_step = -1

    # ---------------------------------------------------------------- trainer events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and self.publisher is None:
            raise ConfigError("PublishCallback: the world process zero needs a WeightPublisher "
                              "(publisher=None is for the other ranks)")
        model = kwargs.get("model")
        if model is not None:
            _refuse_fsdp1(model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every_n_steps == 0:
            self._publish(state, kwargs.get("model"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.publish_on_train_end and state.global_step != self._last_step:
            self._publish(state, kwargs.get("model"))

    # ---------------------------------------------------------------- publishing
    def _publish(self, state: Any, model: torch.nn.Module | None) -> None:
        if model is None:
            raise ConfigError("PublishCallback: the trainer passed no model to the callback")
        step = int(state.global_step)
        self._last_step = step
        with _gathered(model):
            weights = model if self.weights is None else self.weights(model)
            if isinstance(self.publisher, ShardedPublisher):  # every rank, its own shard
                version = self.publisher.publish(_own_share(weights, self.publisher),
                                                 version=step)
            elif not state.is_world_process_zero:
                gather_full_tensors(weights)  # take part in the DTensor collectives
                return
            else:
                assert self.publisher is not None  # checked at on_train_begin
                version = self.publisher.publish(
                    weights, version=step if self.step_as_version else None,
                    adapter=None if self.adapter is None else _adapter_spec(self.adapter,
                                                                            model))
        self.published.append((step, version))
        log.info("published version %d at step %d", version, step)


def _adapter_spec(adapter: AdapterSpec | str, model: torch.nn.Module) -> AdapterSpec:
    """The spec given, or one named ``adapter`` from the PEFT model's active config."""
    if isinstance(adapter, AdapterSpec):
        return adapter
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        raise ConfigError(f"adapter {adapter!r}: the model has no peft_config; pass an "
                          "AdapterSpec")
    active = getattr(model, "active_adapter", None)
    key = active if isinstance(active, str) and active in configs else next(iter(configs))
    return AdapterSpec.from_peft(adapter, configs[key])


def _own_share(weights: Any, publisher: ShardedPublisher) -> Any:
    """What this rank publishes: DTensors (FSDP2, TP) as they are (each rank keeps what it
    owns of each gather); weights every rank holds whole (DDP, gathered ZeRO-3) split by
    ``owner_ranks``, so each rank serves its part and no name repeats across ranks."""
    if isinstance(weights, torch.nn.Module):
        items = list(weights.state_dict().items())
    elif isinstance(weights, Mapping):
        items = list(weights.items())
    else:
        return weights  # pairs or a WeightSource: this rank's own, as given
    if any(callable(getattr(tensor, "full_tensor", None)) for _, tensor in items):
        return weights
    owners = owner_ranks(items, publisher.world_size)
    return [(name, tensor) for name, tensor in items if owners[name] == publisher.rank]


def _is_zero3(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


@contextlib.contextmanager
def _gathered(model: torch.nn.Module) -> Iterator[None]:
    """DeepSpeed ZeRO-3: every rank gathers the partitioned parameters for the publish."""
    if not _is_zero3(model):
        yield
        return
    import deepspeed  # only present (and only needed) when the model is partitioned

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        yield


def _refuse_fsdp1(model: torch.nn.Module) -> None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ConfigError("PublishCallback: FSDP1 (FullyShardedDataParallel) wrappers are not "
                          "supported; use FSDP2 (fsdp_version: 2), whose DTensor "
                          "parameters are gathered on every rank")
