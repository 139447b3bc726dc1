"""docs/architecture.md names today's code: every reference resolves, every module is placed.

Why: modules move and methods are renamed faster than prose is reread; a stale
name on the one page that maps the house sends a reader to a room that is gone.
Read with ``ast`` only (nothing is imported: no torch, no vLLM), so it runs in a
second.

A reference is a backticked span of one of these forms (a trailing ``()`` or
call arguments are ignored):

- ``path/to/module.py``, ``module.py``, ``folder/`` (a suffix of one real path;
  module names are unique across the packages, ``tests/test_layers.py``);
- ``path/to/module.py: Name`` or ``: Class.attribute``;
- ``package.module.Name[.attribute]``, ``module.Name[.attribute]`` (the module by
  its dotted name or its unique short name), ``path/to/module.Name``;
- ``Class.attribute`` for a class defined in the packages (methods, properties,
  fields, attributes set on ``self``, inherited ones too);
- a bare ``CamelCase`` name: a class (or other name) the packages define, or one
  of ``EXTERNAL`` (vLLM, PyTorch, transformers names the page also uses).

Anything else in backticks (options, values, commands, snake_case words) is prose.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "architecture.md"
PACKAGES = ("weightpub_wire", "publisher", "subscriber_ext", "weightpub")

#: names from outside the packages the page may use bare (they are not ours to check)
EXTERNAL = frozenset({
    "TrainerCallback", "TCPStore", "ProcessGroupGloo", "MultiprocExecutor", "MemAvailable",
    "ThreadAuthenticator", "ThreadPoolExecutor", "EngineCore", "CollectorRegistry",
    "Future", "Queue", "Condition", "Event", "Lock", "RLock", "Thread", "Struct",
    "None", "True", "False",
})

_SPAN = re.compile(r"`([^`\n]+)`")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"^{_IDENT}(?:\.{_IDENT})+$")
_CAMEL = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")
_PATHLIKE = re.compile(r"^[A-Za-z0-9_.*/-]+$")


@dataclass
class ClassInfo:
    bases: list[str]
    names: set[str] = field(default_factory=set)


@dataclass
class ModuleInfo:
    path: Path
    names: set[str] = field(default_factory=set)  # defined, assigned or imported at top level
    classes: dict[str, ClassInfo] = field(default_factory=dict)


@cache
def module_files() -> tuple[Path, ...]:
    """Every module file of the four packages, as on disk (walked once per run)."""
    return tuple(sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py")
                        if "__pycache__" not in p.parts))


@cache
def _relative_paths(folders: bool) -> tuple[tuple[Path, str], ...]:
    """Each module file (``folders``: each package folder) with its path from the
    repository root, for ``files_ending`` (asked once per path on the page)."""
    pool = [p.parent for p in module_files() if p.name == "__init__.py"] if folders \
        else module_files()
    return tuple((p, p.relative_to(REPO).as_posix()) for p in pool)


def dotted(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _class_info(node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(bases=[b.id if isinstance(b, ast.Name) else
                            b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases])
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info.names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            info.names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            info.names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):  # attributes set on self anywhere in the class
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = list(sub.targets)
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            elts = target.elts if isinstance(target, ast.Tuple) else [target]
            info.names.update(t.attr for t in elts if isinstance(t, ast.Attribute)
                              and isinstance(t.value, ast.Name) and t.value.id == "self")
    return info


def _module_info(path: Path) -> ModuleInfo:
    info = ModuleInfo(path)
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ClassDef):
            info.names.add(node.name)
            info.classes[node.name] = _class_info(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            info.names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            info.names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            info.names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return info


@cache
def index() -> dict[str, ModuleInfo]:
    """Dotted module name -> what it defines."""
    return {dotted(p): _module_info(p) for p in module_files()}


@cache
def short_names() -> dict[str, list[str]]:
    """A module's last name component -> the dotted names that end with it."""
    found: dict[str, list[str]] = {}
    for name in index():
        found.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return found


@cache
def classes() -> dict[str, list[ClassInfo]]:
    found: dict[str, list[ClassInfo]] = {}
    for module in index().values():
        for name, info in module.classes.items():
            found.setdefault(name, []).append(info)
    return found


