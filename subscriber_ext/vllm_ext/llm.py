"""Using the worker extension from a vLLM ``LLM``: its class path, waiting for a version, and
the replica's status (every rank's, with how each receives: ``receive_table.py``).

Nothing here imports vLLM; ``llm`` is anything with ``collective_rpc``.
"""

from __future__ import annotations

import time
from typing import Any

from subscriber_ext.observe.receive_table import receive_table
from weightpub_wire.errors import ApplyError, WeightPubTimeout

__all__ = ["WORKER_EXTENSION", "replica_status", "wait_until_applied"]

#: ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``
WORKER_EXTENSION = "subscriber_ext.worker_extension.BatchWeightSyncWorkerExtension"


def wait_until_applied(llm: Any, version: int, *, publisher_id: str | None = None,
                       timeout: float = 60.0, fail_on_error: bool = False,
                       poll_s: float = 0.01) -> list[dict[str, Any]]:
    """Poll ``weight_version`` (itself a commit point) until every rank runs ``version``.

    Returns each rank's status. Versions count per publisher instance, so
    ``publisher_id`` must match too when given. With ``fail_on_error`` a rank's
    ``last_error`` raises ``ApplyError`` at once; otherwise the wait ends with
    ``WeightPubTimeout`` naming the ranks' errors.
    """
    deadline = time.monotonic() + timeout
    while True:
        ranks: list[dict[str, Any]] = llm.collective_rpc("weight_version")
        if all((r.get("applied_version") or 0) >= version
               and (publisher_id is None or r.get("publisher_id") == publisher_id)
               for r in ranks):
            return ranks
        errors = [r["last_error"] for r in ranks if r.get("last_error")]
        if fail_on_error and errors:
            raise ApplyError(f"version {version} not applied: {errors}")
        if time.monotonic() >= deadline:
            raise WeightPubTimeout(f"version {version} not applied within {timeout}s: "
                                   f"{errors or ranks}")
        time.sleep(poll_s)


def replica_status(llm: Any) -> dict[str, Any]:
    """One replica's status: each rank's ``weight_status`` (``ranks``), the version every
    rank runs (``applied_version``, None before the first), and ``receive``: one row per
    rank (mode and cause, planned share of a version, what the applied version cost it,
    by source kind; fallbacks by cause; plan_seconds), the ranks per mode, and the share
    of the newest version the ranks received together. Commits nothing."""
    ranks: list[dict[str, Any]] = llm.collective_rpc("weight_status")
    applied = [r.get("applied_version") for r in ranks]
    known = [v for v in applied if isinstance(v, int)]
    return {
        "applied_version": min(known) if known and len(known) == len(applied) else None,
        "receive": receive_table(r.get("receive") for r in ranks),
        "ranks": ranks,
    }
