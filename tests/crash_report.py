"""After pytest died without finishing: which test was running, and how it died.

Run by ``make test`` when pytest fails; prints nothing after an ordinary failure
(``tests/conftest.py`` removes its files when a session finishes). Under pytest-xdist
each worker has its own pair of files (``.pytest-running-gw0``); xdist goes on after a
worker dies, so pytest itself may have finished: the pairs left name the tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAMES_PER_THREAD = 6  # the innermost frames say where each thread was


def main() -> int:
    for running in sorted(ROOT.glob(".pytest-running*")):
        report(running, ROOT / running.name.replace("-running", "-faults"))
    return 0


def report(running: Path, faults: Path) -> None:
    """One process's pair: the test it was running, each thread's innermost frames."""
    who = "pytest" if running.name == ".pytest-running" else running.name.split("-")[-1]
    print(f"\n{who} died while running: {running.read_text().strip()}", file=sys.stderr)
    if faults.exists():
        print("faulthandler's dump, innermost frames of each thread:", file=sys.stderr)
        for block in faults.read_text(errors="replace").split("\n\n"):
            lines = block.strip().splitlines()
            if lines and not lines[0].startswith("Extension modules:"):
                print("\n".join(lines[: 1 + FRAMES_PER_THREAD]), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
