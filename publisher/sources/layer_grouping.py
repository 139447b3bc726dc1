"""Layer groups: the unit a version is gathered, copied and dropped in.

vLLM's ``layerwise_groups`` (0.32), copied so ``publisher`` never imports vLLM:
every rank must cut the same groups in the same order, since each group's
gathers are collectives all ranks join.
"""

from __future__ import annotations

__all__ = ["layer_groups", "layer_key", "layer_runs"]


def layer_groups(names: list[str]) -> list[list[str]]:
    """One group per decoder layer, exactly vLLM's ``layerwise_groups`` (0.32).

    Why a copy: ``publisher`` never imports vLLM, and group *g* must name the
    same tensors on every rank. A name keys on its outermost integer segment
    (``model.layers.3.mlp.experts.7.w1`` is layer 3); un-indexed names before the
    first indexed one form the first group, the others the last; stacks follow
    the first appearance of their prefix, ascending index within it.
    ``tests/transport/test_streamed_sources.py`` checks it against vLLM's.
    """
    pre: list[str] = []
    post: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int]] = []
    for name in names:
        key = layer_key(name)
        if key is None:
            (post if order else pre).append(name)
            continue
        if key not in stacks:
            stacks[key] = []
            order.append(key)
        stacks[key].append(name)
    prefix_rank: dict[str, int] = {}
    for key in order:
        prefix_rank.setdefault(key[0], len(prefix_rank))
    order.sort(key=lambda key: (prefix_rank[key[0]], key[1]))
    groups: list[list[str]] = [pre] if pre else []
    groups += [stacks[key] for key in order]
    if post:
        groups.append(post)
    return groups


def layer_key(name: str) -> tuple[str, int] | None:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def layer_runs(names: list[str]) -> list[list[str]]:
    """Consecutive names of one layer (``layer_key``), in the given order.

    Why not ``layer_groups``: that reorders (the post block last, stacks by index)
    while a vLLM 0.33 ``WeightSource`` iterates in metadata order only; runs keep
    that order, so a group is gathered whole before the next starts, and every rank
    derives the same runs from the same metadata.
    """
    runs: list[list[str]] = []
    last: object = object()
    for name in names:
        key = layer_key(name)
        if not runs or key != last:
            runs.append([])
            last = key
        runs[-1].append(name)
    return runs
