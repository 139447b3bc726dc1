"""vLLM's ``ModuleSource`` and sources built on it for ``test_weight_source_publish``
(a module of its own so that vLLM is imported when those tests run, not at collection)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ModuleSource, layerwise_groups

__all__ = ["LyingAt", "ModuleSource", "Watched", "layerwise_groups"]


class Watched(ModuleSource):
    """vLLM's ``ModuleSource`` that counts the tensors it yielded that are still alive."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.live = 0
        self.most_live = 0
        self.yielded: list[str] = []

    def _gone(self) -> None:
        self.live -= 1

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().__iter__():
            copy = tensor.detach().clone()  # a fresh tensor, as a gather makes
            self.live += 1
            self.most_live = max(self.most_live, self.live)
            weakref.finalize(copy, self._gone)
            self.yielded.append(name)
            yield name, copy


class LyingAt(ModuleSource):
    """A source whose tensor ``name`` comes in another dtype than its metadata says: the
    publish fails at that tensor's group (as a rank whose gather dies there)."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        super().__init__(module)
        self.name = name

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().__iter__():
            yield name, tensor.double() if name == self.name else tensor
