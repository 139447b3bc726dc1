"""Tensors as (name, dtype, shape, raw bytes): the seed's HTTP path payload.

Why: torch tensors do not reliably survive vLLM's msgpack IPC between the
engine and its workers, bytes do. Every field is checked before anything is
allocated: dtype must be a torch dtype name, shape a list of non-negative
ints, and the byte count must equal numel * itemsize.

Accepted forms (each function below takes any of them):

* dict ``{"name": str, "dtype": "torch.bfloat16" | "bfloat16", "shape": [..],
  "data": bytes | bytearray | memoryview | base64 str}`` (``"weight"`` or
  ``"bytes"`` may stand for ``"data"``);
* tuple ``(name, dtype, shape, data)``;
* tuple ``(name, torch.Tensor)`` when the transport did carry a tensor.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from weightpub_wire.dtypes import parse_dtype
from weightpub_wire.errors import ApplyError

__all__ = ["decode_many", "decode_one", "encode_tensor"]

_MAX_DIMS = 8


def encode_tensor(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """The dict form of one tensor (what a client sends)."""
    t = tensor.detach().contiguous().cpu()
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "data": data}


def _as_bytes(name: str, data: Any) -> bytes | bytearray | memoryview:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    if isinstance(data, str):
        try:
            return base64.b64decode(data, validate=True)
        except ValueError as exc:
            raise ApplyError(f"tensor {name!r}: data is not valid base64") from exc
    kind = type(data).__name__
    raise ApplyError(f"tensor {name!r}: data must be bytes or base64 str, got {kind}")


def _decode(name: Any, dtype: Any, shape: Any, data: Any) -> tuple[str, torch.Tensor]:
    if not isinstance(name, str) or not name:
        raise ApplyError(f"tensor name must be a non-empty str, got {name!r}")
    dt = parse_dtype(dtype, field=f"tensor {name!r} dtype", error=ApplyError)
    if not isinstance(shape, (list, tuple)) or len(shape) > _MAX_DIMS:
        raise ApplyError(f"tensor {name!r}: shape must be a list of at most {_MAX_DIMS} ints")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ApplyError(f"tensor {name!r}: shape {shape!r} must hold non-negative ints")
    raw = _as_bytes(name, data)
    itemsize = dt.itemsize
    want = math.prod(shape) * itemsize
    if len(raw) != want:
        raise ApplyError(
            f"tensor {name!r}: {len(raw)} bytes but dtype {dt} shape {tuple(shape)} needs {want}"
        )
    if want == 0:
        return name, torch.empty(tuple(shape), dtype=dt)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return name, flat.view(dt).reshape(tuple(shape))


def decode_one(item: Any) -> tuple[str, torch.Tensor]:
    """Decode one tensor in any accepted form."""
    if isinstance(item, Mapping):
        data = item.get("data", item.get("weight", item.get("bytes")))
        return _decode(item.get("name"), item.get("dtype"), item.get("shape"), data)
    if isinstance(item, (list, tuple)):
        if len(item) == 2 and isinstance(item[1], torch.Tensor):
            if not isinstance(item[0], str):
                raise ApplyError(f"tensor name must be a str, got {item[0]!r}")
            return item[0], item[1]
        if len(item) == 4:
            return _decode(*item)
    raise ApplyError(f"cannot decode a tensor from a {type(item).__name__}")


def decode_many(items: Iterable[Any] | Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Decode a list (or a name -> dict/tensor mapping) of tensors."""
    if isinstance(items, Mapping):
        out = []
        for name, value in items.items():
            if isinstance(value, torch.Tensor):
                out.append((name, value))
            elif isinstance(value, Mapping):
                out.append(decode_one({"name": name, **value}))
            else:
                raise ApplyError(f"tensor {name!r}: cannot decode a {type(value).__name__}")
        return out
    return [decode_one(i) for i in items]
