"""Using the worker extension from a vLLM ``LLM``: its class path, and waiting for a version.

Nothing here imports vLLM; ``llm`` is anything with ``collective_rpc``.
"""

from __future__ import annotations

import time
from typing import Any

from weightpub_wire.errors import ApplyError, WeightPubTimeout

__all__ = ["WORKER_EXTENSION", "wait_until_applied"]

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
