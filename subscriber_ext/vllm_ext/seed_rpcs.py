"""The seed API (``shared/seeds``): the RPC names and signatures users already call.

TRL-style broadcast (``init_communicator`` + ``update_named_param`` /
``batch_update_named_params``), bytes over RPC (``http_load_weight(s)``,
``http_load_weights_batch``) and ``_direct_set_weight``. Unlike the seed, every
write goes through ``WeightApplier``: checked first (name, shape, dtype from the
one allow-list), then applied through vLLM's own loaders, right at any TP size.
"""

from __future__ import annotations

from typing import Any

import torch

from subscriber_ext.vllm_ext.rpc_replies import all_ranks_reply
from subscriber_ext.vllm_ext.seed.communicator import WeightCommunicator
from subscriber_ext.vllm_ext.seed.packing import layout, parse_specs, unpack
from subscriber_ext.vllm_ext.seed.tensor_bytes import decode_many, decode_one
from subscriber_ext.vllm_ext.worker_state import StateAccess
from weightpub_wire.dtypes import parse_dtype
from weightpub_wire.errors import ApplyError, ConfigError

__all__ = ["SeedRpcs"]


class SeedRpcs(StateAccess):
    """Mixed into the worker extension; each method is a ``collective_rpc`` target."""

    @all_ranks_reply
    def init_communicator(
        self, host: str, port: int, world_size: int, client_device_uuid: str | None = None
    ) -> None:
        """Join the trainer's broadcast group (trainer = last rank); closes a stale one first."""
        st = self._wp()
        if st.communicator is not None:
            self.close_communicator()
        device = self.device if self.device is not None else torch.device("cpu")
        if device.type == "cuda" and client_device_uuid is not None:
            if client_device_uuid == str(torch.cuda.get_device_properties(device).uuid):
                raise ConfigError(
                    "the trainer and this vLLM worker share a GPU; NCCL cannot broadcast "
                    "within one device"
                )
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank
        st.communicator = WeightCommunicator(host, int(port), rank, int(world_size), device)

    @all_ranks_reply
    def close_communicator(self) -> None:
        st = self._wp()
        if st.communicator is not None:
            try:
                st.communicator.close()
            finally:
                st.communicator = None

    def _wp_receive(self, name: str, dtype: str, shape: Any) -> torch.Tensor:
        st = self._wp()
        if st.communicator is None:
            raise ConfigError("communicator not initialized; call init_communicator first")
        device = st.communicator.device
        dt = parse_dtype(dtype, field=f"tensor {name!r} dtype", error=ApplyError)
        weight = torch.empty(tuple(shape), dtype=dt, device=device)
        st.communicator.broadcast(weight, src=st.communicator.client_rank)
        return weight

    @all_ranks_reply
    def update_named_param(self, name: str, dtype: str, shape: Any) -> None:
        """Receive one tensor by broadcast and set it (``_direct_set_weight``)."""
        weight = self._wp_receive(name, dtype, shape)
        self._direct_set_weight(name, weight)

    @all_ranks_reply
    def batch_update_named_params(self, params_list: list[tuple[str, str, Any]]) -> None:
        """Receive several tensors (``(name, dtype_str, shape)`` each, in order), then set them.

        Every tensor is received first (the trainer broadcasts them all), then all are
        checked and applied together: one bad tensor leaves the weights unchanged.
        A list that starts with the packing marker (``seed.packing.packed_specs``) is
        received in a few packed buckets, one broadcast each, instead of one per tensor.
        """
        bucket_bytes, specs = parse_specs(params_list)  # every spec checked before receiving
        if bucket_bytes is None:
            received = [(n, self._wp_receive(n, str(d), s)) for n, d, s in specs]
        else:
            received = self._wp_receive_packed(specs, bucket_bytes)
        self._wp_set_many(received)

    def _wp_receive_packed(self, specs: Any, bucket_bytes: int) -> list[tuple[str, torch.Tensor]]:
        st = self._wp()
        if st.communicator is None:
            raise ConfigError("communicator not initialized; call init_communicator first")
        received: list[tuple[str, torch.Tensor]] = []
        for bucket in layout(specs, bucket_bytes):
            buffer = torch.empty(max(bucket.nbytes, 1), dtype=torch.uint8,
                                 device=st.communicator.device)
            st.communicator.broadcast(buffer, src=st.communicator.client_rank)
            received.extend(unpack(bucket, buffer))
        return received

    @all_ranks_reply
    def http_load_weight(self, **kwargs: Any) -> None:
        """Load one tensor sent as bytes: ``name``, ``dtype``, ``shape``, ``data``.

        ``data`` is raw bytes (or base64 str); tensors do not survive vLLM's IPC.
        See ``seed.tensor_bytes`` for the accepted forms.
        """
        name, tensor = decode_one(kwargs)
        self._direct_set_weight(name, tensor)

    @all_ranks_reply
    def http_load_weights(self, weights: Any) -> None:
        """Load tensors sent as bytes: a list of dicts/tuples (see ``seed.tensor_bytes``)."""
        self._wp_set_many(decode_many(weights))

    @all_ranks_reply
    def http_load_weights_batch(self, params: Any) -> None:
        """Load many tensors in one IPC call: checked together, applied together."""
        self._wp_set_many(decode_many(params))

    def _direct_set_weight(self, name: str, weight: torch.Tensor) -> None:
        """Write one checkpoint-named tensor into vLLM's (maybe fused, TP-sharded) parameter.

        In place mode: the parameter's own ``weight_loader`` with the shard id
        (q/k/v, 0/1), so TP slicing and GQA head replication are right. Reload
        mode (CPU backend, quantized): the tensor waits until its layer is
        complete and is applied by layerwise reload at the next flush (end of a
        batch call, next step, or ``commit_pending``).
        """
        self._wp_set_many([(name, weight)], flush=False)

    def _wp_set_many(self, named: list[tuple[str, torch.Tensor]], flush: bool = True) -> None:
        st = self._wp()
        applier = self._wp_applier()
        checked = applier.checked_tensors(named, whole_layers=False)
        st.seed_tensors += len(named)
        if applier.mode() == "in_place":
            applier.apply(named)
            return
        for spec, target, tensor in checked:  # checkpoint names (MoE experts: one per expert)
            if target is not None:
                st.seed_pending[spec.name] = (target, tensor.to("cpu", copy=True))
        if flush:
            self._wp_flush_seed()

    def _wp_flush_seed(self) -> None:
        """Apply every complete layer among the seed tensors waiting for reload."""
        st = self._wp()
        applier = self._wp_applier()
        pending = st.seed_pending
        missing = applier.missing_parts(t for t, _ in pending.values())
        ready = [(n, x) for n, (t, x) in pending.items() if t.module_name not in missing]
        if not ready:
            return
        try:
            applier.apply(ready)
        except ApplyError as exc:
            st.last_error = str(exc)
            raise
        finally:
            for n, _ in ready:
                pending.pop(n, None)
