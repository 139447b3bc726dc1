"""Session plumbing for a crash of the whole pytest process (a native library aborting).

CI shows only the tail of the output, and faulthandler's dump of every thread plus
the list of loaded extension modules push the test that was running out of it. So
each test's id is written to ``.pytest-running`` as it starts, faulthandler writes
to ``.pytest-faults`` instead of stderr, and after a crash ``make test`` runs
``tests/crash_report.py``, which prints both, short, at the very end. A run that
finishes (passed or failed) removes the two files.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNING = ROOT / ".pytest-running"
FAULTS = ROOT / ".pytest-faults"
_faults: list[IO[str]] = []


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    _faults.append(FAULTS.open("w"))
    faulthandler.enable(file=_faults[0], all_threads=True)


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    RUNNING.write_text(nodeid + "\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _faults:
        faulthandler.disable()
        _faults.pop().close()
    RUNNING.unlink(missing_ok=True)
    FAULTS.unlink(missing_ok=True)
