"""Session plumbing: a crash of the whole pytest process, and parallel workers.

CI shows only the tail of the output, and faulthandler's dump of every thread plus
the list of loaded extension modules push the test that was running out of it. So
each test's id is written to ``.pytest-running`` as it starts, faulthandler writes
to ``.pytest-faults`` instead of stderr, and after a crash ``make test`` runs
``tests/crash_report.py``, which prints both, short, at the very end. A run that
finishes (passed or failed) removes the two files. Under pytest-xdist each worker
has its own pair (``.pytest-running-gw0``): a worker that dies leaves its pair.

``make test`` runs the suite on pytest-xdist workers (``--dist loadgroup``, whose
scheduler this file replaces: pytest 9 ignores the ``xdist_group`` renaming of xdist 3.8).
The vLLM engine tests are in two groups, ``ENGINE_GROUPS``: each runs one after
another on one worker, in the order ``tests/vllm/conftest.py`` gives them, and the two
run at the same time (two engines of 1-4 GB each fit this 24 GB box beside the rest;
one chain alone was the whole run's critical path, 25 of its 25 minutes, with the other
workers idle for the last 12). Every other module goes whole to one of the other
workers (its module fixtures start once). The groups go out first, then the modules
of ``LONG`` (longest first), then the rest in collection order: the scheduler's own
reorder (most tests first) is turned off. A test marked ``vllm`` outside the groups
stops the collection.
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path
from typing import IO, Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
RUNNING = ROOT / (".pytest-running" + (f"-{_WORKER}" if _WORKER else ""))
FAULTS = ROOT / (".pytest-faults" + (f"-{_WORKER}" if _WORKER else ""))
_faults: list[IO[str]] = []
# NIXL (issue 31): UCX listens on every interface unless told; every test process and the
# engines and children it starts (they inherit this) keep it on loopback
os.environ.setdefault("UCX_NET_DEVICES", "lo")

#: the tests that start vLLM engines (node id prefixes: a folder, a module, a test), in
#: two xdist groups of about equal length on CI (each one worker); the modules that share
#: an engine (``tests/vllm/conftest.py``) are in one group. The subprocess-heavy ones (the
#: RL demo, the bench runs) are mostly in the first, with the in-process engines the
#: second does not take. Balanced by CPU-seconds (the run is CPU-bound): session 15
#: measured every module alone over its process tree, less the worker's own start (pytest
#: 1 CPU-s, an in-process engine's vLLM import 9, once per worker): a 413, b 419 CPU-s.
ENGINE_GROUPS: dict[str, tuple[str, ...]] = {
    "engines-a": (
        "tests/rl/test_rl_demo.py",
        "tests/test_bench_scale.py::test_scale_section_with_a_replica",
        "tests/vllm/test_serve.py", "tests/vllm/test_weight_transfer_http.py",
        "tests/vllm/test_weight_transfer_api.py",
        "tests/vllm/test_prepare.py", "tests/vllm/test_moe_qwen2.py",
    ),  # session 13: a ended 1.4 min after b, so test_weight_transfer_tp2 (0.6 min) went to b
    # session 15: b lost a LoRA engine start and three spawned trainers (43 CPU-s), so
    # test_bench_cli.py (28 CPU-s) went to b
    "engines-b": ("tests/test_bench_cli.py", "tests/vllm/"),  # and every other engine module
}

#: modules without an engine that take over a minute on CI's 2 cores: scheduled right
#: after the engine groups, so none of them starts last
LONG = (
    "tests/test_bench_scale.py", "tests/trainer/test_callback_fsdp.py",
    "tests/trainer/test_publish_callback.py", "tests/transport/faults/test_fuzz.py",
    "tests/transport/test_sharded.py", "tests/transport/test_nixl_link.py",
    "tests/transport/test_streamed_sources.py", "tests/transport/faults/test_soak.py",
    "tests/trainer/test_trl_callback.py", "tests/test_fleet_sim.py",
)


#: tests without an engine that take tens of seconds on CI's 2 cores (a soak, a benchmark
#: subprocess, multi-process trainers, fresh interpreters importing everything): marked
#: ``slow`` here, so ``make test-fast`` leaves them out; ``make test`` runs them
SLOW = (
    "tests/test_bench_scale.py::test_scale_section_runs_at_a_tiny_size",
    "tests/trainer/test_callback_fsdp.py::",
    "tests/test_dependencies.py::test_publish_and_subscribe_with_only_runtime_dependencies",
    "tests/transport/faults/test_soak.py::",
    "tests/transport/faults/test_kill_matrix.py::",
    "tests/transport/test_dtensor.py::",
    "tests/transport/test_exports.py::",
    "tests/transport/test_streamed_sources.py::test_fsdp2_ranks_publish",
    "tests/test_fleet_sim.py::",
)


def group_of(nodeid: str) -> str:
    """The xdist group of a test: its engine group (the first whose prefix matches), or
    its module."""
    for name, prefixes in ENGINE_GROUPS.items():
        if nodeid.startswith(prefixes):
            return name
    return nodeid.split("::", 1)[0]


def _schedule_rank(nodeid: str) -> int:
    """Engine groups first (in their order), then ``LONG`` (in its order), then the rest."""
    group = group_of(nodeid)
    if group in ENGINE_GROUPS:
        return list(ENGINE_GROUPS).index(group)
    module = nodeid.split("::", 1)[0]
    return len(ENGINE_GROUPS) + (LONG.index(module) if module in LONG else len(LONG))


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if not _WORKER:  # a new session: what a worker that died last time left is stale
        for stale in [*ROOT.glob(".pytest-running-gw*"), *ROOT.glob(".pytest-faults-gw*")]:
            stale.unlink(missing_ok=True)
    config.pluginmanager.register(_ScheduleOrder(), "weightpub-schedule-order")
    _faults.append(FAULTS.open("w"))
    faulthandler.enable(file=_faults[0], all_threads=True)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under ``tests/vllm/`` is an engine test (``make test-fast`` leaves them
    out by the marker, a module that forgot it too); ``SLOW`` gets the ``slow`` marker;
    every engine test is in the engine group."""
    for item in items:
        if item.nodeid.startswith("tests/vllm/"):
            item.add_marker(pytest.mark.vllm)
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("vllm") and group_of(item.nodeid) not in ENGINE_GROUPS:
            raise pytest.UsageError(
                f"{item.nodeid} is marked vllm (it starts an engine): add its module to "
                "ENGINE_GROUPS in tests/conftest.py, so at most two engines run at once")


class _ScheduleOrder:
    """A plugin of its own: a conftest has one ``pytest_collection_modifyitems``, and this
    one must run last (after ``tests/vllm/conftest.py`` ordered the engine modules)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        items.sort(key=lambda item: _schedule_rank(item.nodeid))  # stable: keeps each order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: the engine tests one unit of work, every other module one."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # our order (``_schedule_rank``), not test counts

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    RUNNING.write_text(nodeid + "\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _faults:
        faulthandler.disable()
        _faults.pop().close()
    RUNNING.unlink(missing_ok=True)
    FAULTS.unlink(missing_ok=True)
