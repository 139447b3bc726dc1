"""Session plumbing: a crash of the whole pytest process, and parallel workers.

CI shows only the tail of the output, and faulthandler's dump of every thread plus
the list of loaded extension modules push the test that was running out of it. So
each test's id is written to ``.pytest-running`` as it starts, faulthandler writes
to ``.pytest-faults`` instead of stderr, and after a crash ``make test`` runs
``tests/crash_report.py``, which prints both, short, at the very end. A run that
finishes (passed or failed) removes the two files. Under pytest-xdist each worker
has its own pair (``.pytest-running-gw0``): a worker that dies leaves its pair.

``make test`` runs the suite on pytest-xdist workers with ``--dist loadgroup``:
every vLLM engine test (marker ``vllm``) is one group, so they run one after another
on one worker (an engine is 2-4 GB; two at once would not fit beside the rest), in
the order ``tests/vllm/conftest.py`` gives them; the other workers take the other
modules, one module at a time (its module fixtures start once).
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parent.parent
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
RUNNING = ROOT / (".pytest-running" + (f"-{_WORKER}" if _WORKER else ""))
FAULTS = ROOT / (".pytest-faults" + (f"-{_WORKER}" if _WORKER else ""))
_faults: list[IO[str]] = []

#: the xdist group of the engine tests
ENGINE_GROUP = "vllm"
#: modules without an engine that still run in the engine group: they assert that no
#: process left an entry in /dev/shm, and an engine running beside them makes one
BESIDE_NO_ENGINE = ("tests/transport/test_node_staging.py",)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if not _WORKER:  # a new session: what a worker that died last time left is stale
        for stale in [*ROOT.glob(".pytest-running-gw*"), *ROOT.glob(".pytest-faults-gw*")]:
            stale.unlink(missing_ok=True)
    _faults.append(FAULTS.open("w"))
    faulthandler.enable(file=_faults[0], all_threads=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups, before -m
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under ``tests/vllm/`` is an engine test (``make test-fast`` leaves them
    out by the marker, a module that forgot it too). Under xdist: the engine tests in one
    group, every other module a group of its own."""
    for item in items:
        if item.nodeid.startswith("tests/vllm/"):
            item.add_marker(pytest.mark.vllm)
    if not _WORKER:
        return
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        engine = item.get_closest_marker("vllm") is not None or module in BESIDE_NO_ENGINE
        item.add_marker(pytest.mark.xdist_group(ENGINE_GROUP if engine else module))


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    RUNNING.write_text(nodeid + "\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _faults:
        faulthandler.disable()
        _faults.pop().close()
    RUNNING.unlink(missing_ok=True)
    FAULTS.unlink(missing_ok=True)
