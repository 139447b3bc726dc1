"""The house keeps its shape: imports point down, no cycles, heavy libraries stay where they belong.

Checked on the source itself (``ast``), every import statement, at module level or
inside a function: an in-function import may defer a cost (vLLM, torch) but never
reach a layer above, so it cannot hide a cycle either.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("weightpub_wire", "publisher", "subscriber_ext", "weightpub")

#: (module prefix, layer): a module may import modules of a lower layer, or of its own
#: group (the longest matching prefix names a module's group).
LAYERS: list[tuple[str, float]] = [
    ("weightpub_wire", 0),
    # the subscriber's transport, its sub-systems bottom up: what is being staged,
    # then peers and the collective path, the sync client, the subscriber, node staging
    ("subscriber_ext.transport.staging", 2.0),
    ("subscriber_ext.transport.peers", 2.1),
    ("subscriber_ext.transport.collective", 2.1),
    ("subscriber_ext.transport.client", 2.2),
    ("subscriber_ext.transport", 2.3),  # subscriber, subscriber_options, subscriber_config
    ("subscriber_ext.transport.node", 2.4),
    ("subscriber_ext.observe", 2),
    # everything coupled to vLLM, bottom up: the versions we were written against, how
    # tensors reach vLLM parameters and the seed's parts, when every rank switches, the RPCs
    ("subscriber_ext.vllm_ext.vllm_compat", 3.0),
    ("subscriber_ext.vllm_ext.apply", 3.0),
    ("subscriber_ext.vllm_ext.seed", 3.0),
    ("subscriber_ext.vllm_ext.lora", 3.05),  # LoRA adapter versions: served or merged
    ("subscriber_ext.vllm_ext.commit", 3.1),
    ("subscriber_ext.vllm_ext", 3.2),  # worker_extension, worker_state, seed_rpcs, backend, llm
    ("subscriber_ext", 4),  # the package's front, staleness, the worker_extension import path
    # the trainer side, its sub-systems bottom up: the snapshot and its store; where tensors
    # come from, deltas, the collective path; serving; sharding; the publishers and options
    ("publisher.store", 2.0),
    ("publisher.sources", 2.1),
    ("publisher.deltas", 2.1),
    ("publisher.collective", 2.1),
    ("publisher.serving", 2.2),
    ("publisher.sharding", 2.3),
    ("publisher", 2.4),
    ("weightpub", 5),
]
#: third-party packages a group must never import, even lazily
FORBIDDEN = {
    "weightpub_wire": ("vllm", "transformers", "publisher", "subscriber_ext"),
    # the two sides never import each other: only the application joins them
    "publisher": ("vllm", "transformers", "subscriber_ext"),
    "subscriber_ext": ("publisher",),
    "subscriber_ext.transport": ("vllm", "transformers"),
    "subscriber_ext.observe": ("vllm", "transformers"),
    "subscriber_ext.staleness": ("vllm", "transformers"),
}
#: the exceptions, one module each: ``publisher.callback`` *is* a transformers
#: ``TrainerCallback`` (``import publisher`` loads it only on first use, which
#: ``tests/transport/test_exports.py`` checks)
ALLOWED = {
    "publisher.callback": ("transformers",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _tree(path: Path) -> ast.Module:
    """``path`` parsed, once per run (every check below reads the same trees)."""
    return ast.parse(path.read_text(), str(path))


@functools.cache
def imports(path: Path) -> tuple[tuple[str, int], ...]:
    """Every imported module (absolute, relative resolved) with its line."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, node.lineno))
            # ``from pkg import submodule`` imports the submodule too
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if _source_of(candidate) is not None:
                    found.append((candidate, node.lineno))
    return tuple(found)


@functools.cache
def _source_of(module: str) -> Path | None:
    path = REPO.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def group(module: str) -> tuple[str, float]:
    matches = [(p, layer) for p, layer in LAYERS if module == p or module.startswith(p + ".")]
    return max(matches, key=lambda m: len(m[0]))


SOURCES = sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    assert SOURCES
    for path in SOURCES:
        group(module_name(path))  # raises ValueError on an unplaced module


