"""Which vLLM this package was written against, checked at start instead of hoped.

weightpub reaches into vLLM internals (the engine core's step, its prefix
cache, the worker wrapper's init, layerwise reload metadata, the fused layers'
bookkeeping). ``check_vllm()`` verifies the installed version and that every
internal listed in ``INTERNALS`` exists with the parameters we call it with; a
mismatch raises ``ConfigError`` naming the supported range and the missing
internal. ``WEIGHTPUB_ALLOW_UNTESTED_VLLM=1`` turns the error into a warning
for people trying a newer vLLM. ``docs/vllm-internals.md`` says why each
internal is touched.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
from dataclasses import dataclass

from weightpub_wire.errors import ConfigError

__all__ = ["ALLOW_ENV", "INTERNALS", "SUPPORTED_VLLM", "Internal", "check_vllm", "problems"]

logger = logging.getLogger("weightpub.vllm")

#: Inclusive lower, exclusive upper (major, minor) of the vLLM releases we support.
SUPPORTED_VLLM = ((0, 32), (0, 34))
ALLOW_ENV = "WEIGHTPUB_ALLOW_UNTESTED_VLLM"


@dataclass(frozen=True)
class Internal:
    """``module:qualname`` must exist; if ``params`` is given, its signature starts so."""

    module: str
    qualname: str
    params: tuple[str, ...] | None = None
    why: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"


_CORE = "vllm.v1.engine.core"
_RELOAD = "vllm.model_executor.model_loader.reload"
_MOE = "vllm.model_executor.layers.fused_moe"
INTERNALS: tuple[Internal, ...] = (
    Internal(_CORE, "EngineCore.__init__", ("self", "vllm_config"), "create the slot table"),
    Internal(_CORE, "EngineCore.step", ("self",), "commit before a step is scheduled"),
    Internal(_CORE, "EngineCore.step_with_batch_queue", ("self",), "same, with a batch queue"),
    Internal(_CORE, "EngineCore.collective_rpc", ("self", "method", "timeout", "args", "kwargs"),
             "commit before our RPCs; the engine's commit RPC"),
    Internal(_CORE, "EngineCoreProc._invoke_utility_method",
             ("name", "get_result", "output", "enqueue_output"),
             "a utility call that returns a Future is answered when it is done "
             "(update_weights waits beside the step loop)"),
    Internal(_CORE, "EngineCore._attach_weight_version", ("self", "outputs"),
             "tag outputs with the weight version"),
    Internal(_CORE, "EngineCore.is_sleeping", ("self",), "no commit while asleep"),
    Internal(_CORE, "EngineCore.set_weight_version", ("self", "weight_version"),
             "keep the label on the committed version (weightpub backend)"),
    Internal("vllm.distributed.weight_transfer.factory",
             "WeightTransferEngineFactory.register_engine",
             ("name", "module_path_or_cls", "class_name"),
             "register the weightpub receiver backend"),
    Internal("vllm.distributed.weight_transfer.factory",
             "WeightTransferTrainerFactory.register_engine",
             ("name", "module_path_or_cls", "class_name"),
             "register the weightpub trainer backend"),
    Internal("vllm.distributed.weight_transfer.base", "WeightTransferEngine.update_weights",
             ("self", "update_info"), "the receiver backend replaces it (no CPU synchronize)"),
    Internal("vllm.v1.engine", "EngineCoreRequestType.WAKEUP", None,
             "wake an idle engine core's input queue when a rank can commit"),
    Internal("vllm.v1.worker.worker_base", "WorkerWrapperBase.initialize_from_config",
             ("self", "kv_cache_configs"), "attach slots and autostart once the model is up"),
    Internal("vllm.v1.core.sched.scheduler", "Scheduler.reset_prefix_cache",
             ("self", "reset_running_requests", "reset_connector"), "idle prefix-cache reset"),
    Internal("vllm.v1.core.block_pool", "BlockPool.evict_blocks", ("self", "block_ids"),
             "drop block hashes computed with old weights"),
    Internal(f"{_RELOAD}.layerwise", "LAYERWISE_INFO", None, "pre-repack parameter metadata"),
    Internal(f"{_RELOAD}.layerwise", "get_layerwise_info", None, "metadata of one layer"),
    Internal(f"{_RELOAD}.meta", "CopyCounter", None, "prove a loader wrote the shadow"),
    Internal(f"{_RELOAD}.sanitize", "layer_ref_sentinel", None, "rebind loaders to shadows"),
    Internal("vllm.model_executor.layers.attention", "is_deferred_attention_layer", None,
             "skip attention layers when preparing"),
    Internal("vllm.model_executor.model_loader.weight_utils", "default_weight_loader", None,
             "load parameters without their own loader"),
    Internal("vllm.model_executor.models.utils", "is_pp_missing_parameter", None,
             "tensors owned by another PP stage"),
    Internal(f"{_MOE}.routed_experts", "RoutedExperts.get_expert_mapping",
             ("self", "ckpt_gate_proj_name", "ckpt_down_proj_name", "ckpt_up_proj_name",
              "include_fused"), "where each checkpoint expert tensor goes"),
    Internal(f"{_MOE}.routed_experts", "RoutedExperts.weight_loader",
             ("self", "param", "loaded_weight", "weight_name", "shard_id", "expert_id",
              "return_success"), "load one expert (TP slicing, EP placement)"),
    Internal(f"{_MOE}.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod", None,
             "MoE kernels re-packed on reprocessing (moe_kernel reset)"),
    Internal(f"{_MOE}.modular_kernel", "FusedMoEExperts.process_weights_after_loading",
             ("self", "layer"), "which experts kernels re-pack weights"),
    Internal(f"{_MOE}.oracle.unquantized", "UnquantizedMoeBackend", None,
             "MoE backends whose live weights are in checkpoint layout"),
    Internal("vllm.distributed.parallel_state", "get_tp_group", None, "rank within the replica"),
    Internal("vllm.distributed.parallel_state", "get_world_group", None,
             "every RPC's failure exchange on the world CPU group (rpc_replies.py)"),
    Internal("vllm.v1.worker.worker_base", "WorkerBase.__init__",
             ("self", "vllm_config", "local_rank", "rank", "distributed_init_method"),
             "node staging: the engine's rendezvous address names the replica's node channel"),
    Internal("vllm.distributed.utils", "stateless_init_torch_distributed_process_group", None,
             "the seed API's gloo group"),
    # LoRA adapters as versions (``vllm_ext/lora/``, issue 32)
    Internal("vllm.lora.worker_manager", "WorkerLoRAManager._load_adapter",
             ("self", "lora_request"), "served adapters: built from memory, by name"),
    Internal("vllm.lora.worker_manager", "WorkerLoRAManager.add_adapter",
             ("self", "adapter_request"), "reload a committed adapter under its ids"),
    Internal("vllm.lora.worker_manager", "WorkerLoRAManager.list_adapters", ("self",),
             "which adapter ids are loaded"),
    Internal("vllm.lora.lora_model", "LoRAModel.from_lora_tensors",
             ("lora_model_id", "tensors", "peft_helper", "device", "dtype"),
             "an adapter from tensors held in memory, no files"),
    Internal("vllm.lora.peft_helper", "PEFTHelper.from_dict", ("config_dict",),
             "an adapter's config from the manifest's AdapterInfo"),
    Internal("vllm.lora.peft_helper", "PEFTHelper.validate_legal", ("self", "lora_config"),
             "the engine's LoRA limits (rank, modules) checked before loading"),
    Internal("vllm.lora.utils", "parse_fine_tuned_lora_name", ("name", "weights_mapper"),
             "each adapter tensor's module, as vLLM reads a directory"),
    Internal("vllm.lora.request", "LoRARequest", None, "requests by adapter name and id"),
)


def _version_tuple(text: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _resolve(internal: Internal) -> object:
    obj: object = importlib.import_module(internal.module)
    for part in internal.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def problems() -> list[str]:
    """Every way the installed vLLM differs from what weightpub was written against."""
    import vllm

    found: list[str] = []
    version = _version_tuple(getattr(vllm, "__version__", ""))
    lo, hi = SUPPORTED_VLLM
    if version is None or not lo <= version < hi:
        found.append(f"vLLM {getattr(vllm, '__version__', '?')} is outside the supported "
                     f"range >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}")
    for internal in INTERNALS:
        try:
            obj = _resolve(internal)
        except (ImportError, AttributeError):
            found.append(f"{internal.name} is missing ({internal.why})")
            continue
        if internal.params is None:
            continue
        try:
            names = tuple(inspect.signature(obj).parameters)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            found.append(f"{internal.name} has no inspectable signature")
            continue
        if names[: len(internal.params)] != internal.params:
            found.append(f"{internal.name} takes {names}, expected {internal.params} first "
                         f"({internal.why})")
    return found


_checked: list[str] | None = None


def check_vllm() -> None:
    """Raise ``ConfigError`` (or warn, with ``WEIGHTPUB_ALLOW_UNTESTED_VLLM=1``) on a mismatch.

    Runs once per process; cheap afterwards.
    """
    global _checked
    if _checked is None:
        _checked = problems()
    if not _checked:
        return
    lo, hi = SUPPORTED_VLLM
    text = (f"weightpub supports vLLM >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}; "
            + "; ".join(_checked))
    if os.environ.get(ALLOW_ENV, "") == "1":
        logger.warning("%s (continuing: %s=1)", text, ALLOW_ENV)
        return
    raise ConfigError(f"{text}. Set {ALLOW_ENV}=1 to try anyway.")
