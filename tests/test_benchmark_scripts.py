"""Every benchmark script still imports: the scripts are not run in CI (they take minutes),
so a helper renamed under them would otherwise surface only when someone measures."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_imports(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # scripts import their siblings by name
    module = importlib.import_module(f"benchmarks.{name}")
    script = (BENCHMARKS / f"{name}.py").read_text()
    if 'if __name__ == "__main__"' in script:  # a script, not a helper module
        assert callable(getattr(module, "main", None)), f"benchmarks/{name}.py has no main()"
    sys.modules.pop(f"benchmarks.{name}", None)


# benchmarks/compare_heads.py: the figures it reads from a captured bench result, and a
# whole comparison of two stand-in trees (each prints its own JSON in a real subprocess)
BENCH_RESULT = {
    "bench": "weightpub", "quick": False, "options": {"transport_rounds": 8},
    "machine": {"cpus": 2, "load_avg_start": [1.5, 1.0, 0.5]},
    "transport": {"pairs": [
        {"scheme": "tcp", "mib": 256, "weightpub_GBps": 1.5, "raw_GBps": 2.0,
         "raw_seconds": [0.2, 0.1], "subscriber_profile": {"threads": {"main": 0.5}}},
        {"scheme": "ipc", "mib": 256, "weightpub_GBps": 2.5, "raw_GBps": 2.0}]},
    "summary": [{"section": "transport", "ratio": 0.75}, {"section": "transport", "ratio": 1}],
    "e2e": {"median_s": {"weightpub": 0.4, "disk": 2.0}, "oracle": {"ok": True}},
    "wall_s": 30.0,
}


def test_compare_heads_reads_every_measured_leaf() -> None:
    from benchmarks.compare_heads import figures, last_json

    got = figures(last_json("INFO a log line {not json}\n" + json.dumps(BENCH_RESULT) + "\n"))
    assert got == {
        "transport.pairs[scheme=tcp,mib=256].weightpub_GBps": 1.5,
        "transport.pairs[scheme=tcp,mib=256].raw_GBps": 2.0,
        "transport.pairs[scheme=tcp,mib=256].mib": 256.0,
        "transport.pairs[scheme=ipc,mib=256].weightpub_GBps": 2.5,
        "transport.pairs[scheme=ipc,mib=256].raw_GBps": 2.0,
        "transport.pairs[scheme=ipc,mib=256].mib": 256.0,
        "e2e.median_s.weightpub": 0.4, "e2e.median_s.disk": 2.0, "wall_s": 30.0,
    }  # options, machine, summary, profiles, booleans and per-round lists left out
    same = figures({"results": [{"mode": "peers", "x": 1}, {"mode": "peers", "x": 2}]})
    assert same == {"results[0].x": 1.0, "results[1].x": 2.0}  # labels that collide
    with pytest.raises(ValueError, match="no JSON object"):
        last_json("only logs\n")


def test_compare_heads_interleaves_and_pairs_rounds(tmp_path: Path) -> None:
    from benchmarks.compare_heads import compare, order, rows

    assert order(4) == [["old", "new"], ["new", "old"], ["old", "new"], ["new", "old"]]
    trees = {}
    for name, seconds in (("old", 2.0), ("new", 1.0)):
        package = tmp_path / name / "weightpub"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "__main__.py").write_text(  # a stand-in for `weightpub bench --json`
            "import json, sys\n"
            "assert sys.argv[1:] == ['bench', '--json', '--sections', 'e2e'], sys.argv\n"
            f"print(json.dumps({{'e2e': {{'median_s': {seconds}}}}}))\n")
        trees[name] = tmp_path / name
    runs = compare(trees, 2, fleet=False, extra=["--sections", "e2e"])
    assert [(r.round, r.tree) for r in runs] == [(0, "old"), (0, "new"), (1, "new"), (1, "old")]
    [row] = rows(runs)
    assert row["figure"] == "e2e.median_s"
    assert (row["old"], row["new"], row["ratio"]) == (2.0, 1.0, 0.5)
    assert (row["round_min"], row["round_max"]) == (0.5, 0.5)
