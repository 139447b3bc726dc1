"""What marks a version as LoRA adapters: ``AdapterInfo`` on the manifest.

Why a wire field: a replica must know, before it applies anything, that a
version holds adapters (to serve under a name, or to merge into the base) and
with which rank, alpha and target modules; these come from the peer, so they
are checked and bounded like every other field.

An adapter version holds every adapter its publisher serves, each tensor named
``"<adapter name>/<PEFT name>"`` (``base_model.model....lora_A.weight``), so
conflation (a replica skipping to the newest version) never loses an adapter.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

import msgspec
from msgspec import Meta

__all__ = ["MAX_ADAPTERS", "MAX_LORA_RANK", "AdapterInfo", "adapter_of", "check_adapters"]

MAX_ADAPTERS = 64
MAX_LORA_RANK = 4096
MAX_TARGET_MODULES = 256
SEPARATOR = "/"

_NAME = r"^[A-Za-z0-9_.\-]{1,128}$"
AdapterName = Annotated[str, Meta(min_length=1, max_length=128, pattern=_NAME)]
ModuleName = Annotated[str, Meta(min_length=1, max_length=128, pattern=_NAME)]


class AdapterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One LoRA adapter of a version: its name (what requests use), rank, alpha, targets."""

    name: AdapterName
    rank: Annotated[int, Meta(ge=1, le=MAX_LORA_RANK)]
    alpha: float
    target_modules: Annotated[tuple[ModuleName, ...],
                              Meta(min_length=1, max_length=MAX_TARGET_MODULES)]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        # msgspec checks the annotations when decoding; a publisher builds one directly
        if not isinstance(self.name, str) or not re.match(_NAME, self.name):
            raise ValueError(f"name: {self.name!r} is not 1-128 of [A-Za-z0-9_.-]")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) \
                or not 1 <= self.rank <= MAX_LORA_RANK:
            raise ValueError(f"rank: {self.rank!r} is not an int in 1..{MAX_LORA_RANK} "
                             f"(adapter {self.name!r})")
        if not 1 <= len(self.target_modules) <= MAX_TARGET_MODULES or not all(
                isinstance(m, str) and re.match(_NAME, m) for m in self.target_modules):
            raise ValueError(f"target_modules: {list(self.target_modules)[:8]!r} is not 1.."
                             f"{MAX_TARGET_MODULES} module names (adapter {self.name!r})")
        if not math.isfinite(self.alpha) or not 0 < self.alpha <= 1e6:
            raise ValueError(f"alpha: {self.alpha!r} is not a number in (0, 1e6] "
                             f"(adapter {self.name!r})")

    @property
    def scale(self) -> float:
        """PEFT's scaling of ``B @ A``: alpha / r (alpha / sqrt(r) with rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def prefix(self) -> str:
        return self.name + SEPARATOR


def adapter_of(tensor_name: str) -> tuple[str, str]:
    """``"a/base_model...lora_A.weight"`` -> ``("a", "base_model...lora_A.weight")``."""
    name, sep, rest = tensor_name.partition(SEPARATOR)
    if not sep or not rest:
        raise ValueError(f"tensor {tensor_name!r} is not named '<adapter>/<name>'")
    return name, rest


def check_adapters(adapters: tuple[AdapterInfo, ...], tensor_names: list[str]) -> None:
    """Every tensor belongs to one listed adapter and is a LoRA A or B matrix; every
    adapter has tensors. Raises ``ValueError`` naming the field."""
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise ValueError(f"adapters: duplicate adapter names in {names}")
    counts = dict.fromkeys(names, 0)
    for index, tensor in enumerate(tensor_names):
        try:
            owner, rest = adapter_of(tensor)
        except ValueError as exc:
            raise ValueError(f"tensors[{index}].name: {exc}") from None
        if owner not in counts:
            raise ValueError(f"tensors[{index}].name: {tensor!r} names no listed adapter")
        if ".lora_A." not in rest and ".lora_B." not in rest:
            raise ValueError(f"tensors[{index}].name: {tensor!r} is not a lora_A/lora_B "
                             "weight")
        counts[owner] += 1
    empty = [n for n, c in counts.items() if not c]
    if empty:
        raise ValueError(f"adapters: {empty} have no tensors")
