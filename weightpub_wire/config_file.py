"""YAML config files validated by pydantic models; every failure names the file and the key.

Each side owns the schema of its options (``publisher.publisher_config``,
``subscriber_ext.transport.subscriber_config``, the application's replica/relay files),
each option declared once in an ``OptionSet`` (``weightpub_wire/option_set.py``);
this module only reads a file and turns validation errors into ``ConfigError``
such as ``configs/replica.yaml: replica.subscriber.window_mib: Input should be
greater than 0``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import ConfigError
from weightpub_wire.option_set import describe_errors

__all__ = [
    "StrictConfig", "check_endpoint", "load_yaml_as", "load_yaml_section", "validate_section",
]

M = TypeVar("M", bound=BaseModel)


class StrictConfig(BaseModel):
    """Unknown keys are errors, ``"5"`` is not a number (as for every ``OptionSet``); values
    are frozen once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def check_endpoint(value: str) -> str:
    """A pydantic field validator: the endpoint parses (the ``ConfigError`` says why not)."""
    parse_endpoint(value)
    return value


def validate_section(model: type[M], body: Any, where: str) -> M:
    """Validate one mapping; errors read ``<where>.<key path>: <problem>``."""
    try:
        return model.model_validate(body or {})
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, where)) from exc


def _read(path: Path, keys: list[str], kind: str | None) -> tuple[str, Any]:
    """The file's one top-level key and its body."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(raw, dict) or len(raw) != 1:
        raise ConfigError(f"{path}: expected exactly one top-level key: {', '.join(keys)}")
    (found, body), = raw.items()
    if found not in keys:
        raise ConfigError(f"{path}: unknown top-level key {found!r} (expected one of "
                          f"{', '.join(keys)})")
    if kind is not None and found != kind:
        raise ConfigError(f"{path}: is a {found!r} config, expected {kind!r}")
    return found, body


def _validate_file(path: Path, model: type[M], body: Any, key: str) -> M:
    try:
        return validate_section(model, body, key)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc.__cause__


def load_yaml_section(path: str | os.PathLike[str], kinds: Mapping[str, type[BaseModel]],
                      kind: str | None = None) -> BaseModel:
    """Load a YAML file whose one top-level key names its kind (``publisher:``, ...).

    ``kinds`` maps each accepted key to its model; ``kind`` restricts the file to one.
    """
    path = Path(path)
    found, body = _read(path, list(kinds), kind)
    return _validate_file(path, kinds[found], body, found)


def load_yaml_as(path: str | os.PathLike[str], key: str, model: type[M]) -> M:
    """Load a YAML file that must be a ``key:`` section of ``model``."""
    path = Path(path)
    _, body = _read(path, [key], key)
    return _validate_file(path, model, body, key)
