"""Shared engines for the vLLM tests (starting one costs 15-25 s on 2 cores)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # no shutdown warnings into closed streams
