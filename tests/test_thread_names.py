"""Every thread weightpub starts has one name of its own, named after its job.

Why: a stack dump (``py-spy dump``, the crash report, ``threading.enumerate()``)
is read by thread name; two threads of one name, or a ``Thread-7``, hide which
job hung. Read from the source (nothing is started): every ``Thread(...)``, every
``super().__init__(name=...)`` of a ``Thread`` subclass and every
``ThreadPoolExecutor(thread_name_prefix=...)`` in the packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("publisher", "subscriber_ext", "weightpub", "weightpub_wire")
#: modules whose threads are named by whoever makes them (``accept_name=``, ``conn_name=``
#: literals at the call, which the scan reads there): one core serves two ports
NAMED_BY_OWNER = {"weightpub_wire/stream_port.py"}


def _callee(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _thread_subclasses(tree: ast.Module) -> set[ast.ClassDef]:
    return {node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            and any(isinstance(b, ast.Attribute | ast.Name)
                    and (getattr(b, "attr", None) or getattr(b, "id", None)) == "Thread"
                    for b in node.bases)}


def _names_in(path: Path) -> list[tuple[str, str | None]]:
    """(where, name) for each thread (or thread pool) this file creates; None: unnamed."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, str | None]] = []

    def keyword(call: ast.Call, name: str) -> str | None:
        for kw in call.keywords:
            if kw.arg == name:
                value = kw.value
                return value.value if isinstance(value, ast.Constant) and \
                    isinstance(value.value, str) else "<not a literal>"
        return None

    named_by_owner = path.relative_to(ROOT).as_posix() in NAMED_BY_OWNER
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        callee = _callee(node)
        if callee == "Thread" and not named_by_owner:
            found.append((where, keyword(node, "name")))
        elif callee == "ThreadPoolExecutor":
            found.append((where, keyword(node, "thread_name_prefix")))
        for owner_keyword in ("accept_name", "conn_name"):  # a StreamPort's owner names them
            if keyword(node, owner_keyword) is not None:
                found.append((where, keyword(node, owner_keyword)))
    for cls in _thread_subclasses(tree):
        for node in ast.walk(cls):
            if isinstance(node, ast.Call) and _callee(node) == "__init__" and \
                    isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Call) and \
                    _callee(node.func.value) == "super":
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}",
                              keyword(node, "name")))
    return found


def _all_names() -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.extend(_names_in(path))
    return found


def test_threads_are_found() -> None:
    # the scan itself must see the threads we know of, or it proves nothing
    names = {name for _, name in _all_names()}
    assert {"weightpub-subscriber", "weightpub-publish-serve", "weightpub-apply-prepare",
            "weightpub-publish-announce", "weightpub-collective-rx"} <= names, names


def test_every_thread_has_a_unique_weightpub_name() -> None:
    found = _all_names()
    unnamed = [where for where, name in found if name is None or name == "<not a literal>"]
    assert not unnamed, f"threads without a literal name=: {unnamed}"
    wrong = [(where, name) for where, name in found
             if name is not None and not name.startswith("weightpub-")]
    assert not wrong, f"thread names must start with 'weightpub-': {wrong}"
    seen: dict[str, str] = {}
    twice = []
    for where, name in found:
        assert name is not None
        if name in seen:
            twice.append((name, seen[name], where))
        seen[name] = where
    assert not twice, f"thread names used twice: {twice}"
