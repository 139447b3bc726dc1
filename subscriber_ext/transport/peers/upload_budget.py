"""How much a subscriber may upload to its peers: a byte rate and a share of one CPU core.

Serving peers must never slow generation much, so both bounds are checked
before each chunk is handed to ZeroMQ (libtorrent bounds uploads the same way:
a token bucket per rate class in front of every send):

- a token bucket of ``rate`` bytes/s. A chunk may go while the bucket is not
  in debt and then takes its size out of it, so the long-run rate is exact and
  a burst is at most one chunk plus ``burst_seconds`` of tokens;
- a CPU share: the serving work (this thread's time in the peer server, plus
  the peer ROUTER's own ZeroMQ I/O thread, which does the kernel copies and the
  CURVE encryption) is measured every ``window`` seconds. When it exceeds
  ``cpu_share`` of one core, the effective rate drops to what fits; it grows
  back by half per window while there is headroom.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["ThreadCpu", "UploadBudget", "find_thread"]

_TASKS = Path("/proc/self/task")


def find_thread(name_prefix: str) -> int | None:
    """The id of this process's thread whose name starts with ``name_prefix`` (Linux)."""
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            if (task / "comm").read_text().startswith(name_prefix):
                return int(task.name)
        except (OSError, ValueError):
            continue
    return None


class ThreadCpu:
    """CPU seconds one thread of this process has used (0.0 where /proc cannot tell).

    Give the thread's id, or the start of its name (looked up until found: a thread
    names itself after it starts).
    """

    def __init__(self, tid: int | None = None, name_prefix: str | None = None) -> None:
        self.tid = tid
        self.name_prefix = name_prefix
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def seconds(self) -> float:
        if self.tid is None and self.name_prefix is not None:
            self.tid = find_thread(self.name_prefix)
        if self.tid is None:
            return 0.0
        task = _TASKS / str(self.tid)
        try:  # nanoseconds on the CPU, when the kernel keeps schedstats
            return int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime
        except (OSError, ValueError, IndexError):
            return 0.0


class UploadBudget:
    """Token bucket plus CPU-share feedback; used by one thread (the subscriber's)."""

    def __init__(self, rate: float | None, cpu_share: float | None,
                 io_thread: ThreadCpu | None = None, *, window: float = 0.5,
                 burst_seconds: float = 0.05, min_rate: float = 1 << 20) -> None:
        self.rate = rate  # bytes/s, None: no rate bound
        self.cpu_share = cpu_share  # of one core, None: no CPU bound
        self.io_thread = io_thread
        self.window = window
        self.burst_seconds = burst_seconds
        self.min_rate = min_rate
        self.cpu_rate = math.inf  # what the CPU share allows, learned per window
        self.bytes_sent = 0
        self.measured_share = 0.0  # serving CPU / wall time in the last window
        self.measured_rate = 0.0  # bytes/s in the last window
        self._tokens = 0.0
        self._last: float | None = None
        self._python_seconds = 0.0
        self._window_start: float | None = None
        self._window_bytes = 0
        self._window_cpu = 0.0

    @property
    def effective_rate(self) -> float:
        return min(self.rate or math.inf, self.cpu_rate)

    def delay(self, nbytes: int, now: float) -> float:
        """0.0: send ``nbytes`` now (they are counted); otherwise seconds to wait first."""
        self._roll_window(now)
        rate = self.effective_rate
        if math.isfinite(rate):
            if self._last is None:
                self._last = now
            burst = rate * self.burst_seconds
            self._tokens = min(burst, self._tokens + (now - self._last) * rate)
            self._last = now
            if self._tokens < -1.0:  # in debt by a byte or more (not float dust)
                return max(-self._tokens / rate, 1e-3)
            self._tokens -= nbytes
        self.bytes_sent += nbytes
        self._window_bytes += nbytes
        return 0.0

    def refund(self, nbytes: int) -> None:
        """``nbytes`` counted by ``delay`` were not sent after all."""
        self.bytes_sent -= nbytes
        self._window_bytes -= nbytes
        if math.isfinite(self.effective_rate):
            self._tokens += nbytes

    def charge(self, seconds: float) -> None:
        """Serving work done on the calling thread (measured by the caller)."""
        self._python_seconds += seconds

    @property
    def cpu_seconds(self) -> float:
        """CPU spent serving so far: the upload's ZeroMQ I/O thread plus the serving work
        charged on the subscriber's thread (a bench divides it by ``bytes_sent``)."""
        return self._cpu_now()

    def _cpu_now(self) -> float:
        io = self.io_thread.seconds() if self.io_thread is not None else 0.0
        return io + self._python_seconds

    def _roll_window(self, now: float) -> None:
        if self._window_start is None:
            self._window_start, self._window_cpu = now, self._cpu_now()
            return
        elapsed = now - self._window_start
        if elapsed < self.window:
            return
        cpu = self._cpu_now()
        self.measured_share = (cpu - self._window_cpu) / elapsed
        self.measured_rate = self._window_bytes / elapsed
        if self.cpu_share is not None and self.measured_share > self.cpu_share \
                and self._window_bytes:
            fits = self.measured_rate * self.cpu_share / self.measured_share
            self.cpu_rate = max(self.min_rate, 0.9 * fits)
        elif math.isfinite(self.cpu_rate):
            self.cpu_rate *= 1.5
            if self.rate is not None and self.cpu_rate >= self.rate:
                self.cpu_rate = math.inf
        self._window_start, self._window_cpu, self._window_bytes = now, cpu, 0

    def stats(self) -> dict[str, float | None]:
        rate = self.effective_rate
        return {
            "upload_bytes": self.bytes_sent,
            "upload_rate_limit": self.rate,
            "upload_cpu_share_limit": self.cpu_share,
            "upload_rate_now": round(self.measured_rate, 1),
            "upload_cpu_share_now": round(self.measured_share, 4),
            "upload_effective_rate": None if math.isinf(rate) else round(rate, 1),
            # CPU spent serving so far: all of it, and the subscriber thread's part
            "upload_cpu_s": round(self._cpu_now(), 4),
            "upload_serve_cpu_s": round(self._python_seconds, 4),
        }
