"""How much host memory is left here: the basis of both sides' derived budgets.

Why not just physical memory: a host already holds a trainer's model and
optimizer, or vLLM, its model and its KV cache (on CPU); a buffer allocated
past what is left gets the process OOM-killed. Containers see the host's
``MemAvailable`` but are killed at their cgroup's limit, so both are read and
the smaller one wins. Each side takes its own fraction of it when nobody set a
budget: the subscriber's staging budget
(``subscriber_ext.transport.staging.memory_budget``) and the publisher's host
budget (``publisher.store.host_budget``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_memory", "derive_budget"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat_field(path: Path, field: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == field and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_headroom() -> int | None:
    """Bytes left under the tightest memory limit of this process's cgroups (v2, then v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: every ancestor's memory.max may bind
            group = _CGROUP_ROOT / path.lstrip("/")
            for directory in (group, *group.parents):
                if not directory.is_relative_to(_CGROUP_ROOT):
                    break
                limit = _read_int(directory / "memory.max")
                used = _read_int(directory / "memory.current")
                if limit is not None and used is not None:
                    free = limit - used + _stat_field(directory / "memory.stat", "inactive_file")
                    best = free if best is None else min(best, free)
        elif "memory" in controllers.split(","):
            group = _CGROUP_ROOT / "memory" / path.lstrip("/")
            limit = _read_int(group / "memory.limit_in_bytes")
            used = _read_int(group / "memory.usage_in_bytes")
            if limit is not None and used is not None and limit < (1 << 60):
                free = limit - used + _stat_field(group / "memory.stat", "total_inactive_file")
                best = free if best is None else min(best, free)
    return best


def available_memory() -> int:
    """Bytes that can still be allocated here without memory pressure (host and cgroup)."""
    candidates = [v for v in (_meminfo_available(), _cgroup_headroom()) if v is not None]
    if not candidates:
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 1 << 40
    return max(0, min(candidates))


def derive_budget(fraction: float) -> int:
    """``fraction`` of ``available_memory()``, in bytes."""
    return int(available_memory() * fraction)
