"""A stalling, truncating or corrupting TCP proxy (its own process) between the two sides.

The subscriber dials the proxy (127.0.0.2), which forwards the ROUTER and the
PUB port to the publisher (127.0.0.1). Faults are switched on while a version
is in flight; afterwards that version (or the next) must arrive bit-exact, and
nothing else may ever be offered.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.faults.harness import Recorder
from tests.transport.faults.tools import rss_mib
from tests.transport.procs import REPO, det_weights, pace_replies, wait_until
from weightpub_wire.endpoints import parse_endpoint

pytestmark = pytest.mark.timeout(120)
SEED = 5
SPEC = [("big", "float32", [2048, 1024])]  # 8 MiB in 64 chunks of 128 KiB


class ProxyProcess:
    def __init__(self, ports: list[int]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.transport.faults.proxy", "127.0.0.2", "127.0.0.1",
             ",".join(map(str, ports))], cwd=REPO, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def command(self, text: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        reply = self._line()
        assert reply.startswith(f"ok {text}"), reply
        return reply

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def rig() -> Iterator[dict[str, Any]]:
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=128 << 10, heartbeat_interval=0.2)
    router_port = parse_endpoint(pub.endpoint).port
    pub_port = parse_endpoint(pub._server.pub_endpoint).port
    assert router_port and pub_port
    proxy = ProxyProcess([router_port, pub_port])
    recorder = Recorder(seeds={pub.publisher_id: SEED},
                        specs={v: SPEC for v in range(1, 10)})
    sub = WeightSubscriber(f"tcp://127.0.0.2:{router_port}", on_version=recorder,
                           request_timeout=1.0, window_bytes=1 << 20, chunks_per_request=2)
    pace_replies(sub._client, 0.008)  # ~0.5 s per version: faults land mid-way
    before = rss_mib()
    yield {"pub": pub, "proxy": proxy, "sub": sub, "recorder": recorder}
    grown = rss_mib() - before
    assert grown < 200, f"RSS grew {grown:.0f} MiB"  # two 8 MiB versions per side, plus noise
    start = time.monotonic()
    sub.close()
    assert time.monotonic() - start < 15
    proxy.close()
    pub.close()


def _version(rig: dict[str, Any], version: int) -> None:
    rig["pub"].publish(det_weights(SEED, version, SPEC), version=version)


def _in_flight(rig: dict[str, Any], version: int) -> None:
    wait_until(lambda: rig["sub"].status()["fetching_version"] == version
               and (rig["sub"].status()["fetching_fraction"] or 0) > 0.2, 30,
               f"v{version} to be in flight")


def _arrives(rig: dict[str, Any], version: int, timeout: float = 60) -> None:
    pub_id = rig["pub"].publisher_id
    try:
        wait_until(lambda: rig["recorder"].got(pub_id, version), timeout,
                   f"v{version} bit-exact")
    except AssertionError as exc:  # say where the subscriber stands, not only that it is late
        status = {k: v for k, v in rig["sub"].status().items() if v not in (None, 0, {}, [])}
        raise AssertionError(f"{exc}; subscriber: {status}; publisher fleet: "
                             f"{rig['pub'].fleet()}") from None
    assert rig["recorder"].problems == []


def test_stalling_proxy(rig: dict[str, Any]) -> None:
    before = rss_mib()
    _version(rig, 1)
    _arrives(rig, 1)
    _version(rig, 2)
    _in_flight(rig, 2)
    rig["proxy"].command("stall")
    time.sleep(4)  # longer than the request timeout and the heartbeat TTL
    assert not rig["recorder"].got(rig["pub"].publisher_id, 2)
    rig["proxy"].command("pass")
    _arrives(rig, 2)
    print(f"\nstall: v2 arrived after a 4 s stall; RSS {before:.0f} -> {rss_mib():.0f} MiB")


def test_truncating_proxy(rig: dict[str, Any]) -> None:
    _version(rig, 1)
    _arrives(rig, 1)
    for version in (2, 3, 4):
        _version(rig, version)
        _in_flight(rig, version)
        rig["proxy"].command("truncate")  # every connection torn mid-version
        _arrives(rig, version)
    assert rig["sub"]._thread.is_alive()


@pytest.mark.parametrize("mib", [512, 4 << 20])
def test_a_reply_stream_that_never_frames_again_is_dialled_anew(
        rig: dict[str, Any], mib: int) -> None:
    """One corrupted length field on the ROUTER -> DEALER stream. 512 MiB (under the
    DEALER's ``MAXMSGSIZE``): every reply is swallowed into a frame that never ends
    and ZMTP heartbeats drop the connection. 4 TiB: ZeroMQ ends it as a protocol
    error and never redials by itself, while the SUB socket's heartbeats keep the
    publisher looking alive; the subscriber notices that no reply came and dials
    again. Either way the versions arrive and nothing partial is offered."""
    _version(rig, 1)
    _arrives(rig, 1)
    _version(rig, 2)
    _in_flight(rig, 2)
    rig["proxy"].command(f"desync {mib}")  # at the next frame boundary: during v2, or after
    _arrives(rig, 2, timeout=30)
    _version(rig, 3)
    _arrives(rig, 3, timeout=30)
    assert rig["proxy"].command("pass").endswith("desynced=1")  # the stream did break
    if mib > 1024:
        assert rig["sub"].status()["redials"] >= 1


def test_corrupting_proxy(rig: dict[str, Any]) -> None:
    _version(rig, 1)
    _arrives(rig, 1)
    _version(rig, 2)
    _in_flight(rig, 2)
    reply = rig["proxy"].command("corrupt 200000")  # about 40 flipped bytes per version
    time.sleep(2)
    rig["proxy"].command("pass")
    _arrives(rig, 2)
    _version(rig, 3)
    _arrives(rig, 3)
    status = rig["sub"].status()
    flipped = int(rig["proxy"].command("pass").split("flipped=")[1].split()[0])
    print(f"\ncorrupt: {flipped} bytes flipped; checksum failures "
          f"{status['checksum_failures']}, bad messages {status['bad_messages']} ({reply})")
    assert flipped > 0
    assert rig["recorder"].problems == []  # nothing corrupted was ever offered
