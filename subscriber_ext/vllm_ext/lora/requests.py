"""``adapter_request(name)``: the ``LoRARequest`` a client sends for a published adapter.

Why: vLLM requires a path on every ``LoRARequest``; a published adapter has none (its
tensors live in the replica's memory). The path given here is a placeholder that names
the adapter; the replica serves the published tensors for the request's *name* and
never loads from that path (``served.py``). The id is derived from the name, so every
client picks the same one without coordination (any id works for a published name).
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["PLACEHOLDER_SCHEME", "adapter_id", "adapter_request"]

PLACEHOLDER_SCHEME = "weightpub-adapter://"


def adapter_id(name: str) -> int:
    """A stable id in 1..2**31-1 for ``name`` (vLLM ids must be positive)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % ((1 << 31) - 1) + 1


def adapter_request(name: str, lora_id: int | None = None) -> Any:
    """A ``vllm.lora.request.LoRARequest`` for the published adapter ``name``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=adapter_id(name) if lora_id is None
                       else lora_id, lora_path=PLACEHOLDER_SCHEME + name)
