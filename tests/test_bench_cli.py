"""``weightpub bench --quick --json``: every section runs end to end and prints its fields.

Tiny sizes (a smoke run: 2-4 min on CI's 2 cores beside the other engine group). The
figures of a quick run say nothing about speed; what is checked is that each path
works: the transport pairs (tcp, ipc, peer, stream) moved their rounds, vLLM agreed with
transformers after every update, the delta versions arrived bit exact, and the
replica's own /metrics saw the commits the bench timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]


def test_bench_quick_json_runs_every_section_and_prints_its_fields() -> None:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, "-m", "weightpub", "bench", "--quick", "--json"],
                          capture_output=True, text=True, timeout=450, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["quick"] is True

    pairs = result["transport"]["pairs"]
    assert {p["scheme"] for p in pairs} == {"tcp", "ipc", "peer", "stream"}
    for pair in pairs:
        assert len(pair["raw_seconds"]) == len(pair["weightpub_seconds"]) == 4
        assert pair["ratio"] > 0 and pair["cold_ratio"] > 0 and pair["transfer_seconds"] > 0
        assert {"publisher", "subscriber"} <= set(pair["cpu_s_per_GB"])
        if pair["scheme"] != "peer":  # first touch: a cold round faults its fresh buffers
            assert pair["faults_per_GB"]["subscriber"]["cold"] > 0
    (peer,) = (p for p in pairs if p["scheme"] == "peer")
    # the receiver got its bytes through the forwarding peer, whose serving CPU is its own row
    assert peer["from_peers_fraction"] > 0.5 and "forwarding" in peer["cpu_s_per_GB"]
    # the stream path ran beside frames and raw TCP (the tcp pair's rounds), every version
    # over the stream
    (stream,) = (p for p in pairs if p["scheme"] == "stream")
    assert stream["data_paths"] == ["stream"] * 4 and stream["stream_vs_frames"] > 0
    assert {"publisher", "subscriber"} <= set(stream["frames_cpu_s_per_GB"])

    e2e = result["e2e"]
    assert set(e2e["median_s"]) == {"weightpub", "disk", "per_param_rpc"}
    assert e2e["oracle"]["ok"], e2e["oracle"]["mismatches"]
    assert set(e2e["ratios"]) == {"weightpub/disk", "weightpub/per_param_rpc",
                                  "commit_pause/reload_weights"}
    assert e2e["commit_pause_seconds"]["max"] >= e2e["commit_pause_seconds"]["median"] > 0

    (cadence,) = result["streaming"]["cadences"]
    assert cadence["every_s"] == 0.3 and cadence["published"] >= 1
    assert cadence["median_tokens_per_s"]["quiet"] > 0 and cadence["ratio"] > 0

    assert result["delta"]["bit_exact"] and 0 < result["delta"]["bytes_ratio"] < 1

    # the bench's commits are the ones the replica's /metrics histogram counted
    pauses = result["replica_metrics"]["commit_pause_seconds"]
    assert pauses["count"] >= e2e["reps"] + cadence["commits"]
    rows = {(r["section"], r["figure"]) for r in result["summary"]}
    assert {s for s, _ in rows} == {"transport", "e2e", "commit pause", "streaming", "delta",
                                    "metrics"}
