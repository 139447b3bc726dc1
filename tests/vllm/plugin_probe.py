"""A vLLM process started without any weightpub option: which of our hooks does it carry?

Run as ``python -m tests.vllm.plugin_probe MODEL_DIR`` (a fresh process, so no earlier
engine in the test process decides for it); prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def probe(worker: Any = None) -> dict[str, Any]:
    """What this process (a worker's, via ``collective_rpc``, or the front end) carries."""
    from subscriber_ext.vllm_ext.commit.vllm_patches import installed

    out: dict[str, Any] = dict(installed())
    out["pid"] = os.getpid()
    if worker is not None:
        out["extension"] = callable(getattr(worker, "start_weight_subscriber", None))
        out["weight_transfer_engine"] = type(getattr(worker, "weight_transfer_engine",
                                                     None)).__name__
    return out


def main(model_dir: str) -> None:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a callable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    llm = LLM(model=model_dir, dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
              max_num_seqs=4, gpu_memory_utilization=0.2, max_model_len=128)
    import prometheus_client
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from subscriber_ext.observe.replica_metrics import ReplicaCollector

    front = probe()
    front["replica_metrics"] = any(isinstance(c, ReplicaCollector) for c in
                                   list(prometheus_client.REGISTRY._collector_to_names))
    front["backend_registered"] = "weightpub" in WeightTransferEngineFactory._registry
    workers = llm.collective_rpc(probe)
    print(json.dumps({"front": front, "workers": workers}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
