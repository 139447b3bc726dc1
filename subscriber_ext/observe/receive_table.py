"""How each rank of a replica receives versions, and what the last one cost: one row per rank.

Why: with slice fetch (issue 30) every rank may run its own receiver, so "what did
this replica pull" is a per-rank question: which mode a rank chose and why, the
share of a version its plan needs, and what the applied version actually cost it
(bytes by source kind). ``rank_receive`` builds a rank's row from its choice
(``ReceiveChoice.status()``) and its source's status; ``receive_table`` puts a
replica's rows together (``llm.replica_status``). Plain dicts in and out: no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["rank_receive", "receive_table"]


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def rank_receive(rank: int, choice: dict[str, Any] | None,
                 source: dict[str, Any] | None) -> dict[str, Any]:
    """``choice`` (mode, cause, needed_fraction, fallbacks, plan_seconds) kept as it is,
    with this rank's live figures added:

    ``rank``; ``planned_fraction``: the share of a version the current plan needs (it
    follows replans; None: no plan); ``received``: the applied version's ``version``,
    ``received_bytes``, ``version_bytes``, ``fraction`` and ``by_source`` (None: not known
    yet, or a node-staging follower, whose bytes its owner rank received:
    ``via_rank``); ``sources``: the kinds that brought them; ``fetch_fallbacks``: a
    sliced receiver's chunks fetched whole instead, by cause.
    """
    out = dict(choice or {})
    src = _dict(source)
    slices, plan = _dict(src.get("slices")), _dict(src.get("slice_plan"))
    node = _dict(src.get("node_staging"))
    follower = node.get("role") == "follower"
    planned = slices.get("needed_fraction") if slices else out.get("needed_fraction")
    received = None if follower else src.get("applied_received")
    out.update({
        "rank": rank,
        "planned_fraction": planned,
        "received": received,
        "via_rank": node.get("owner_rank") if follower else None,
        "sources": sorted(k for k, v in _dict(_dict(received).get("by_source")).items() if v),
        "fetch_fallbacks": dict(_dict(plan.get("fallbacks"))),
    })
    return out


def receive_table(rows: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    """A replica's rows by rank, the ranks per mode, and what the replica received of
    the newest version every rank reports (``received_fraction``: the ranks' shares
    added up; one node's staging is about 1.0, TP ranks' slices together a little more)."""
    ranks = sorted((r for r in rows if isinstance(r, dict)), key=lambda r: r.get("rank") or 0)
    modes: dict[str, int] = {}
    for row in ranks:
        mode = str(row.get("mode"))
        modes[mode] = modes.get(mode, 0) + 1
    versions = {_dict(r.get("received")).get("version") for r in ranks if r.get("received")}
    version = max((v for v in versions if isinstance(v, int)), default=None)
    total = None
    if version is not None:
        shares = [_dict(r.get("received")).get("fraction") for r in ranks
                  if _dict(r.get("received")).get("version") == version]
        total = round(sum(s for s in shares if isinstance(s, int | float)), 4)
    return {"ranks": ranks, "modes": modes, "version": version, "received_fraction": total}
