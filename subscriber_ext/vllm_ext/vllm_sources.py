"""Check what we use of vLLM against a vLLM *source tree*, without importing it.

Why: ``vllm_compat.check_vllm`` verifies the installed vLLM at start, but a vLLM
that cannot be installed here (0.33 ships only as a CUDA wheel) must be checked
too before we claim to support it. This reads the wheel's (or a directory's)
``.py`` files with ``ast``: every ``Internal`` of ``vllm_compat.INTERNALS`` must be
defined (or re-exported) with the parameters we call it with, and every name our
own modules import from vLLM must exist. Inherited methods are found through
base classes named in the same tree.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from subscriber_ext.vllm_ext.vllm_compat import INTERNALS, Internal

__all__ = ["SourceTree", "imported_names", "internal_problems", "missing_imports"]

_MAX_DEPTH = 8


class SourceTree:
    """The ``vllm/`` package of a wheel file, or of a directory holding ``vllm/``, as text."""

    def __init__(self, where: str | Path) -> None:
        path = Path(where)
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._root = path if self._zip is None else None
        self._trees: dict[str, ast.Module | None] = {}

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    def _text(self, relative: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(relative).decode()
            except KeyError:
                return None
        assert self._root is not None
        file = self._root / relative
        return file.read_text() if file.is_file() else None

    def module(self, name: str) -> ast.Module | None:
        """The parsed module ``name`` (``vllm.x.y``), or None where the tree has none."""
        if name not in self._trees:
            base = name.replace(".", "/")
            text = self._text(f"{base}.py")
            if text is None:
                text = self._text(f"{base}/__init__.py")
            self._trees[name] = None if text is None else ast.parse(text)
        return self._trees[name]

    def is_package(self, name: str) -> bool:
        return self._text(f"{name.replace('.', '/')}/__init__.py") is not None


@dataclass
class _Found:
    node: ast.AST
    module: str


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = parts[:keep]
    return ".".join([*base, node.module] if node.module else base)


def _lookup(tree: SourceTree, module: str, name: str, depth: int = 0) -> _Found | None:
    """``name`` defined at the top of ``module`` (following re-exports), or a submodule."""
    parsed = tree.module(module)
    if parsed is None or depth > _MAX_DEPTH:
        return None
    found: _Found | None = None
    for node in parsed.body:
        for inner in _top_level(node):
            hit = _defines(tree, module, inner, name, depth)
            if hit is not None:
                found = hit  # the last definition wins, as at import time
    if found is None and tree.module(f"{module}.{name}") is not None:
        return _Found(tree.module(f"{module}.{name}"), f"{module}.{name}")  # type: ignore[arg-type]
    return found


def _top_level(node: ast.stmt) -> Iterable[ast.stmt]:
    """A statement, and those under a top-level ``if``/``try`` (version guards)."""
    yield node
    if isinstance(node, ast.If):
        for inner in [*node.body, *node.orelse]:
            yield from _top_level(inner)
    elif isinstance(node, ast.Try):
        for inner in [*node.body, *node.orelse, *node.finalbody]:
            yield from _top_level(inner)


def _defines(tree: SourceTree, module: str, node: ast.stmt, name: str,
             depth: int) -> _Found | None:
    if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return _Found(node, module) if node.name == name else None
    if isinstance(node, ast.Assign):
        if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return _Found(node, module)
    if isinstance(node, ast.AnnAssign):
        if isinstance(node.target, ast.Name) and node.target.id == name:
            return _Found(node, module)
    if isinstance(node, ast.ImportFrom):
        for alias in node.names:
            if (alias.asname or alias.name) == name:
                source = _absolute(module, node, tree.is_package(module))
                if not source.startswith("vllm"):
                    return _Found(node, module)  # from a third party: exists if it imports
                return _lookup(tree, source, alias.name, depth + 1)
    return None


def _member(tree: SourceTree, found: _Found, name: str, depth: int = 0) -> _Found | None:
    """Attribute ``name`` of the class ``found``, its bases (named in the tree) included."""
    cls = found.node
    if not isinstance(cls, ast.ClassDef) or depth > _MAX_DEPTH:
        return None
    for node in cls.body:
        hit = _defines(tree, found.module, node, name, depth)
        if hit is not None:
            return hit
    for base in cls.bases:
        target = base.value if isinstance(base, ast.Subscript) else base  # Generic[...]
        if isinstance(target, ast.Name):
            parent = _lookup(tree, found.module, target.id)
            if parent is not None:
                hit = _member(tree, parent, name, depth + 1)
                if hit is not None:
                    return hit
    return None


def _resolve(tree: SourceTree, internal: Internal) -> _Found | None:
    parts = internal.qualname.split(".")
    found = _lookup(tree, internal.module, parts[0])
    for part in parts[1:]:
        if found is None:
            return None
        if isinstance(found.node, ast.Module):
            found = _lookup(tree, found.module, part)
        else:
            found = _member(tree, found, part)
    return found


def _params(node: ast.AST) -> tuple[str, ...] | None:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    args = node.args
    names = tuple(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs])
    bound = any(isinstance(d, ast.Name) and d.id == "classmethod" for d in node.decorator_list)
    return names[1:] if bound else names  # as ``inspect.signature`` of the bound method


def internal_problems(tree: SourceTree,
                      internals: Iterable[Internal] = INTERNALS) -> list[str]:
    """What ``vllm_compat.problems()`` would say of these internals, read from source."""
    found: list[str] = []
    for internal in internals:
        hit = _resolve(tree, internal)
        if hit is None:
            found.append(f"{internal.name} is missing ({internal.why})")
            continue
        if internal.params is None:
            continue
        names = _params(hit.node)
        if names is None:
            found.append(f"{internal.name} has no inspectable signature")
        elif names[: len(internal.params)] != internal.params:
            found.append(f"{internal.name} takes {names}, expected {internal.params} first "
                         f"({internal.why})")
    return found


def imported_names(files: Iterable[Path]) -> set[tuple[str, str]]:
    """Every ``(module, name)`` our ``files`` import from vLLM (``name`` '' for ``import m``)."""
    found: set[tuple[str, str]] = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                    and node.module.split(".")[0] == "vllm":
                found.update((node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update((alias.name, "") for alias in node.names
                             if alias.name.split(".")[0] == "vllm")
    return found


def missing_imports(tree: SourceTree, names: Iterable[tuple[str, str]]) -> list[str]:
    """The imports of ``names`` that would fail against ``tree``."""
    missing = []
    for module, name in sorted(names):
        if tree.module(module) is None:
            missing.append(f"module {module} is missing")
        elif name and _lookup(tree, module, name) is None:
            missing.append(f"{module}:{name} is missing")
    return missing
