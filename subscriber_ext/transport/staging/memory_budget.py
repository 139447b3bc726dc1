"""How much host memory staging may use when nobody said: the derived budget.

What is available (host ``MemAvailable`` and cgroup headroom, the smaller) is
read by ``weightpub_wire.host_memory``, which the publisher's host budget
shares; the fraction is the subscriber's own.

The derived budget is ``DEFAULT_FRACTION`` of what is available when the
subscription starts: the other half stays free for preparing a version off the
step path (kernel-format copies of the weights, about one version per node)
and for everything else on the host. ``staging_budget_bytes`` overrides it.
"""

from __future__ import annotations

from weightpub_wire.host_memory import derive_budget

__all__ = ["DEFAULT_FRACTION", "derive_staging_budget"]

DEFAULT_FRACTION = 0.5


def derive_staging_budget(fraction: float = DEFAULT_FRACTION) -> int:
    """The staging budget a subscriber uses when none is given."""
    return derive_budget(fraction)