def violations(here: str, found: Sequence[tuple[str, int]]) -> list[str]:
    """What is wrong with module ``here`` importing ``found``."""
    my_group, my_layer = group(here)
    banned = {lib for prefix, libs in FORBIDDEN.items()
              if here == prefix or here.startswith(prefix + ".") for lib in libs}
    banned -= set(ALLOWED.get(here, ()))
    problems = []
    for target, line in found:
        top = target.split(".")[0]
        if top in banned:
            problems.append(f"{here}:{line} imports {target}, which {my_group} must not use")
        if top not in PACKAGES:
            continue
        their_group, their_layer = group(target)
        if their_group != my_group and their_layer >= my_layer:
            problems.append(f"{here}:{line} imports {target}: layer {their_group} "
                            f"({their_layer}) is not below {my_group} ({my_layer})")
    return problems


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_point_down(path: Path) -> None:
    assert violations(module_name(path), imports(path)) == []


def test_the_checker_can_fail() -> None:
    """Upward and sideways imports, and vLLM in the trainer package, are all caught."""
    assert violations("weightpub_wire.protocol", [("publisher", 3)])
    assert violations("publisher.serving.server",
                      [("subscriber_ext.transport.staging.assembly", 1)])
    assert violations("subscriber_ext.transport.client.sync_client",
                      [("subscriber_ext.vllm_ext.commit", 1)])
    assert violations("subscriber_ext.transport.subscriber", [("vllm.config", 9)])
    assert violations("publisher.store.snapshot", [("publisher.serving.server", 9)])
    assert violations("publisher.serving.server", [("publisher.sharding.shard_coordinator", 9)])
    assert violations("publisher.store.snapshot", [("vllm.config", 9)])
    assert violations("publisher.store.snapshot", [("transformers", 9)])
    assert violations("publisher.callback", [("vllm", 9)])
    assert not violations("publisher.callback", [("transformers", 9)])
    assert not violations("subscriber_ext.vllm_ext.commit.coordinator",
                          [("subscriber_ext.vllm_ext.apply.prepare", 1),
                           ("weightpub_wire.errors", 2)])


def test_no_import_cycles() -> None:
    graph = {module_name(p): {t for t, _ in imports(p)
                              if t.split(".")[0] in PACKAGES and _source_of(t) is not None}
             for p in SOURCES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == node:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)



def test_the_publisher_is_in_sub_packages() -> None:
    """At most 10 modules flat in ``publisher/`` (STYLE.md: more hides sub-systems)."""
    flat = sorted(p.name for p in (REPO / "publisher").glob("*.py") if p.name != "__init__.py")
    assert len(flat) <= 10, flat
    assert {p.name for p in (REPO / "publisher").iterdir() if (p / "__init__.py").is_file()} >= {
        "store", "sources", "deltas", "collective", "serving", "sharding"}


#: every Python file of the repository's own code (tests and benchmarks too)
ALL_SOURCES = sorted(p for top in (*PACKAGES, "tests", "benchmarks")
                     for p in (REPO / top).rglob("*.py"))


def test_dtypes_are_looked_up_only_through_the_allow_list() -> None:
    """``getattr(torch, name)`` reaches any attribute of torch: only ``weightpub_wire.dtypes``
    builds its allow-list that way; everything else calls ``parse_dtype``/``dtype_from_name``."""
    found = []
    for path in ALL_SOURCES:
        if "getattr" not in path.read_text():
            continue  # parse only the files that could hold one
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id == "getattr" and node.args and \
                    isinstance(node.args[0], ast.Name) and node.args[0].id == "torch":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == ["weightpub_wire/dtypes.py:17"], found


def test_wildcard_hosts_are_declared_once() -> None:
    """Which hosts nobody can dial is ``weightpub_wire.endpoints.WILDCARD_HOSTS``, nowhere else."""
    found = []
    for path in ALL_SOURCES:
        if path == Path(__file__).resolve() or "0.0.0.0" not in path.read_text():
            continue  # the pattern below; files that cannot hold one
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Set | ast.Tuple | ast.List) and {"0.0.0.0", "::"} <= {
                    e.value for e in node.elts if isinstance(e, ast.Constant)}:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == ["weightpub_wire/endpoints.py:21"], found


def test_the_serving_front_is_built_in_one_place() -> None:
    """``WeightPublisher`` and ``ShardCoordinator`` compose ``publisher.serving.front``: the
    bind rule, the CURVE hook, the ZAP handler and the serving thread are made there only."""
    makers = {"ServingThread", "start_authenticator", "check_bind_allowed", "curve_server_hook"}
    found = set()
    for path in (REPO / "publisher").rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in makers:
                found.add((str(path.relative_to(REPO)), node.func.id))
    assert found == {("publisher/serving/front.py", name) for name in makers}, found
