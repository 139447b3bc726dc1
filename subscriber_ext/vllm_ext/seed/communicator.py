"""The seed's trainer <-> replica collective: NCCL on CUDA, gloo on CPU.

Why: users already drive ``init_communicator`` / ``update_named_param`` the TRL
way: the trainer joins a group with every vLLM worker as the *last* rank and
broadcasts each tensor. On GPUs that is vLLM's ``PyNcclCommunicator`` over a
``StatelessProcessGroup``; on the CPU backend a gloo group made by
``stateless_init_torch_distributed_process_group`` (the group's own
``broadcast`` is used: the functional API wants a global rank).

After each NCCL broadcast the stream it ran on is synchronized, as vLLM's own
NCCL weight-transfer engine does (``_post_send_sync``): the trainer may then
overwrite the tensor. No store barrier: vLLM's ``StatelessProcessGroup.barrier``
broadcasts a pickled id and leaves two keys per rank in the trainer's store, per
tensor. ``close`` destroys the NCCL communicator (``PyNcclCommunicator.destroy``)
and drops the store with it, so a trainer can re-initialise the group again and
again (``init_communicator`` after every replica restart) without leaking.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from weightpub_wire.errors import ClosedError

__all__ = ["WeightCommunicator"]


class WeightCommunicator:
    """One member of a trainer+workers broadcast group (``rank`` of ``world_size``)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self._nccl: Any = None
        self._gloo: Any = None
        if self.device.type == "cuda":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            pg = StatelessProcessGroup.create(
                host=host, port=port, rank=rank, world_size=world_size, store_timeout=int(timeout_s)
            )
            self._nccl = PyNcclCommunicator(pg, device=self.device)
        else:
            from vllm.distributed.utils import stateless_init_torch_distributed_process_group

            self._gloo = stateless_init_torch_distributed_process_group(
                host, port, rank, world_size, backend="gloo", timeout=timedelta(seconds=timeout_s)
            )

    @property
    def client_rank(self) -> int:
        """The trainer's rank (TRL convention: the last one)."""
        return self.world_size - 1

    def _group(self) -> Any:
        if self._nccl is None and self._gloo is None:
            raise ClosedError("the broadcast communicator is closed")
        return self._gloo

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` in place from ``src`` to every member."""
        gloo = self._group()
        if self._nccl is not None:
            stream = torch.cuda.current_stream(self.device)
            self._nccl.broadcast(tensor, src=src, stream=stream)
            stream.synchronize()  # this stream only: the tensor is free (or filled) now
            return
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        gloo.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        gloo = self._group()
        if self._nccl is not None:
            self._nccl.group.barrier()
        else:
            gloo.barrier().wait()

    def close(self) -> None:
        """Tear the group down (idempotent): the communicator, its threads and sockets,
        and, on the trainer (rank 0 of the store), the store's server."""
        nccl, self._nccl = self._nccl, None
        gloo, self._gloo = self._gloo, None
        if nccl is not None:
            destroy = getattr(nccl, "destroy", None)  # vLLM >= 0.32; aborts, bounded
            if destroy is not None:
                destroy()
            nccl.group = None  # the StatelessProcessGroup and its TCPStore
        if gloo is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(gloo)
