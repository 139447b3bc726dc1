"""LoRA adapters as versions: what ``WeightPublisher.publish(..., adapter=...)`` sends.

Why: a trainer that trains LoRA adapters of a few MB should ship those, not a merged
model. An adapter version carries every adapter this publisher serves (the newest
tensors of each name, a host copy of a few MB kept here), so a replica that skips
versions (conflation) or joins late still gets every adapter; with one adapter, the
bytes on the wire are that adapter's.

Tensors are PEFT-named as ``save_pretrained`` writes them
(``base_model.model.<module>.lora_A.weight``); a PEFT model's in-memory names
(``.lora_A.default.weight``) are brought to that form. On the wire each is
``"<adapter>/<PEFT name>"`` (``weightpub_wire.adapters``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightpub_wire.adapters import MAX_ADAPTERS, AdapterInfo, check_adapters
from weightpub_wire.errors import ConfigError

__all__ = ["AdapterBook", "AdapterSpec", "adapter_tensors"]

_IN_MEMORY = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.[^.]+\.weight$")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSpec:
    """A LoRA adapter's name (the ``LoRARequest`` name requests use) and PEFT config."""

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @classmethod
    def from_peft(cls, name: str, config: Mapping[str, Any] | Any) -> AdapterSpec:
        """From a PEFT ``LoraConfig`` (or its dict: ``r``, ``lora_alpha``,
        ``target_modules``, optional ``use_rslora``)."""
        get = config.get if isinstance(config, Mapping) else \
            (lambda key, default=None: getattr(config, key, default))
        targets = get("target_modules")
        if isinstance(targets, str):
            raise ConfigError(f"adapter {name!r}: target_modules as a regex ({targets!r}) "
                              "is not supported; list the module names")
        rank = get("r")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ConfigError(f"adapter {name!r}: r {rank!r} is not an int")
        return cls(name=name, rank=rank, alpha=float(get("lora_alpha", rank)),
                   target_modules=tuple(sorted(targets or ())),
                   use_rslora=bool(get("use_rslora", False)))

    def info(self) -> AdapterInfo:
        """The wire form, checked (``ConfigError`` naming the field)."""
        try:
            return AdapterInfo(name=self.name, rank=self.rank, alpha=self.alpha,
                               target_modules=self.target_modules, use_rslora=self.use_rslora)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"adapter {self.name!r}: {exc}") from None


def adapter_tensors(weights: torch.nn.Module | Mapping[str, torch.Tensor]
                    | Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The LoRA A/B tensors of ``weights`` under their saved PEFT names.

    A PEFT model (or its ``state_dict()``) also holds the base weights; only the
    adapter's matrices are kept, in-memory names (``lora_A.default.weight``) made
    ``lora_A.weight``."""
    if isinstance(weights, torch.nn.Module):
        items: Iterable[tuple[str, torch.Tensor]] = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    out: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        saved = _IN_MEMORY.sub(r".\1.weight", name)
        if ".lora_A." in saved or ".lora_B." in saved:
            out[saved] = tensor.detach()
    if not out:
        raise ConfigError("adapter: no lora_A / lora_B tensors in the weights given")
    return out


class AdapterBook:
    """The newest tensors of every adapter a publisher serves; builds each version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._adapters: dict[str, tuple[AdapterInfo, dict[str, torch.Tensor]]] = {}

    def version(self, spec: AdapterSpec, weights: Any
                ) -> tuple[dict[str, torch.Tensor], tuple[AdapterInfo, ...]]:
        """Record ``spec``'s new tensors; return the version's tensors and adapters.

        The new adapter's tensors are copied to host memory (a few MB), so the caller
        may change them once ``publish`` returns and later versions still carry them."""
        info = spec.info()
        tensors = {name: t.to("cpu", copy=True).contiguous()
                   for name, t in adapter_tensors(weights).items()}
        with self._lock:
            if info.name not in self._adapters and len(self._adapters) >= MAX_ADAPTERS:
                raise ConfigError(f"adapter {info.name!r}: this publisher already serves "
                                  f"{MAX_ADAPTERS} adapters")
            book = dict(self._adapters)
            book[info.name] = (info, tensors)
            named = {f"{name}/{t}": tensor for name, (_, ts) in sorted(book.items())
                     for t, tensor in ts.items()}
            adapters = tuple(book[name][0] for name in sorted(book))
            try:
                check_adapters(adapters, list(named))
            except ValueError as exc:
                raise ConfigError(f"adapter {info.name!r}: {exc}") from None
            self._adapters = book
        return named, adapters

    @property
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)
