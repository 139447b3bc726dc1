"""Trainer side of the seed's broadcast path (``init_communicator`` + ``update_named_param``).

Why: tests and users need the counterpart of the worker extension: join the
group as the last rank and broadcast each tensor while the replica's workers
run ``update_named_param`` (or ``batch_update_named_params``) with the same
(name, dtype, shape) list. The RPC that triggers the workers must be issued
without waiting (the workers block in the broadcast until the trainer sends).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from subscriber_ext.seed.communicator import WeightCommunicator

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

    def close(self) -> None:
        self.comm.close()
