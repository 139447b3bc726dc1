"""The dtypes allowed on the wire, by name.

An allow-list, never ``getattr(torch, name)``: a name read from the network
must not be able to reach arbitrary attributes of the torch module.
"""

from __future__ import annotations

import torch

from weightpub_wire.errors import ProtocolError, WeightPubError

__all__ = ["DTYPE_BY_NAME", "dtype_from_name", "dtype_name", "itemsize", "parse_dtype"]


def _optional(name: str) -> dict[str, torch.dtype]:
    dtype = getattr(torch, name, None)
    return {name: dtype} if isinstance(dtype, torch.dtype) else {}


DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    **_optional("uint16"),
    **_optional("uint32"),
    **_optional("uint64"),
    **_optional("float8_e4m3fn"),
    **_optional("float8_e4m3fnuz"),
    **_optional("float8_e5m2"),
    **_optional("float8_e5m2fnuz"),
    **_optional("float8_e8m0fnu"),
}

_NAME_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}


def dtype_from_name(name: object, *, field: str = "dtype",
                    error: type[WeightPubError] = ProtocolError) -> torch.dtype:
    """Map a dtype name (``"bfloat16"`` or ``"torch.bfloat16"``) to a torch dtype.

    Names outside the allow-list raise ``error`` (``ProtocolError`` for the
    wire; callers reading RPC input pass ``ApplyError``) naming ``field``.
    """
    if not isinstance(name, str):
        raise error(f"{field}: expected a dtype name string, got {type(name).__name__}")
    key = name.removeprefix("torch.")
    try:
        return DTYPE_BY_NAME[key]
    except KeyError:
        allowed = ", ".join(sorted(DTYPE_BY_NAME))
        raise error(f"{field}: unsupported dtype {name!r} (allowed: {allowed})") from None


def parse_dtype(value: object, *, field: str = "dtype",
                error: type[WeightPubError] = ProtocolError) -> torch.dtype:
    """A ``torch.dtype`` (allow-listed) or its name; the one entry for every input path."""
    if isinstance(value, torch.dtype):
        if value not in _NAME_BY_DTYPE:
            raise error(f"{field}: dtype {value} is not allowed")
        return value
    return dtype_from_name(value, field=field, error=error)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; dtypes outside the allow-list raise ``ValueError``."""
    try:
        return _NAME_BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be published (not in the allow-list)") from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return torch.empty((), dtype=dtype).element_size()
