"""Field readers that validate a decoded msgpack map before anything uses it.

Each reader names the offending field (``manifest.tensors[3].shape``) in the
``ProtocolError`` it raises, so a bad message is easy to trace to its sender.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from publisher.errors import ProtocolError

__all__ = [
    "MAX_NAME_LEN",
    "MAX_NDIM",
    "read_float",
    "read_int",
    "read_int_list",
    "read_list",
    "read_map",
    "read_name",
    "read_optional_str",
    "read_str",
]

MAX_NAME_LEN = 1024
MAX_NDIM = 16
U64_MAX = (1 << 64) - 1


def read_map(value: object, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{field}: expected a map, got {type(value).__name__}")
    return value


def _get(msg: Mapping[str, Any], key: str, field: str) -> Any:
    try:
        return msg[key]
    except KeyError:
        raise ProtocolError(f"{field}.{key}: missing") from None


def read_int(
    msg: Mapping[str, Any], key: str, field: str, *, lo: int = 0, hi: int = U64_MAX
) -> int:
    value = _get(msg, key, field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{field}.{key}: expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ProtocolError(f"{field}.{key}: {value} is outside [{lo}, {hi}]")
    return value


def read_float(msg: Mapping[str, Any], key: str, field: str) -> float:
    value = _get(msg, key, field)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{field}.{key}: expected a number, got {type(value).__name__}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ProtocolError(f"{field}.{key}: must be finite")
    return float(value)


def read_str(msg: Mapping[str, Any], key: str, field: str, *, max_len: int = MAX_NAME_LEN) -> str:
    value = _get(msg, key, field)
    if not isinstance(value, str):
        raise ProtocolError(f"{field}.{key}: expected a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise ProtocolError(f"{field}.{key}: longer than {max_len} characters")
    return value


def read_optional_str(
    msg: Mapping[str, Any], key: str, field: str, *, max_len: int = 4096
) -> str | None:
    if msg.get(key) is None:
        return None
    return read_str(msg, key, field, max_len=max_len)


def read_name(msg: Mapping[str, Any], key: str, field: str) -> str:
    """A tensor or model name: non-empty, bounded, printable, no control characters."""
    value = read_str(msg, key, field)
    if not value:
        raise ProtocolError(f"{field}.{key}: empty name")
    if not value.isprintable():
        raise ProtocolError(f"{field}.{key}: name {value[:64]!r} has control characters")
    return value


def read_list(msg: Mapping[str, Any], key: str, field: str, *, max_len: int) -> list[Any]:
    value = _get(msg, key, field)
    if not isinstance(value, list | tuple):
        raise ProtocolError(f"{field}.{key}: expected a list, got {type(value).__name__}")
    if len(value) > max_len:
        raise ProtocolError(f"{field}.{key}: {len(value)} entries, more than {max_len}")
    return list(value)


def read_int_list(
    msg: Mapping[str, Any], key: str, field: str, *, max_len: int, lo: int = 0, hi: int = U64_MAX
) -> list[int]:
    items = read_list(msg, key, field, max_len=max_len)
    for index, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
            raise ProtocolError(f"{field}.{key}[{index}]: expected an integer in [{lo}, {hi}]")
    return items
