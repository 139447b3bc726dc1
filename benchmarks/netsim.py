"""Simulated hosts on one machine: a network namespace per host, rate-limited links.

A private "switch" namespace holds a bridge; every host namespace is joined to
it by a veth pair whose two ends are shaped with ``tc tbf`` (the host's uplink
on its own end, its downlink on the switch end) and optionally delayed with
``netem``. Nothing is attached to the machine's own namespace unless asked
(``add_root_host``: the machine's own namespace joins the bridge through a
shaped veth of its own, as a trainer running outside any namespace would), so
traffic otherwise only flows between the hosts made here. Addresses come from
198.18.0.0/15, the range set aside for network benchmarks (RFC 2544); a
network attached to the machine's namespace takes a /24 of its own there.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from weightpub.bench.forked import ForkedProcess

__all__ = ["Host", "Link", "Network", "available", "tbf_burst"]


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
    name: str  # namespace name ("" for the machine's own namespace)
    address: str
    link: Link
    procs: list[subprocess.Popen[str] | ForkedProcess] = field(default_factory=list)

    def popen(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
        """Start ``argv`` inside this host's namespace (killed when the network closes)."""
        prefix = ["ip", "netns", "exec", self.name] if self.name else []
        proc: subprocess.Popen[str] = subprocess.Popen(  # type: ignore[call-overload]
            [*prefix, *argv], start_new_session=True, text=True, **kwargs)
        self.procs.append(proc)
        return proc

    def fork(self, target: Callable[..., None], args: tuple[Any, ...], *,
             stderr: IO[Any] | None = None, preload: Sequence[str] = (),
             name: str = "forked") -> ForkedProcess:
        """``target(*args)`` forked from the zygote into this host's namespace, in a
        session of its own: what ``popen`` starts, without an interpreter start (killed
        when the network closes, as those are)."""
        proc = ForkedProcess(target, args, stderr=stderr, preload=preload,
                             netns=self.name or None, new_session=True, name=name)
        self.procs.append(proc)
        return proc


def tbf_burst(mbit: float, gso_max_size: int) -> int:
    """tbf's bucket in bytes: ~2 ms at line rate (so tbf reaches the rate), and more than
    the device's largest GSO packet with its segments' headers (tbf counts them).

    tbf cuts every packet longer than its bucket into MTU-sized segments in software
    (``tbf_segment``); veths hand it 64 KiB GSO packets, so a bucket under ~70 KB (200
    Mbit/s and below at 2 ms) made every packet on every link ~45 packets, a softirq cost
    no real NIC has (it segments in hardware, TSO). On two cores a 16-host fleet at 200
    Mbit/s spent that CPU instead of moving bytes (issue 22.5: 3-4x one host, against
    1.5-1.7x at 400 Mbit/s, whose 100 KB bucket was above it)."""
    return max(32 << 10, int(mbit * 1e6 / 8 * 0.002), gso_max_size + (16 << 10))


def _gso_max_size(at: list[str], dev: str) -> int:
    """The largest packet ``dev`` hands its qdisc (64 KiB when not reported)."""
    shown = subprocess.run(["ip", *at, "-d", "link", "show", "dev", dev], capture_output=True,
                           text=True, timeout=30).stdout.split()
    if "gso_max_size" in shown:
        return int(shown[shown.index("gso_max_size") + 1])
    return 64 << 10


def _shape(ns: str, dev: str, mbit: float | None, delay_ms: float) -> None:
    """tbf (and netem for delay) on ``dev``'s egress inside namespace ``ns`` ("": this one)."""
    if mbit is None and not delay_ms:
        return
    at = ["-n", ns] if ns else []
    parent = "root"
    if delay_ms:
        _run("tc", *at, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
             "delay", f"{delay_ms}ms")
        parent = "parent 1:"
    if mbit is not None:
        burst = tbf_burst(mbit, _gso_max_size(at, dev))
        _run("tc", *at, "qdisc", "add", "dev", dev, *parent.split(), "handle", "10:",
             "tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms")


class Network:
    """A switch namespace and any number of hosts; ``with Network(...) as net:``."""

    def __init__(self, prefix: str = "wpsim") -> None:
        tag = uuid.uuid4().hex[:4]
        self.prefix = f"{prefix}{tag}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        self._root_link: str | None = None  # this machine's end, deleted first on close
        self._subnet = "198.18.0"  # a /24 of its own once attached to the machine's namespace

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
        return self._join(ns, inner, outer, index, link)

    def add_root_host(self, link: Link = Link()) -> Host:
        """The machine's own namespace as a host (first, before any other): a veth from it
        to the bridge, shaped like any host's. Its end lives in the switch's namespace's
        pair, so deleting the switch (``close``, ``reap``) removes it too."""
        if self.hosts:
            raise ValueError("add the machine's own namespace before any other host")
        # a /24 of its own in the machine's routing table, so two such networks can coexist
        self._subnet = f"198.19.{int(self.prefix[-4:], 16) % 254 + 1}"
        inner, outer = f"{self.prefix}r"[-15:], f"{self.prefix[-4:]}p1"  # IFNAMSIZ
        _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer, "netns",
             self.switch)
        self._root_link = inner
        return self._join("", inner, outer, 1, link)

    def _join(self, ns: str, inner: str, outer: str, index: int, link: Link) -> Host:
        """Bridge ``outer``, address and shape ``inner`` (in ``ns``; "": this machine's)."""
        at = ["-n", ns] if ns else []
        _run("ip", "-n", self.switch, "link", "set", outer, "master", "br0")
        _run("ip", "-n", self.switch, "link", "set", outer, "up")
        address = f"{self._subnet}.{index}"
        _run("ip", *at, "addr", "add", f"{address}/24", "dev", inner)
        _run("ip", *at, "link", "set", inner, "up")
        if ns:
            _run("ip", *at, "link", "set", "lo", "up")
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
        if self._root_link is not None:  # a namespace's devices go later (the kernel's
            # cleanup runs in the background): delete this machine's end now
            subprocess.run(["ip", "link", "del", self._root_link], capture_output=True)
            self._root_link = None
        for ns in reversed(self._made):
            _kill_pids_in(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    @staticmethod
    def reap(prefix: str = "wpsim") -> list[str]:
        """Delete namespaces (and kill their processes) left by runs that died."""
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True)
        gone = []
        for line in links.stdout.splitlines():  # this machine's ends (add_root_host)
            name = line.split()[0].split("@")[0] if line.strip() else ""
            if name.startswith(prefix):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
                gone.append(name)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
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
