"""vLLM's trainer-side ``WeightSource`` in both of its APIs, seen as one: metadata plus groups.

vLLM 0.32: ``metadata()`` is a method and the source yields whole groups
(``groups()``, ``iter_groups()``; ``held_names()`` says what this rank holds).
vLLM 0.33: ``metadata`` is a ``functools.cached_property`` declaring the whole
model on every rank (``ParamMeta`` gained ``owners``, ``mesh_shape``,
``placements``), ``iter_full()`` yields the full tensor of each name this rank
owns, in metadata order, and ``groups`` / ``iter_groups`` / ``held_names`` are gone.

``as_grouped`` hands the rest of ``publisher.sources`` one shape, the 0.32 one: a
0.32 source as it is, a 0.33 source wrapped in ``FullIterSource``. Known by its
attributes, no vLLM import (``publisher`` never imports vLLM).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from publisher.sources.layer_grouping import layer_runs
from weightpub_wire.errors import ConfigError

__all__ = ["FullIterSource", "as_grouped", "is_weight_source"]

#: one group as it is materialized: names and full tensors (None: not owned on this rank)
Group = tuple[list[str], list[Any]]


def is_weight_source(obj: object) -> bool:
    """A vLLM ``WeightSource`` of either API (not a module, mapping or list of pairs)."""
    if callable(getattr(obj, "iter_groups", None)):
        return callable(getattr(obj, "metadata", None))
    return callable(getattr(obj, "iter_full", None)) and hasattr(obj, "metadata")


def as_grouped(source: Any) -> Any:
    """``source`` with ``metadata()`` and ``iter_groups()`` (the 0.32 API), whatever its API."""
    if callable(getattr(source, "iter_groups", None)):
        return source
    return FullIterSource(source)


class FullIterSource:
    """A vLLM 0.33 ``WeightSource`` read as groups: ``iter_full()`` batched per layer run.

    Each group lists every name of its run; a name this rank does not own (it is
    not yielded) is ``None`` there, as 0.32's ``iter_groups`` did for names not
    held. Holding one tensor ahead (the first of the next run) tells where a run
    ends; the collectives still run in metadata order on every rank.
    """

    def __init__(self, source: Any) -> None:
        self._source = source
        self._meta = list(source.metadata)
        self._runs = layer_runs([m.name for m in self._meta])

    def metadata(self) -> list[Any]:
        return self._meta

    def groups(self) -> list[list[str]]:
        return [list(run) for run in self._runs]

    def iter_groups(self) -> Iterator[Group]:
        where = {name: g for g, run in enumerate(self._runs) for name in run}
        items = iter(self._source.iter_full())
        pending = next(items, None)
        for g, run in enumerate(self._runs):
            got: dict[str, Any] = {}
            while pending is not None:
                name = pending[0]
                at = where.get(name)
                if at is None:
                    raise ConfigError(f"the weight source yielded {name!r}, which its "
                                      "metadata does not declare")
                if at < g or name in got:
                    raise ConfigError(f"the weight source yielded {name!r} out of metadata "
                                      "order (iter_full must follow metadata)")
                if at > g:
                    break
                got[name] = pending[1]
                pending = next(items, None)
            tensors = [got.pop(name, None) for name in run]
            yield list(run), tensors
            del tensors
        if pending is not None:
            raise ConfigError(f"the weight source yielded {pending[0]!r} after its last "
                              "declared parameter")
