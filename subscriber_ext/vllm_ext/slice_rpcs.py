"""RPCs for slice plans (issue 30): which bytes of each published tensor a rank reads.

``weight_slice_plan`` records this rank's plan from a manifest's tensor table
(``apply/slice_plan.py``); ``weight_slice_check`` proves a plan on real bytes (the
same parameters loaded with everything outside the plan poisoned). Both touch no
live weight. The plan is what a per-rank receiver will fetch (not wired to the
transport yet: see issue 30's note).
"""

from __future__ import annotations

from typing import Any

from subscriber_ext.vllm_ext.apply.slice_plan import SlicePlan, check_plan, record_plan
from subscriber_ext.vllm_ext.rpc_replies import all_ranks_reply
from subscriber_ext.vllm_ext.seed.tensor_bytes import decode_many
from subscriber_ext.vllm_ext.worker_state import StateAccess
from weightpub_wire.dtypes import parse_dtype
from weightpub_wire.errors import ApplyError

__all__ = ["SliceRpcs"]

#: a manifest's tensor table is bounded by the wire; an RPC caller's is bounded here
_MAX_ENTRIES = 1 << 20


class SliceRpcs(StateAccess):
    """Mixed into the worker extension; each method is a ``collective_rpc`` target."""

    def _wp_slice_plan(self, entries: list[Any]) -> SlicePlan:
        if not isinstance(entries, list) or len(entries) > _MAX_ENTRIES:
            raise ApplyError(f"slice plan: entries must be a list of at most {_MAX_ENTRIES}")
        parsed = []
        for item in entries:
            try:
                name, dtype, shape = item
                parsed.append((str(name), parse_dtype(dtype, error=ApplyError),
                               tuple(int(n) for n in shape)))
            except (TypeError, ValueError) as exc:
                raise ApplyError(f"slice plan: bad entry {item!r}: {exc}") from exc
        return record_plan(self._wp_applier(), parsed)

    @all_ranks_reply
    def weight_slice_plan(self, entries: list[Any], with_ranges: bool = False) -> dict[str, Any]:
        """This rank's plan for ``[(name, dtype, shape), ...]``: bytes needed of the total."""
        plan = self._wp_slice_plan(entries)
        out = plan.summary()
        if with_ranges:
            out["ranges"] = {name: [list(r) for r in runs] for name, runs in plan.ranges.items()}
        return out

    @all_ranks_reply
    def weight_slice_check(self, weights: Any) -> dict[str, Any]:
        """Record the plan for ``weights`` (encoded tensors) and prove it on their bytes."""
        tensors = dict(decode_many(weights))
        plan = self._wp_slice_plan([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
        out = plan.summary()
        out["mismatches"] = check_plan(self._wp_applier(), plan, tensors)
        return out
