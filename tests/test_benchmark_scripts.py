"""Every benchmark script still imports: the scripts are not run in CI (they take minutes),
so a helper renamed under them would otherwise surface only when someone measures."""

from __future__ import annotations

import importlib
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
