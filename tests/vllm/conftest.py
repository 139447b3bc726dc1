"""Shared engines for the vLLM tests (starting one costs 15-25 s on 2 cores)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # no shutdown warnings into closed streams


SHM = Path("/dev/shm")


@pytest.fixture(scope="session", autouse=True)
def _remove_vllm_shared_memory_left_behind() -> Iterator[None]:
    """vLLM's CPU shared-memory communicator (TP=2) leaves two 4 MiB ``vllm_dist_*`` files
    per engine in /dev/shm after the engine is gone; a container's 64 MiB /dev/shm fills
    up. Remove the ones that appeared during this session, once every engine is closed,
    unless a living process still maps them (the other engine group's worker runs its
    engines beside this one: ``tests/conftest.py``)."""
    before = set(SHM.glob("vllm_dist_*")) if SHM.is_dir() else set()
    yield
    from tests.transport.shm_probe import mapped_paths

    from .helpers import SHUTDOWNS

    for thread in SHUTDOWNS:  # engines shut down in the background (``shut_down``)
        thread.join(timeout=60)
    if SHM.is_dir():
        in_use = mapped_paths("/dev/shm/vllm_dist_")
        for path in set(SHM.glob("vllm_dist_*")) - before:
            if str(path) not in in_use:
                path.unlink(missing_ok=True)


# ------------------------------------------------------------ engines shared by modules
#: fixture name -> (tiny model kind, TP size, its modules in the order they run). Modules
#: that start an engine with exactly these options (``make_llm``'s defaults) and can take
#: it as the module before left it share one start (15-25 s on CI's 2 cores): they run one
#: after another in this order, wherever the first of them was collected, and the engine
#: is shut down after the last test that uses it.
SHARED_ENGINES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    # the first needs it fresh (outputs of the checkpoint's weights)
    "qwen2_tp1_engine": ("qwen2", 1, ("test_tp1_qwen2.py", "test_transport_e2e.py",
                                      "test_lora_merge.py")),
    # the last kills it
    "qwen2_tp2_engine": ("qwen2", 2, ("test_collective_tp2.py", "test_slice_plans.py",
                                      "test_slice_receive.py", "test_nixl_tp2.py",
                                      "test_node_staging.py")),
}
_engines: dict[str, Any] = {}
_last_user: dict[str, str] = {}


def _shared_engine(name: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if name not in _engines:
        from .helpers import make_llm, save_tiny

        kind, tp, _ = SHARED_ENGINES[name]
        _engines[name] = make_llm(save_tiny(kind, 0, tmp_path_factory.mktemp(name)), tp=tp)
    return _engines[name]


@pytest.fixture(scope="module")
def qwen2_tp1_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Tiny Qwen2 at TP=1, fresh for test_tp1_qwen2.py."""
    return _shared_engine("qwen2_tp1_engine", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen2_tp2_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Tiny Qwen2 at TP=2, fresh for test_collective_tp2.py."""
    return _shared_engine("qwen2_tp2_engine", tmp_path_factory)


def _engines_of(item: pytest.Item) -> set[str]:
    return SHARED_ENGINES.keys() & set(getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that share an engine run one after another, in their listed order, at
    the place of the first one collected (no other engine starts while it waits); every
    other module keeps its place."""
    modules: dict[Any, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    uses = {path: set().union(*map(_engines_of, group)) for path, group in modules.items()}
    order: list[Any] = []
    for path in modules:
        if path in order:
            continue
        order.append(path)
        for name in sorted(uses[path]):
            listed = SHARED_ENGINES[name][2]
            group = [p for p in modules if name in uses[p]]
            group.sort(key=lambda p: listed.index(p.name) if p.name in listed else len(listed))
            if path in group[1:]:  # collected before the module that must run first
                order.remove(path)
            order += [p for p in group if p not in order]
    items[:] = [item for path in order for item in modules[path]]


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        for name in _engines_of(item):
            _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test that uses a shared engine, shut it down (the module fixtures
    that held it are torn down by now), as a module fixture's engine is."""
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid and name in _engines:
            from .helpers import shut_down

            shut_down(_engines.pop(name))