def class_has(name: str, attribute: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether any class called ``name`` has ``attribute``, itself or through its bases."""
    if name in seen:
        return False
    for info in classes().get(name, []):
        if attribute in info.names:
            return True
        if any(class_has(base, attribute, seen | {name}) for base in info.bases):
            return True
    return False


def module_has(module: str, names: list[str]) -> bool:
    """``names`` (``[Name]`` or ``[Class, attribute]``) inside ``module``."""
    info = index()[module]
    if not names:
        return True
    if names[0] not in info.names:
        return False
    if len(names) == 1:
        return True
    if names[0] in info.classes:
        return class_has(names[0], names[1]) and len(names) == 2
    return True  # an attribute of an imported object: the import is what we can check


def files_ending(suffix: str) -> list[Path]:
    """Files (or folders, ``suffix`` ending in /) of the repository ending with ``suffix``."""
    suffix = suffix.removeprefix("./")
    want_dir = suffix.endswith("/")
    suffix = suffix.rstrip("/")
    if "*" in suffix:
        return sorted(REPO.glob(suffix))
    exact = REPO / suffix
    if exact.exists() and exact.is_dir() == want_dir:
        return [exact]
    return [p for p, posix in _relative_paths(want_dir) if posix.endswith("/" + suffix)]


def _strip_call(span: str) -> str:
    return re.sub(r"\(.*\)$", "", span.strip())


@dataclass
class Reading:
    stale: list[str] = field(default_factory=list)
    placed: set[Path] = field(default_factory=set)


def _check_path(span: str, rest: str, reading: Reading) -> None:
    """``path`` (a file or a folder), with ``rest`` a ``Name[.attribute]`` inside it."""
    if span.startswith("../"):
        return  # outside the repository (the shared design notes)
    found = files_ending(span)
    if len(found) != 1 and "*" not in span:
        reading.stale.append(f"`{span}`: {'no such file' if not found else 'ambiguous'}")
        return
    if not found:
        reading.stale.append(f"`{span}`: the pattern matches nothing")
        return
    if "*" in span:
        return
    path = found[0]
    reading.placed.add(path / "__init__.py" if path.is_dir() else path)
    if rest and path.suffix == ".py":
        if path not in module_files():
            return  # tests, benchmarks: the file is what the page names
        if not module_has(dotted(path), rest.split(".")):
            reading.stale.append(f"`{span}: {rest}`: {dotted(path)} has no {rest}")


def _check_dotted(span: str, reading: Reading) -> None:
    parts = span.split(".")
    modules = index()
    for cut in range(len(parts), 0, -1):  # the longest prefix that names a module
        head = ".".join(parts[:cut])
        names = [head] if head in modules else short_names().get(head, []) if cut == 1 else []
        if not names:
            continue
        if len(names) > 1:
            reading.stale.append(f"`{span}`: {head} is ambiguous ({', '.join(names)})")
            return
        reading.placed.add(modules[names[0]].path)
        if not module_has(names[0], parts[cut:]):
            reading.stale.append(f"`{span}`: {names[0]} has no {'.'.join(parts[cut:])}")
        return
    if parts[0] in classes():
        if len(parts) != 2 or not class_has(parts[0], parts[1]):
            reading.stale.append(f"`{span}`: class {parts[0]} has no {'.'.join(parts[1:])}")
    elif _CAMEL.match(parts[0]) and parts[0] not in EXTERNAL:
        reading.stale.append(f"`{span}`: no class {parts[0]} in the packages")


def _defined_anywhere(name: str) -> bool:
    return any(name in m.names for m in index().values())


def read_page(text: str) -> Reading:
    """Every stale reference on ``text`` (one line each) and the module files it places."""
    reading = Reading()
    for raw in _SPAN.findall(text):
        span = raw.strip()
        path, sep, rest = span.partition(": ")
        if sep and _PATHLIKE.match(path) and ("/" in path or path.endswith(".py")):
            _check_path(path, _strip_call(rest), reading)
            continue
        span = _strip_call(span)
        if not re.fullmatch(r"[A-Za-z0-9_./*-]+", span) or span.startswith("/"):
            continue  # prose, code, options, an URL path (``/metrics``): not a name
        if "/" in span or span.endswith(".py"):
            head, _, attr = span.rpartition("/")
            if "." in attr and not attr.endswith(".py") and not attr.endswith(".md"):
                module, _, rest = attr.partition(".")  # path/to/module.Name
                _check_path(f"{head}/{module}.py", rest, reading)
            elif span.endswith((".py", "/")) or "*" in span:
                _check_path(span, "", reading)
            elif (REPO / span).exists() or (REPO / "docs" / span).exists():
                continue  # another page of the repository
            else:
                _check_path(span + ".py", "", reading)  # `weightpub_wire/checksums`
        elif _DOTTED.match(span):
            _check_dotted(span, reading)
        elif _CAMEL.match(span) and span not in EXTERNAL and not _defined_anywhere(span):
            reading.stale.append(f"`{span}`: not defined in the packages")
    return reading


def unplaced(text: str) -> list[str]:
    """Module files of the four packages that ``text`` never names."""
    placed = read_page(text).placed
    return [p.relative_to(REPO).as_posix() for p in module_files() if p not in placed]


# -- the page ---------------------------------------------------------------------------------
def test_every_reference_on_the_page_resolves() -> None:
    stale = read_page(PAGE.read_text()).stale
    assert not stale, "docs/architecture.md names what is gone:\n" + "\n".join(stale)


def test_every_module_is_placed_on_the_page() -> None:
    missing = unplaced(PAGE.read_text())
    assert not missing, ("docs/architecture.md never names these modules (add them to the "
                         "module table):\n" + "\n".join(missing))


def test_every_thread_is_in_the_thread_table() -> None:
    """The thread table names each thread the packages start, and no thread that is gone."""
    started = {m for path in module_files()
               for m in re.findall(r'name(?:_prefix)?="(weightpub-[a-z0-9-]+)"', path.read_text())}
    named = set(re.findall(r"`(weightpub-[a-z0-9-]+)`", PAGE.read_text()))
    assert started - named == set(), "threads missing from the page's thread table"
    assert named - started == set(), "the page names threads nobody starts"


# -- the checker itself -----------------------------------------------------------------------
def test_the_checker_finds_stale_references() -> None:
    page = "\n".join([
        "`publisher/no_such_module.py` and `no_such_module.py`",
        "`publisher/weight_publisher.py: WeightPublisher._no_such_loop()`",
        "`WeightPublisher._no_such_loop` and `snapshot.no_such_function`",
        "`weightpub_wire/buffers.NoSuchPool` and `NoSuchClass`",
        "`subscriber_ext.transport.subscriber.WeightSubscriber.no_such`",
    ])
    stale = read_page(page).stale
    assert len(stale) == 8, stale
    for name in ("no_such_module.py", "_no_such_loop", "no_such_function", "NoSuchPool",
                 "NoSuchClass", "WeightSubscriber.no_such"):
        assert any(name in line for line in stale), (name, stale)


def test_the_checker_accepts_live_references_and_prose() -> None:
    page = "\n".join([
        "`publisher/weight_publisher.py: WeightPublisher.publish()` `version_preparer.py`",
        "`VersionPreparer.copy_and_hash` `snapshot.copy_in_priority_order` "
        "`subscriber_ext/vllm_ext/apply/`",
        "`weightpub_wire/buffers.BufferPool` `DeltaAssembly.verify` (inherited) `wire.X`",
        "`copy=False, track=True` `window_bytes` `WAKEUP` `TCPStore` `kill -9`",
        "`subscriber_ext.transport.subscriber.WeightSubscriber.close`",
    ])
    reading = read_page(page)
    assert reading.stale == []
    assert REPO / "publisher" / "version_preparer.py" in reading.placed
    assert REPO / "subscriber_ext" / "vllm_ext" / "apply" / "__init__.py" in reading.placed


def test_the_checker_finds_an_unplaced_module() -> None:
    page = PAGE.read_text().replace("`publisher/version_preparer.py`", "`the preparer`")
    page = page.replace("`version_preparer.py`", "")
    page = re.sub(r"`[^`]*version_preparer[^`]*`", "", page)
    assert "publisher/version_preparer.py" in unplaced(page)
