"""Fixtures for the transport tests: child processes and objects that are always cleaned up."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.byte_relay import ByteRelay
from tests.transport.procs import Child


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    """``spawn("publisher" | "subscriber", **args)``; every child is stopped at teardown.
    Children are forked from the zygote with torch imported (``zygote.py``): an
    interpreter start costs seconds of CPU on CI's 2 cores. ``forked=False`` for a fresh
    interpreter, where a figure would count the pages a fork shares with the zygote."""
    children: list[Child] = []

    def start(role: str, *, forked: bool = True, **args: Any) -> Child:
        child = Child(role, args, forked=forked)
        children.append(child)
        return child

    yield start
    for child in reversed(children):  # all at once: each one's shutdown takes seconds
        child.ask_to_exit()
    for child in reversed(children):
        child.close(timeout=10)


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """Register publishers/subscribers (anything with ``close()``) to close at teardown."""
    objects: list[Any] = []

    def register(obj: Any) -> Any:
        objects.append(obj)
        return obj

    yield register
    for obj in reversed(objects):
        obj.close()


@pytest.fixture
def make_pub(closing: Callable[[Any], Any]) -> Callable[..., WeightPublisher]:
    def make(endpoint: str = "tcp://127.0.0.1:0", **kwargs: Any) -> WeightPublisher:
        kwargs.setdefault("heartbeat_interval", 0.2)
        return closing(WeightPublisher(endpoint, **kwargs))

    return make


@pytest.fixture
def make_sub(closing: Callable[[Any], Any]) -> Callable[..., WeightSubscriber]:
    def make(endpoint: str, **kwargs: Any) -> WeightSubscriber:
        return closing(WeightSubscriber(endpoint, **kwargs))

    return make


# -- NIXL (issue 31): shared by test_nixl_path, test_nixl_slices, test_nixl_sharded -------------
@pytest.fixture
def nixl_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real NIXL agents confined to loopback (children inherit ``UCX_NET_DEVICES``); NIXL is
    a test dependency, installed in CI."""
    from weightpub_wire.nixl_link import nixl_error

    assert nixl_error() is None, nixl_error()
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@pytest.fixture
def paced_reads(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], list[float]]:
    """``paced_reads(read_bytes)``: READs of at most ``read_bytes`` (one chunk each, say),
    seen done one per 0.3 s (not a holder's words), so a version takes seconds and a kill
    lands mid-read;
    returns the list of when each READ was seen done (filled as they are)."""
    import time

    from subscriber_ext.transport.client import nixl_source
    from weightpub_wire.nixl_link import NixlReader, NixlTransfer

    def pace(read_bytes: int) -> list[float]:
        done: list[float] = []
        monkeypatch.setattr(nixl_source, "_READ_BYTES", read_bytes)
        poll = NixlReader.poll

        def slow_poll(self: NixlReader, transfer: NixlTransfer) -> bool:
            if transfer.nbytes <= 4096:  # a holder's words (claims, readiness): not paced
                return poll(self, transfer)
            if done and time.monotonic() - done[-1] < 0.3:
                return False
            finished = poll(self, transfer)
            if finished:
                done.append(time.monotonic())
            return finished

        monkeypatch.setattr(NixlReader, "poll", slow_poll)
        return done

    return pace


@pytest.fixture
def relays() -> Iterator[list[ByteRelay]]:
    """Byte-counting relays a test makes (``relays.append(ByteRelay(...))``), closed after."""
    made: list[ByteRelay] = []
    yield made
    for relay in made:
        relay.close()


@pytest.fixture
def stalled_words(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[Any]]:
    """``stalled_words()``: the next READ of a holder's words (its claims words or readiness
    map: a few KiB; the data READs here are whole chunks) is never seen done, as from a
    holder that stopped answering; returns the list such READs are added to (each call
    arms one more). Both the loop's own look and a wait in place see it in flight."""
    from weightpub_wire.nixl_link import NixlReader, NixlTransfer

    armed = [0]
    stalled: list[NixlTransfer] = []
    passed: list[NixlTransfer] = []
    patched: list[bool] = []

    def arm() -> list[Any]:
        armed[0] += 1
        if patched:
            return stalled
        patched.append(True)
        poll = NixlReader.poll

        def unanswered(self: NixlReader, transfer: NixlTransfer) -> bool:
            if transfer.nbytes <= 4096:
                if any(each is transfer for each in stalled):
                    return False
                if armed[0] and not any(each is transfer for each in passed):
                    armed[0] -= 1
                    stalled.append(transfer)
                    return False
                passed.append(transfer)
            return poll(self, transfer)

        monkeypatch.setattr(NixlReader, "poll", unanswered)
        return stalled

    return arm
