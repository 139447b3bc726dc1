"""After pytest died without finishing: which test was running, and how it died.

Run by ``make test`` when pytest fails; prints nothing after an ordinary failure
(``tests/conftest.py`` removes its files when a session finishes).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAMES_PER_THREAD = 6  # the innermost frames say where each thread was


def main() -> int:
    running, faults = ROOT / ".pytest-running", ROOT / ".pytest-faults"
    if not running.exists():
        return 0
    print(f"\npytest died while running: {running.read_text().strip()}", file=sys.stderr)
    if faults.exists():
        print("faulthandler's dump, innermost frames of each thread:", file=sys.stderr)
        for block in faults.read_text(errors="replace").split("\n\n"):
            lines = block.strip().splitlines()
            if lines and not lines[0].startswith("Extension modules:"):
                print("\n".join(lines[: 1 + FRAMES_PER_THREAD]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
