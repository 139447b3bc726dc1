"""Two source trees, one benchmark, one run: each figure's median per tree and new/old.

Why: this box is shared and noisy, so a figure measured an hour ago says little next to
one measured now; what holds is a ratio taken in the same run. The trees' runs are
interleaved (old, new, new, old, old, new, ...) so first-touch costs (page cache, the
forkserver, compiled kernels) and drifting load fall on both alike, and each round
gives one new/old ratio of its own: a difference is real when every round shows it.

Each tree runs its own code (``PYTHONPATH`` and the working folder set to the tree; the
interpreter is shared) and prints one JSON object: ``weightpub bench --json`` or, with
``--fleet``, ``benchmarks/fleet.py --json``. Whatever follows ``--`` goes to that command
unchanged. The figures are the JSON's numeric leaves, named by their path; a list of
objects is keyed by the fields that tell its items apart (scheme, mib, hosts, mode...),
lists of numbers (per-round series) are left out since their medians are leaves too.
The 1-minute load average is recorded before each run.

    python benchmarks/compare_heads.py OLD NEW --rounds 3 -- --sections transport \\
        --transport-mib 256
    python benchmarks/compare_heads.py OLD NEW --rounds 3 --match 'median_s|pause' -- \\
        --sections e2e
    python benchmarks/compare_heads.py OLD NEW --fleet --rounds 3 -- --hosts 1 4 --mib 16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Run", "compare", "figures", "last_json", "order", "rows"]

#: fields that name an item of a list of objects (a transport pair, a fleet scenario)
LABEL_KEYS = ("section", "run", "scheme", "mib", "hosts", "mode", "trainer_ranks", "every_s")
#: leaves that describe the run rather than measure it, or are too fine to compare
DEFAULT_EXCLUDE = (r"(^|\.)(options|machine|subscriber_profile|diag|arrivals|bench|quick|summary"
                   r"|targets)(\.|$|\[)")


@dataclass
class Run:
    """One invocation of the benchmark in one tree."""

    tree: str  # "old" or "new"
    round: int
    load: float  # 1-minute load average before the run
    seconds: float  # wall time of the whole invocation
    figures: dict[str, float] = field(default_factory=dict)


def order(rounds: int) -> list[list[str]]:
    """Which tree goes first in each round: old, new | new, old | old, new | ..."""
    return [["old", "new"] if r % 2 == 0 else ["new", "old"] for r in range(rounds)]


def last_json(stdout: str) -> dict[str, Any]:
    """The last line of ``stdout`` that is a JSON object (logs may come before it)."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    raise ValueError("no JSON object on stdout (was --json passed through?)")


def _label(item: dict[str, Any], index: int) -> str:
    keys = [f"{k}={item[k]}" for k in LABEL_KEYS
            if isinstance(item.get(k), str | int | float) and not isinstance(item.get(k), bool)]
    return "[" + ",".join(keys) + "]" if keys else f"[{index}]"


