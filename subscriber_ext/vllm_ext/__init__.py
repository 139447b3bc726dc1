"""Everything that runs inside (or drives) vLLM; the rest of ``subscriber_ext`` imports no vLLM.

Layers (imports point down): ``worker_extension`` / ``seed_rpcs`` / ``weight_transfer_backend``
(the RPCs and vLLM's weight-transfer API) -> ``commit/`` (when every rank switches; the vLLM
patches and plugin) -> ``apply/`` (how tensors reach vLLM parameters) and ``seed/`` (the seed
API's parts) -> ``vllm_compat`` (the vLLM versions and internals we were written against).
"""
