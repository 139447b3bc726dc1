"""``OptionSet``: each option declared once, and every door checks it by that declaration.

An option is one pydantic field of an ``OptionSet`` subclass: its name, type, default,
bound (``Field(ge=, gt=, le=)``), doc (``description=``) and unit
(``json_schema_extra=unit(...)``) are written there and nowhere else. The doors:

* keywords (``WeightPublisher(chunk_size=...)``): ``from_keywords``, or the class
  itself; a bad value is a ``ConfigError`` naming the keyword and the bound;
* YAML sections (``weightpub_wire.config_file``): the same model with its file-only
  keys added; a field may also be spelt in a larger unit there (``window_mib`` for
  ``window_bytes``: ``unit("bytes", yaml="window_mib")``), converted before the same
  check, and the error names the key as written;
* a mapping from the network (vLLM's ``init_info``, ``--additional-config``):
  ``from_wire``, which also refuses the ``python_only`` options (objects, code names);
* the docs and the CLI (``weightpub options``): ``describe``.

Strict everywhere: ``True`` is not an integer and ``"5"`` not a number, whether it came
from Python, YAML or JSON (all three give Python's own types).
"""

from __future__ import annotations

import copy
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError, PydanticUndefined

from weightpub_wire.errors import ConfigError

__all__ = ["KiB", "MiB", "GiB", "OptionSet", "declared", "describe_errors", "unit"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: the larger units a YAML spelling may use (``window_mib`` -> ``window_bytes``)
YAML_FACTORS = {"mib": MiB, "gib": GiB}


def unit(name: str, *, yaml: str | None = None, zero_is_none: bool = False,
         python_only: bool = False) -> dict[str, Any]:
    """A field's ``json_schema_extra``: its unit, its YAML spelling, where it may come from.

    ``yaml``: the key a file uses instead, in the unit its suffix names (``_mib``,
    ``_gib``); ``zero_is_none``: 0 there means None (``chunk_mib: 0``: adaptive).
    ``python_only``: an object or a code name, refused from files and the network.
    """
    extra: dict[str, Any] = {"unit": name}
    if yaml is not None:
        suffix = yaml.rsplit("_", 1)[-1]
        if suffix not in YAML_FACTORS:
            raise ValueError(f"{yaml}: a YAML spelling ends in one of {sorted(YAML_FACTORS)}")
        extra["yaml"] = yaml
        extra["zero_is_none"] = zero_is_none
    if python_only:
        extra["python_only"] = True
    return extra


def _extra(info: FieldInfo) -> dict[str, Any]:
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def describe_errors(exc: ValidationError, where: str = "") -> str:
    """``<where>.<key>: <problem> (got <value>)`` for each error."""
    return "; ".join(_one_error(err, where) for err in exc.errors())


def _one_error(err: ErrorDetails, where: str) -> str:
    msg = err["msg"].removeprefix("Value error, ")
    key = ".".join(p for p in [where, *(str(p) for p in err["loc"])] if p)
    got = "" if not err["loc"] or err["type"] in ("missing", "extra_forbidden") \
        or not _scalar(err.get("input")) else f" (got {err.get('input')!r})"
    return f"{key}: {msg}{got}" if key else f"{msg}{got}"


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


class OptionSet(BaseModel):
    """A group of options, each declared once (see the module docstring); frozen, strict."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True,
                              arbitrary_types_allowed=True)
    #: what the keywords build, for messages ("WeightSubscriber: unknown option ...")
    option_owner: ClassVar[str] = ""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(describe_errors(exc)) from exc

    # pydantic's own ``model_validate`` (YAML, nested models) keeps its ValidationError with
    # each error's location; only a call from Python turns it into ``ConfigError`` here
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @model_validator(mode="before")
    @classmethod
    def _paths_as_text(cls, data: Any) -> Any:
        """A file or folder given as a ``pathlib.Path`` (any ``os.PathLike``) is its text:
        strict checking would refuse it, and Python callers pass paths."""
        if isinstance(data, Mapping) and any(isinstance(v, os.PathLike) for v in data.values()):
            return {k: os.fspath(v) if isinstance(v, os.PathLike) else v
                    for k, v in data.items()}
        return data

    # -- the doors ------------------------------------------------------------------------------
    @classmethod
    def from_keywords(cls, **keywords: Any) -> Self:
        """Keyword arguments as given to the API: unknown names and bad values are refused."""
        unknown = set(keywords) - set(cls.model_fields)
        if unknown:
            owner = cls.option_owner or cls.__name__
            raise ConfigError(f"{owner}: unknown option(s) {sorted(unknown)} (known: "
                              f"{sorted(cls.model_fields)})")
        return cls(**keywords)

    @classmethod
    def from_wire(cls, body: object, where: str) -> Self:
        """A mapping that came from a file or the network (JSON): no Python-only option."""
        if not isinstance(body, Mapping) or not all(isinstance(k, str) for k in body):
            raise ConfigError(f"{where}: expected a mapping of option names")
        refused = sorted(k for k in body if k in cls.python_only())
        if refused:
            raise ConfigError(f"{where}: {', '.join(refused)}: Python only (not accepted "
                              "from a file or the network)")
        try:
            return cls.from_keywords(**body)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc

    @classmethod
    def python_only(cls) -> frozenset[str]:
        return frozenset(n for n, f in cls.model_fields.items() if _extra(f).get("python_only"))

    @classmethod
    def declared_options(cls) -> dict[str, FieldInfo]:
        """The options a file or the network may give (every field but the Python-only)."""
        return {n: f for n, f in cls.model_fields.items() if not _extra(f).get("python_only")}

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``, checked like a new one (``model_copy`` would not check)."""
        values = {name: getattr(self, name) for name in type(self).model_fields
                  if name in self.model_fields_set}
        return type(self).from_keywords(**{**values, **changes})

    def given(self, names: Mapping[str, FieldInfo] | None = None) -> dict[str, Any]:
        """The values of ``names`` (default: every field), as keywords."""
        return {n: getattr(self, n) for n in (names or type(self).model_fields)}

    # -- YAML -----------------------------------------------------------------------------------
    @classmethod
    def yaml_spellings(cls) -> dict[str, str]:
        """YAML key -> field, for the fields a file may give in a larger unit."""
        return {_extra(f)["yaml"]: n for n, f in cls.model_fields.items() if "yaml" in _extra(f)}

    @classmethod
    def from_yaml_body(cls, body: Any) -> Any:
        """A YAML mapping with its unit spellings converted (``window_mib: 8`` ->
        ``window_bytes: 8 MiB``) and its Python-only keys refused; validation follows."""
        if not isinstance(body, dict):
            return body
        body = dict(body)
        refused = sorted(k for k in body if k in cls.python_only())
        if refused:
            raise ValueError(f"{', '.join(refused)}: Python only, not accepted from a file")
        spelt: dict[str, str] = {}
        for key, name in cls.yaml_spellings().items():
            if key not in body:
                continue
            if name in body:
                raise ValueError(f"{key} and {name} are one option: give one of them")
            value = body.pop(key)
            info = cls.model_fields[name]
            body[name] = _from_unit(value, YAML_FACTORS[key.rsplit("_", 1)[-1]],
                                    zero_is_none=_extra(info)["zero_is_none"])
            spelt[name] = key
        return body, spelt

    # -- the docs -------------------------------------------------------------------------------
    @classmethod
    def describe(cls) -> list[str]:
        """One markdown table row per option: name, type, default, bound, unit, doc."""
        rows = []
        for name, info in cls.model_fields.items():
            extra = _extra(info)
            spelt = f" (YAML: `{extra['yaml']}`)" if "yaml" in extra else ""
            where = " Python only." if extra.get("python_only") else ""
            rows.append(f"| `{name}`{spelt} | {_type_name(info.annotation)} | "
                        f"{_default(info)} | {_bound(info)} | {extra.get('unit', '')} | "
                        f"{(info.description or '').strip()}{where} |")
        return rows


class YamlSection(OptionSet):
    """Mixed into a YAML model made from an ``OptionSet``: unit spellings, no Python-only.

    ``class SubscriberConfig(YamlSection, SubscriberOptions)`` is the ``subscriber:``
    section: the options as declared, the file's own keys (``endpoint``) beside them;
    an error in a key the file spelt in its unit names that key (``window_mib``).
    """

    @model_validator(mode="wrap")
    @classmethod
    def _yaml_spellings(cls, body: Any, handler: Any) -> Any:
        converted = cls.from_yaml_body(body)
        if not isinstance(converted, tuple):
            return handler(converted)
        values, spelt = converted
        try:
            return handler(values)
        except ValidationError as exc:
            if not spelt:
                raise
            raise ValidationError.from_exception_data(
                exc.title, [_as_spelt(err, spelt, body) for err in exc.errors()]) from exc


def _as_spelt(err: ErrorDetails, spelt: dict[str, str], body: dict[str, Any]) -> Any:
    """An error about a field the file gave in its unit, named and shown as written."""
    loc = err["loc"]
    key = spelt.get(str(loc[0])) if loc else None
    if key is None:
        return {"type": err["type"], "loc": loc, "input": err["input"], "ctx": err.get("ctx")} \
            if err.get("ctx") else {"type": err["type"], "loc": loc, "input": err["input"]}
    message = f"{err['msg']} (as {loc[0]}, in bytes)"
    return {"type": PydanticCustomError("yaml_unit", "{message}", {"message": message}),
            "loc": (key, *loc[1:]), "input": body.get(key)}


def _from_unit(value: Any, factor: int, *, zero_is_none: bool) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value  # the field's own check names the type
    if value == 0 and zero_is_none:
        return None
    return int(value * factor)  # (every spelling in a larger unit is of a byte count)


def declared(model: type[BaseModel], name: str) -> Any:
    """``model``'s declaration of ``name`` (a copy), to reuse it in another model:
    ``apply_mode: ApplyMode = declared(WorkerOptions, "apply_mode")``."""
    return copy.copy(model.model_fields[name])


def _type_name(annotation: Any) -> str:
    """``int or None``, ``'auto', 'in_place' or 'reload'``: for a markdown table."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return ", ".join(repr(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "(derived)"
    if info.default is PydanticUndefined:
        return "(required)"
    return f"`{info.default!r}`"


def _bound(info: FieldInfo) -> str:
    parts = []
    for meta in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)
