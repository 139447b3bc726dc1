"""Rate-limited warnings: a flood of bad input costs one log line per interval, not one per frame.

The first occurrence of each kind is logged at once (so a single problem is
seen immediately); later ones within ``interval`` seconds are counted, and the
next line says how many were suppressed and repeats the newest text::

    WARNING dropped a bad request: fetch.chunks: ... (+4212 more in the last 10s)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """At most one line per ``key`` per ``interval`` seconds, with a count of the rest."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 256) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        # key -> (time of the last line, suppressed since, newest suppressed text)
        self._state: dict[str, tuple[float, int, str]] = {}
        self.total = 0  # every call, logged or not (tests and metrics read it)

    def log(self, level: int, key: str, text: str) -> bool:
        """Log ``text`` unless ``key`` was logged within the interval; True if it was."""
        now = self._clock()
        with self._lock:
            self.total += 1
            last, suppressed, _ = self._state.get(key, (-1e18, 0, ""))
            if now - last < self.interval:
                self._state[key] = (last, suppressed + 1, text)
                return False
            if key not in self._state and len(self._state) >= self._max_keys:
                self._state.pop(next(iter(self._state)))  # bounded: forget the oldest key
            self._state[key] = (now, 0, text)
        if suppressed:
            span = min(now - last, self.interval * 2)
            self.logger.log(level, "%s (+%d more in the last %.0fs)", text, suppressed, span)
        else:
            self.logger.log(level, "%s", text)
        return True

    def warning(self, key: str, text: str) -> bool:
        return self.log(logging.WARNING, key, text)

    def tick(self, *, force: bool = False) -> int:
        """Write the summary of every key whose interval has passed (all with ``force``).

        Called from a loop (the publisher's serving thread, the subscriber's thread) so a
        flood that stops still gets its closing count. Returns the number of lines written.
        """
        now = self._clock()
        with self._lock:
            due = [(k, n, t) for k, (last, n, t) in self._state.items()
                   if n and (force or now - last >= self.interval)]
            for key, _, text in due:
                self._state[key] = (now, 0, text)
        for _, count, text in due:
            self.logger.warning("%s (+%d more like it)", text, count)
        return len(due)
