"""Split a staged adapter version into its adapters (``weightpub_wire.adapters``).

Why: the manifest lists the adapters and names each tensor ``"<adapter>/<PEFT
name>"``; both replica modes (served, merged) want per adapter its config and its
PEFT-named tensors, copied out of staging (the staged buffer is reused once the
commit returns, while the adapter stays in use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from weightpub_wire.adapters import AdapterInfo, adapter_of

__all__ = ["AdapterVersion", "adapter_version"]


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """One adapter of a version: its wire config and its PEFT-named tensors (owned)."""

    info: AdapterInfo
    tensors: dict[str, torch.Tensor]
    version: int


def adapter_version(staged: Any) -> list[AdapterVersion] | None:
    """The adapters of ``staged`` (copied), or None for a version of model weights."""
    manifest = getattr(staged, "manifest", None)
    adapters = getattr(manifest, "adapters", None)
    if not adapters:
        return None
    per: dict[str, dict[str, torch.Tensor]] = {info.name: {} for info in adapters}
    for name, tensor in staged.tensors.items():
        owner, rest = adapter_of(name)  # checked when the manifest was decoded
        per[owner][rest] = tensor.clone()
    return [AdapterVersion(info, per[info.name], staged.version) for info in adapters]
