"""Simulated hosts on one machine: a network namespace per host, rate-limited links.

A private "switch" namespace holds a bridge; every host namespace is joined to
it by a veth pair whose two ends are shaped with ``tc tbf`` (the host's uplink
on its own end, its downlink on the switch end) and optionally delayed with
``netem``. Nothing is attached to the machine's own namespace, so traffic can
only flow between the hosts made here. Addresses come from 198.18.0.0/15, the
range set aside for network benchmarks (RFC 2544).

Needs root (``ip netns``). ``Network`` is a context manager: leaving it kills
every process it started in its namespaces and deletes them, also after an
exception or Ctrl-C; ``Network.reap(prefix)`` removes leftovers of a run that
was killed outright.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Host", "Link", "Network", "available"]


def available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and if not, why."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool!r} (iproute2) is not installed"
    probe = f"wpprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class Link:
    """One host's connection to the switch. Rates in Mbit/s (None: unshaped)."""

    up_mbit: float | None = 400.0
    down_mbit: float | None = 400.0
    delay_ms: float = 0.0


@dataclass
class Host:
    name: str  # namespace name
    address: str
    link: Link
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def popen(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
        """Start ``argv`` inside this host's namespace (killed when the network closes)."""
        proc: subprocess.Popen[str] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.name, *argv], start_new_session=True, text=True,
            **kwargs)
        self.procs.append(proc)
        return proc


def _shape(ns: str, dev: str, mbit: float | None, delay_ms: float) -> None:
    """tbf (and netem for delay) on ``dev``'s egress inside namespace ``ns``."""
    if mbit is None and not delay_ms:
        return
    parent = "root"
    if delay_ms:
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
             "delay", f"{delay_ms}ms")
        parent = "parent 1:"
    if mbit is not None:
        # burst: at least one MTU and ~2 ms at line rate, so tbf reaches the rate
        burst = max(32 << 10, int(mbit * 1e6 / 8 * 0.002))
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent.split(), "handle", "10:",
             "tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms")


class Network:
    """A switch namespace and any number of hosts; ``with Network(...) as net:``."""

    def __init__(self, prefix: str = "wpsim") -> None:
        self.prefix = f"{prefix}{uuid.uuid4().hex[:4]}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: list[Host] = []
        self._made: list[str] = []

    def __enter__(self) -> Network:
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def add_host(self, link: Link = Link()) -> Host:
        index = len(self.hosts) + 1
        if index > 250:
            raise ValueError("at most 250 hosts per network")
        ns = f"{self.prefix}-h{index}"
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        inner, outer = f"eth{index}", f"{self.prefix[-4:]}p{index}"
        _run("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer,
             "netns", self.switch)
        _run("ip", "-n", self.switch, "link", "set", outer, "master", "br0")
        _run("ip", "-n", self.switch, "link", "set", outer, "up")
        address = f"198.18.0.{index}"
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        _run("ip", "-n", ns, "link", "set", inner, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _shape(ns, inner, link.up_mbit, link.delay_ms)  # host -> switch: its uplink
        _shape(self.switch, outer, link.down_mbit, 0.0)  # switch -> host: its downlink
        host = Host(ns, address, link)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        """Kill every process started here, then delete the namespaces (idempotent)."""
        for host in self.hosts:
            for proc in host.procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for proc in host.procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self._made):
            _kill_pids_in(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    @staticmethod
    def reap(prefix: str = "wpsim") -> list[str]:
        """Delete namespaces (and kill their processes) left by runs that died."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        gone = []
        for line in listed.stdout.splitlines():
            ns = line.split()[0] if line.strip() else ""
            if ns.startswith(prefix):
                _kill_pids_in(ns)
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                gone.append(ns)
        return gone


def _kill_pids_in(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        if not left.stdout.strip():
            return
        time.sleep(0.05)
