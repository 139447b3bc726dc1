"""The subscriber's NIXL agent starts on a thread of its own (``client/nixl_agent_start.py``),
real agents (UCX on loopback), subscribers in this process.

What must hold: while the agent starts (held back deterministically by the tests' hook
``BEFORE_START``, never a sleep) the client's loop goes on: a peer's ``peer_nixl`` is
answered (``later``), and a version is staged over frames once its chunks waited
``AGENT_WAIT_S`` (``starting``, counted); chunks held while it starts are READ once it
is up; an agent that raises at start leaves the subscriber up, every NIXL version as
frames, counted ``missing``, logged once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.client import nixl_agent_start, nixl_source
from tests.transport.procs import det_weights, digests, wait_until
from tests.transport.test_peers import peer_dealer
from weightpub_wire import protocol as wire
from weightpub_wire.peer_protocol import PeerNixl, PeerNixlOffer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("nixl_loopback")]

SEED = 5
SPEC = [("w", "float32", (256, 1024)), ("b", "int32", (10_000,))]
CHUNK = 128 << 10


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The agent's start waits until the test sets this (60 s at most)."""
    opened = threading.Event()
    monkeypatch.setattr(nixl_agent_start, "BEFORE_START", lambda: opened.wait(60))
    yield opened
    opened.set()  # a start still waiting finishes (and its reader is closed)


def _exact(sub: WeightSubscriber, version: int) -> str:
    staged = sub.wait_for_version(version, timeout=60)
    try:
        assert staged.version == version
        assert digests(staged.items()) == digests(det_weights(SEED, version, SPEC).items())
        return staged.data_path
    finally:
        staged.release()


def test_the_loop_answers_peers_while_the_agent_starts_then_reads_what_it_held(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        gate: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_source, "AGENT_WAIT_S", 60.0)  # held, not given up
    pub = make_pub(chunk_size=CHUNK, peer_fanout=1, nixl=True)
    member = closing(WeightSubscriber(pub.endpoint, peer_share=True, nixl=True,
                                      subscriber_id="m0", request_timeout=10.0))
    wait_until(lambda: member.status()["peers"]["slot"] == 0, 20, "the first slot")
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    wait_until(lambda: member.status()["fetching_version"] == 1, 20, "version 1's manifest")
    endpoint = member.status()["peers"]["endpoint"]

    def ask(req: int) -> PeerNixlOffer:
        with peer_dealer(endpoint, b"", None) as dealer:
            dealer.send(wire.encode(PeerNixl(req=req, publisher_id=pub.publisher_id,
                                             version=1)))
            assert dealer.poll(20_000), "no answer from the member's loop"
            return msgspec.msgpack.decode(dealer.recv(), type=PeerNixlOffer)

    answer = ask(1)  # its loop answers while the agent is held back
    assert answer.offer is None and answer.why == "later", answer
    status = member.status()
    assert status["nixl"]["agent"] == "starting" and status["staged_version"] == 0, status
    gate.set()
    assert _exact(member, 1) == "nixl"  # the chunks it held were READ once it was up
    nixl = member.status()["nixl"]
    assert nixl["fallbacks"] == 0 and nixl["agent"] == "up", nixl
    assert nixl["agent_start_s"] > 0
    answer = ask(2)
    assert answer.offer is not None, answer  # now its staging is offered


def test_a_version_comes_as_frames_while_the_agent_is_not_up(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        gate: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_source, "AGENT_WAIT_S", 0.5)
    pub = make_pub(chunk_size=CHUNK, nixl=True)
    sub = closing(WeightSubscriber(pub.endpoint, request_timeout=10.0))  # auto: at the offer
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    assert _exact(sub, 1) == "zmq"  # staged while the agent is still held back
    assert not gate.is_set()
    nixl = sub.status()["nixl"]
    assert nixl["agent"] == "starting" and nixl["fallback_causes"] == {"starting": 1}, nixl
    gate.set()
    agent = sub._nixl._agent  # its thread's end (not the loop's view of it)
    assert agent is not None and agent.wait(30)
    pub.publish(det_weights(SEED, 2, SPEC), version=2)
    assert _exact(sub, 2) == "nixl"
    assert sub.status()["nixl"]["fallback_causes"] == {"starting": 1}


def test_an_agent_that_fails_to_start_leaves_the_subscriber_on_frames(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def fail() -> None:
        raise RuntimeError("UCX refused (test)")

    monkeypatch.setattr(nixl_agent_start, "BEFORE_START", fail)
    pub = make_pub(chunk_size=CHUNK, nixl=True)
    with caplog.at_level(logging.WARNING, logger="weightpub.subscriber"):
        sub = closing(WeightSubscriber(pub.endpoint, nixl=True, request_timeout=10.0))
        for version in (1, 2):
            pub.publish(det_weights(SEED, version, SPEC), version=version)
            assert _exact(sub, version) == "zmq"
    nixl = sub.status()["nixl"]
    assert nixl["agent"] == "failed" and nixl["available"] is False, nixl
    assert nixl["fallback_causes"] == {"missing": 2}, nixl
    assert "did not start (RuntimeError: UCX refused (test))" in nixl["last_error"]
    lines = [r for r in caplog.records if "UCX refused (test)" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # logged once
