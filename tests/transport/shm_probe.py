"""Look at shared staging memory from outside the processes that hold it (``/proc``).

A memfd has no name in ``/dev/shm``: it shows up as ``/memfd:<name> (deleted)`` in
``/proc/<pid>/maps`` of each process mapping it, and its memory is gone once no
process maps it or holds its descriptor.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["mapped_paths", "memfd_holders", "our_shm_files", "process_tree", "pss_bytes"]


def memfd_holders(fragment: str) -> dict[int, set[int]]:
    """``pid -> inodes`` of every process mapping, or holding a descriptor of, a memfd
    whose name contains ``fragment``."""
    found: dict[int, set[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            for line in (entry / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and "/memfd:" in parts[5] and fragment in parts[5]:
                    found.setdefault(pid, set()).add(int(parts[4]))
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/memfd:") and fragment in target:
                    found.setdefault(pid, set()).add(os.stat(fd).st_ino)
        except (OSError, ValueError):
            continue  # gone, or not ours to read
    return found


#: the named entries an engine makes, with the pid of the process that made it: a slot
#: table (``weightpub-<pid>-<hex>``) and a front end's status board
_ENGINE_ENTRY = re.compile(r"weightpub-(?:status-)?(\d+)-")


def mapped_paths(prefix: str) -> set[str]:
    """Paths starting with ``prefix`` that a living process maps or holds open."""
    found: set[str] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for line in (entry / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(prefix):
                    found.add(parts[5])
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    found.add(target)
        except OSError:
            continue  # gone, or not ours to read
    return found


def our_shm_files(foreign_engines: bool = True) -> list[str]:
    """weightpub's own entries in ``/dev/shm`` (slot tables; staging never has one).
    ``foreign_engines=False`` leaves out the entries of engines made by processes outside
    this one's tree (an engine test on another worker makes them while this one runs)."""
    try:
        names = sorted(n for n in os.listdir("/dev/shm") if n.startswith("weightpub"))
    except OSError:
        return []
    if foreign_engines:
        return names
    ours = set(process_tree(os.getpid()))
    return [n for n in names if not (m := _ENGINE_ENTRY.match(n)) or int(m.group(1)) in ours]


def process_tree(root: int) -> list[int]:
    """``root`` and all its living descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def pss_bytes(pids: list[int]) -> int:
    """Proportional set size of ``pids`` together: shared pages counted once overall."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError):
            continue
    return total