def figures(result: Any, exclude: str = DEFAULT_EXCLUDE, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of ``result`` by its dotted path, ``exclude`` (a regex on the
    path) left out; items of a list of objects are named by ``LABEL_KEYS``."""
    out: dict[str, float] = {}
    if prefix and re.search(exclude, prefix):
        return out
    if isinstance(result, bool) or result is None:
        return out
    if isinstance(result, int | float):
        out[prefix] = float(result)
    elif isinstance(result, dict):
        for key, value in result.items():
            out.update(figures(value, exclude, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(result, list) and result and all(isinstance(i, dict) for i in result):
        labels = [_label(item, index) for index, item in enumerate(result)]
        if len(set(labels)) < len(labels):  # the fields do not tell the items apart
            labels = [f"[{index}]" for index in range(len(result))]
        for label, item in zip(labels, result, strict=True):
            out.update(figures(item, exclude, f"{prefix}{label}"))
    return out


def _command(tree: Path, fleet: bool, extra: list[str]) -> list[str]:
    if fleet:
        return [sys.executable, str(tree / "benchmarks" / "fleet.py"), "--json", *extra]
    return [sys.executable, "-m", "weightpub", "bench", "--json", *extra]


def _run_once(tree: Path, fleet: bool, extra: list[str], timeout: float) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.setdefault("UCX_NET_DEVICES", "lo")
    started = time.perf_counter()
    proc = subprocess.run(_command(tree, fleet, extra), cwd=tree, env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - started, proc.stdout


def compare(trees: dict[str, Path], rounds: int, fleet: bool, extra: list[str],
            exclude: str = DEFAULT_EXCLUDE, timeout: float = 3600.0,
            on_run: Callable[[list[Run]], None] | None = None) -> list[Run]:
    """Run both trees ``rounds`` times each, interleaved; every run's figures
    (``on_run`` sees them after each run: a long comparison cut short keeps its rounds)."""
    runs: list[Run] = []
    for rnd, names in enumerate(order(rounds)):
        for name in names:
            load = os.getloadavg()[0]
            seconds, stdout = _run_once(trees[name], fleet, extra, timeout)
            run = Run(name, rnd, load, seconds, figures(last_json(stdout), exclude))
            runs.append(run)
            print(f"round {rnd + 1}/{rounds} {name}: {seconds:.0f} s, load {load:.2f}",
                  file=sys.stderr, flush=True)
            if on_run is not None:
                on_run(runs)
    return runs


def rows(runs: list[Run], match: str = "") -> list[dict[str, Any]]:
    """Per figure: each tree's median, new/old of the medians, and the lowest and highest
    new/old of a single round (both trees measured back to back)."""
    names = sorted({k for r in runs for k in r.figures if re.search(match, k)})
    out: list[dict[str, Any]] = []
    for name in names:
        per = {t: [r.figures[name] for r in runs if r.tree == t and name in r.figures]
               for t in ("old", "new")}
        old = statistics.median(per["old"]) if per["old"] else None
        new = statistics.median(per["new"]) if per["new"] else None
        pairs = []
        for rnd in sorted({r.round for r in runs}):
            got = {r.tree: r.figures.get(name) for r in runs if r.round == rnd}
            o, n = got.get("old"), got.get("new")
            if o and n is not None:
                pairs.append(n / o)
        out.append({"figure": name, "old": old, "new": new,
                    "ratio": new / old if old and new is not None else None,
                    "round_min": min(pairs) if pairs else None,
                    "round_max": max(pairs) if pairs else None})
    return out


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _table(found: list[dict[str, Any]], runs: list[Run]) -> str:
    width = max([len(r["figure"]) for r in found] + [6])
    lines = [f"{'figure':<{width}}  {'old':>10}  {'new':>10}  {'new/old':>7}  rounds"]
    for r in found:
        spread = "-" if r["round_min"] is None else \
            f"{r['round_min']:.3f}..{r['round_max']:.3f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['figure']:<{width}}  {_fmt(r['old']):>10}  {_fmt(r['new']):>10}  "
                     f"{ratio:>7}  {spread}")
    loads = ", ".join(f"{r.tree}{r.round + 1} {r.load:.2f}" for r in runs)
    lines.append(f"load (1 min) before each run: {loads}")
    return "\n".join(lines)


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the baseline's source tree")
    parser.add_argument("new", type=Path, help="the candidate's source tree")
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree, interleaved")
    parser.add_argument("--fleet", action="store_true",
                        help="run benchmarks/fleet.py (needs root) instead of weightpub bench")
    parser.add_argument("--match", default="", help="only figures whose path matches (regex)")
    parser.add_argument("--exclude", default=DEFAULT_EXCLUDE, help="paths left out (regex)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--save", type=Path, help="also write every run's figures as JSON")
    args = parser.parse_args(argv)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}

    def save(runs: list[Run]) -> None:
        if args.save:
            args.save.write_text(json.dumps({
                "trees": {k: str(v) for k, v in trees.items()}, "extra": extra,
                "runs": [vars(r) for r in runs], "rows": rows(runs, args.match)}, indent=1))

    runs = compare(trees, args.rounds, args.fleet, extra, args.exclude, args.timeout, save)
    print(_table(rows(runs, args.match), runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
