"""``pip install weightpub`` without extras can publish: every import is declared.

Two checks. (1) Every third-party module that the runtime packages import (at
module level or lazily) belongs to a distribution in the closure of
``[project] dependencies`` (extras excluded). (2) A child process in which
only the standard library and that closure can be imported publishes a
version and receives it bit-exact (numpy included: ``publish()`` needs it).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
RUNTIME = ("weightpub_wire", "publisher", "subscriber_ext/transport")
#: modules a user imports only with a library of their own (loaded on first use, never by
#: ``publish()``); the child process below proves nothing else pulls them in
OPTIONAL = {"publisher/callback.py"}  # transformers' TrainerCallback (and deepspeed)
pytestmark = pytest.mark.timeout(120)


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def runtime_closure() -> set[str]:
    """Distributions ``pip install .`` (no extras) brings in, as installed here."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [Requirement(r).name for r in declared]
    seen: set[str] = set()
    while todo:
        name = _canon(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def third_party_imports(folder: Path) -> dict[str, str]:
    """Top-level module -> a file importing it, for every non-stdlib, non-project import."""
    ours = {"weightpub_wire", "publisher", "subscriber_ext", "weightpub", "tests"}
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        if path.is_relative_to(REPO) and str(path.relative_to(REPO)) in OPTIONAL:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in ours and top not in sys.stdlib_module_names:
                    found.setdefault(top, path.name if not path.is_relative_to(REPO)
                                     else str(path.relative_to(REPO)))
    return found


def test_every_runtime_import_is_a_declared_dependency() -> None:
    closure = runtime_closure()
    assert {"numpy", "torch", "pyzmq", "msgspec", "xxhash"} <= closure
    owners = md.packages_distributions()
    missing = []
    for folder in RUNTIME:
        for module, where in third_party_imports(REPO / folder).items():
            dists = {_canon(d) for d in owners.get(module, [])}
            if not dists & closure:
                missing.append(f"{where} imports {module} ({sorted(dists) or 'not installed'})")
    assert missing == [], "undeclared runtime imports:\n" + "\n".join(missing)


def test_the_checker_can_fail(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("import vllm.config\nimport numpy\nfrom os import path\n"
                                   "def f():\n    from transformers import AutoModel\n")
    found = third_party_imports(tmp_path)
    assert set(found) == {"vllm", "numpy", "transformers"}
    closure = runtime_closure()
    assert "vllm" not in closure and "transformers" not in closure and "numpy" in closure


CHILD = r"""
import importlib.abc, sys
allowed = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in allowed or top.startswith("_"):
            return None
        raise ModuleNotFoundError(f"{name} is not installed by `pip install weightpub` (no extras)")
sys.meta_path.insert(0, Block())
import torch
from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
weights = {"w": torch.randn(64, 32), "b": torch.arange(7, dtype=torch.int16)}
with WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) as pub:
    with WeightSubscriber(pub.endpoint) as sub:
        version = pub.publish(weights)
        staged = sub.wait_for_version(version, timeout=30)
        assert all(torch.equal(staged.tensors[k], v) for k, v in weights.items())
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "transformers"))
assert not bad, bad
print("published and received with runtime dependencies only")
"""


def test_publish_and_subscribe_with_only_runtime_dependencies_importable() -> None:
    owners = md.packages_distributions()
    closure = runtime_closure()
    modules = {m for m, dists in owners.items() if {_canon(d) for d in dists} & closure}
    modules |= {"weightpub_wire", "publisher", "subscriber_ext", "weightpub"}
    result = subprocess.run([sys.executable, "-c", CHILD, ",".join(sorted(modules))],
                            cwd=REPO, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "runtime dependencies only" in result.stdout
