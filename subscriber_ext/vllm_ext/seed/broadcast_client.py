"""Trainer side of the seed's broadcast path (``init_communicator`` + ``update_named_param``).

Why: tests and users need the counterpart of the worker extension: join the
group as the last rank and broadcast each tensor while the replica's workers
run ``update_named_param`` (or ``batch_update_named_params``) with the same
(name, dtype, shape) list. The RPC that triggers the workers must be issued
without waiting (the workers block in the broadcast until the trainer sends).

``send_packed`` moves a whole list in a few packed buckets (one broadcast each)
when the workers are given ``packed_specs(...)`` as ``batch_update_named_params``'s
list: same signature, a marker spec first (``seed.packing``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from subscriber_ext.vllm_ext.seed.communicator import WeightCommunicator
from subscriber_ext.vllm_ext.seed.packing import (
    DEFAULT_BUCKET_BYTES,
    layout,
    pack,
    packed_specs,
    parse_specs,
)

__all__ = ["BroadcastClient"]


class BroadcastClient:
    """Trainer member of the group: rank ``vllm_world_size`` of ``vllm_world_size + 1``."""

    def __init__(
        self,
        host: str,
        port: int,
        vllm_world_size: int,
        device: str = "cpu",
        timeout_s: float = 300.0,
    ) -> None:
        self.world_size = vllm_world_size + 1
        self.comm = WeightCommunicator(
            host, port, vllm_world_size, self.world_size, device=device, timeout_s=timeout_s
        )

    def send(self, tensor: torch.Tensor) -> None:
        """Broadcast one tensor (call in the same order as the worker side's list)."""
        self.comm.broadcast(tensor.contiguous(), src=self.comm.client_rank)

    def send_all(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, t in named:
            self.send(t)

    @staticmethod
    def packed_specs(named: Iterable[tuple[str, torch.Tensor]],
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[tuple[str, str, list[int]]]:
        """The ``params_list`` for the workers' ``batch_update_named_params`` (packed)."""
        return packed_specs(named, bucket_bytes)

    def send_packed(self, named: Iterable[tuple[str, torch.Tensor]],
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Broadcast ``named`` in packed buckets (workers got ``packed_specs`` of the same
        list, in the same order); returns the number of broadcasts."""
        pairs = list(named)
        size, specs = parse_specs(packed_specs(pairs, bucket_bytes))
        assert size is not None
        tensors = dict(pairs)
        buckets = layout(specs, size)
        for bucket in buckets:
            self.comm.broadcast(pack(bucket, tensors, self.comm.device), src=self.comm.client_rank)
        return len(buckets)

    def close(self) -> None:
        self.comm.close()
