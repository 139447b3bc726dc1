"""Slice plans on a worker (issue 30): which bytes of each published tensor a rank reads.

``weight_slice_plan`` records this rank's plan from a manifest's tensor table
(``apply/slice_plan.py``); ``weight_slice_check`` proves a plan on real bytes (the
same parameters loaded with everything outside the plan poisoned). Both touch no
live weight. ``_wp_choose_receive`` decides at ``start_weight_subscriber`` whether
this rank fetches its own slices (``slice_receiver.py``) or whole versions
(``receive_choice.py``); ``_wp_plan_for`` is the receiver's plan, cached by layout.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from subscriber_ext.vllm_ext.apply.slice_plan import SlicePlan, check_plan, record_plan
from subscriber_ext.vllm_ext.receive_choice import (
    AUTO_PENDING,
    AUTO_SLICES_BELOW,
    Layout,
    ReceiveChoice,
    checkpoint_layout,
)
from subscriber_ext.vllm_ext.rpc_replies import all_ranks_reply
from subscriber_ext.vllm_ext.seed.tensor_bytes import decode_many
from subscriber_ext.vllm_ext.slice_receiver import layout_key
from subscriber_ext.vllm_ext.worker_options import WorkerOptions
from subscriber_ext.vllm_ext.worker_state import StateAccess
from weightpub_wire.dtypes import parse_dtype
from weightpub_wire.errors import ApplyError

__all__ = ["SliceRpcs"]

logger = logging.getLogger("weightpub.slices")

#: a manifest's tensor table is bounded by the wire; an RPC caller's is bounded here
_MAX_ENTRIES = 1 << 20
#: what a rank without a checkpoint layout contributes to ``auto``'s agreement (above any
#: plan's share, and above a failed plan's ``inf`` cut to 1e30)
_NO_LAYOUT = 2e30


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

    # ------------------------------------------------------------ receiving slices
    def _wp_plan_for(self, layout: Layout) -> SlicePlan:
        """This rank's plan for a layout, recorded once (``SliceReceiver``'s ``plan_for``)."""
        st = self._wp()
        key = layout_key(layout)
        with st.lock:
            plan = st.slice_plans.get(key)
        if plan is None:
            plan = self._wp_slice_plan([list(entry) for entry in layout])
            with st.lock:
                if len(st.slice_plans) >= 4:  # layouts rarely change; keep the newest few
                    st.slice_plans.pop(next(iter(st.slice_plans)))
                st.slice_plans[key] = plan
        return plan

    def _wp_slice_label(self) -> str:
        """The plan's layout tag: which share of the replica this rank is."""
        parallel = self.vllm_config.parallel_config
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        return f"tp{tp}/rank{self.rank}" if pp == 1 else f"tp{tp}pp{pp}/rank{self.rank}"

    def _wp_choose_receive(self, options: WorkerOptions,
                           ) -> tuple[ReceiveChoice, Layout | None]:
        """Slices, node staging or one whole subscriber, and the layout to plan first.

        ``auto`` runs one tiny all_reduce on vLLM's CPU groups (every rank calls this
        from the same RPC, with the same options), so every rank chooses alike. When a
        rank has no checkpoint layout (a hub name, not a local directory), every rank
        decides at the first version instead (``AUTO_PENDING``, ``_wp_decide_receive``),
        each by its own plan, once: no collective can run off vLLM's step loop.
        """
        world = self.vllm_config.parallel_config.world_size
        node = options.node_staging if options.node_staging is not None else world > 1
        whole = "node" if node else "rank"
        st = self._wp()
        if options.receive == "whole":
            return ReceiveChoice(whole, "asked"), None
        if options.receive == "auto":
            # with peer_share, ranks of the same layout share their slices (peering.py)
            reason = "one rank" if world == 1 else "collective" if options.collective \
                else None
            if reason is not None:
                return ReceiveChoice(whole, reason), None
        started = time.perf_counter()
        layout = checkpoint_layout(str(self.vllm_config.model_config.model))
        fraction, cause = _NO_LAYOUT, "no checkpoint layout"
        if layout is not None:
            try:
                plan = self._wp_plan_for(layout)
                fraction = plan.needed_bytes / max(1, plan.total_bytes)
                cause = "asked" if options.receive == "slices" else "auto"
            except Exception as exc:  # recording failed: whole versions, counted
                logger.warning("weightpub: rank %s could not record its slice plan (%s)",
                               self.rank, exc)
                fraction, cause = math.inf, f"plan failed: {type(exc).__name__}"
        seconds = None if layout is None else round(time.perf_counter() - started, 4)
        if options.receive == "slices":  # no layout yet: the first version tells
            return ReceiveChoice("slices", cause, None if fraction >= _NO_LAYOUT
                                 else round(fraction, 4),
                                 plan_seconds=seconds), layout
        worst = self._wp_agree_max(fraction)
        if worst >= _NO_LAYOUT:  # some rank has no layout: every rank decides at version 1
            return ReceiveChoice("rank", AUTO_PENDING, None, dict(st.receive_fallbacks),
                                 None), None
        if worst < AUTO_SLICES_BELOW:
            return ReceiveChoice("slices", "auto", round(fraction, 4),
                                 dict(st.receive_fallbacks), seconds), layout
        if cause == "auto":
            cause = f"a rank needs {worst:.2f}x of a version"
        elif math.isfinite(fraction):
            cause = "another rank could not plan"
        st.receive_fallbacks[cause] = st.receive_fallbacks.get(cause, 0) + 1
        return ReceiveChoice(whole, cause, None, dict(st.receive_fallbacks), seconds), None

    def _wp_decide_receive(self, layout: Layout) -> bool:
        """``receive: auto`` without a layout at start: the first version's layout is
        here; slice (True) when this rank's plan needs below ``AUTO_SLICES_BELOW`` of a
        version, else whole for good (the cause counted). Called once, on the receiver's
        replan thread; ``weight_status()["receive"]`` then shows the decision."""
        st = self._wp()
        started = time.perf_counter()
        fraction, cause = math.inf, ""
        try:
            plan = self._wp_plan_for(layout)
            fraction = plan.needed_bytes / max(1, plan.total_bytes)
        except Exception as exc:  # recording failed: whole versions, counted
            logger.warning("weightpub: rank %s could not record its slice plan (%s)",
                           self.rank, exc)
            cause = f"plan failed: {type(exc).__name__}"
        seconds = round(time.perf_counter() - started, 4)
        if fraction < AUTO_SLICES_BELOW:
            st.receive = ReceiveChoice("slices", "auto at the first version",
                                       round(fraction, 4), dict(st.receive_fallbacks), seconds)
            return True
        cause = cause or f"this rank needs {fraction:.2f}x of a version"
        st.receive_fallbacks[cause] = st.receive_fallbacks.get(cause, 0) + 1
        st.receive = ReceiveChoice("rank", cause, None, dict(st.receive_fallbacks), seconds)
        return False

    def _wp_agree_max(self, value: float) -> float:
        """The largest ``value`` of every rank of the replica (TP group, then PP group)."""
        out = torch.tensor([value if math.isfinite(value) else 1e30], dtype=torch.float64)
        for group in self._wp_groups():
            if group is not None and group.size() > 1:
                torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX,
                                             group=group)
        return float(out.item())

    def _wp_groups(self) -> list[Any]:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return [get_tp_group().cpu_group, get_pp_group().cpu_group]
