"""Faults on the plain-TCP stream path (``stream=True``, issue 29) that the ZeroMQ fault
suite does not reach (the kill -9 cells of the stream are in ``test_kill_matrix.py`` and
``test_shard_kills.py``, its fuzz in ``test_fuzz.py``).

- A hostile stream client (a real socket; its token asked over a real DEALER,
  ``stream_client.py``) against a real publisher: a token never issued, used twice or
  expired; a hello of the wrong size or magic; an oversized or malformed request; a
  version or chunk out of range; a client that never reads (also one holding a region
  the next version must overwrite); more connections than ``max_connections``; a flood.
  Each is refused or cut, counted, and logged with its reason (rate-limited); the
  connection threads end and memory stays flat; a real subscriber streams bit-exact after.
- A hostile stream server (``stream_mitm.py`` between the subscriber and the stream port):
  a reply of the wrong length, naming another chunk (unasked, or the neighbour) or
  version, garbage, a stall or a reset mid-chunk. The subscriber falls back to frames
  with the causes named and counted, stages the version bit-exact, the version it holds
  is untouched, nothing hangs.
- kill -9 of a stream subscriber mid-receive: the publisher's connection thread ends, the
  snapshot's send counts drop back (the next version's copy is not held by the dead
  connection), another subscriber is unaffected."""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from publisher import WeightPublisher
from publisher.serving.stream_server import StreamLimits
from subscriber_ext import WeightSubscriber
from tests.transport.faults.harness import Recorder, close_all
from tests.transport.faults.stream_client import StreamClient, closed, read_exact, read_reply
from tests.transport.faults.stream_mitm import StreamMitm
from tests.transport.faults.tools import LineCounter, rss_mib, threads_named
from tests.transport.procs import Spec, as_bytes, det_weights, digests, wait_until
from weightpub_wire import stream_link
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.message_base import MAX_CHUNKS

pytestmark = pytest.mark.timeout(60)

CHUNK = 256 << 10
SPEC = [("w", "float32", (512, 1024)), ("b", "int32", (70_000,))]  # 2 MiB + 280 kB: 10 chunks
SEED = 9
CONN = "weightpub-stream-conn"
LIMITS = StreamLimits(max_connections=4, hello_timeout=1.0, stall_timeout=1.0,
                      overwrite_grace=1.0)


def _bytes(version: int) -> bytes:
    """The version's bytes as the publisher lays them out (tensors back to back)."""
    return b"".join(as_bytes(t).numpy().tobytes()
                    for t in det_weights(SEED, version, SPEC).values())


# -- a hostile stream client against a real publisher ---------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[dict[str, Any]]:
    """One publisher (stream on, tight limits, every warning logged) holding v1; its
    connection threads and this process's RSS before any hostile client."""
    pub = WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK,
                          heartbeat_interval=0.2)
    server = pub._stream
    assert server is not None
    server.limits = LIMITS
    server._warn.interval = 0  # each case's reason is logged, not folded into a count
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    pub.wait_announced(1, timeout=30)
    ctx = zmq.Context()
    yield {"pub": pub, "server": server, "ctx": ctx, "threads": len(threads_named(CONN)),
           "rss": rss_mib(), "client": StreamClient(ctx, pub.endpoint, server.port)}
    pub.close()
    ctx.term()


def _count(served: dict[str, Any], name: str) -> int:
    return int(served["server"].status()[name])


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> None:
    wait_until(lambda: any(text in r.getMessage() for r in caplog.records
                           if r.name == "weightpub.publisher"), 10, f"a log line {text!r}")


def test_tokens_not_issued_used_twice_or_expired_are_refused_and_logged(
        served: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "weightpub.publisher")
    server = served["server"]
    refused = _count(served, "refused")
    reused = served["client"].token()
    server.limits = dataclasses.replace(LIMITS, token_ttl=0.0)  # void when issued
    expired = served["client"].token()
    server.limits = LIMITS
    served["client"].accepted(reused).close()  # its one use
    for token in (os.urandom(stream_link.TOKEN_BYTES), reused, expired):
        sock = served["client"].connect(stream_link.hello(token))
        assert read_reply(sock).status == stream_link.REFUSED
        closed(sock)
    assert _count(served, "refused") == refused + 3
    _logged(caplog, "stream: refused a connection (unknown, used or expired token)")


def test_a_hello_with_the_wrong_magic_is_cut_and_named(
        served: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "weightpub.publisher")
    cut = _count(served, "cut")
    closed(served["client"].connect(b"XXXX" + served["client"].token()))
    assert _count(served, "cut") == cut + 1
    _logged(caplog, "stream: cut a subscriber: stream hello: magic b'XXXX'")


def _request_head(magic: bytes = b"WPsq", count: int = 1, req: int = 1,
                  version: int = 1) -> bytes:
    return struct.pack("<4sIQQ", magic, count, req, version)


BAD_REQUESTS = {
    "count_past_the_bound": (_request_head(count=1 << 30), "stream request.count"),
    "unknown_magic": (_request_head(magic=b"WPzz"), "stream request: magic b'WPzz'"),
    "version_zero": (_request_head(version=0) + bytes(4), "out of range"),
    "chunk_id_past_the_bound": (_request_head() + struct.pack("<I", MAX_CHUNKS),
                                "an id past"),
    "slice_block_past_its_chunk": (stream_link.slice_request(1, 1, [(9, [(0, CHUNK, 0, 1)])]),
                                   "ends past the chunk"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_an_oversized_or_malformed_request_is_cut_and_named(
        served: dict[str, Any], caplog: pytest.LogCaptureFixture, case: str) -> None:
    caplog.set_level(logging.WARNING, "weightpub.publisher")
    data, named = BAD_REQUESTS[case]
    cut = _count(served, "cut")
    sock = served["client"].accepted()
    sock.sendall(data)
    closed(sock)
    assert _count(served, "cut") == cut + 1
    _logged(caplog, named)


def test_a_version_or_chunk_out_of_range_is_unavailable_and_the_connection_serves_on(
        served: dict[str, Any]) -> None:
    cut = _count(served, "cut")
    sock = served["client"].accepted()
    try:
        sock.sendall(stream_link.request(1, 999, [0]))  # a version never published
        reply = read_reply(sock)
        assert (reply.status, reply.req, reply.version, reply.size) == (
            stream_link.UNAVAILABLE, 1, 999, 0)
        sock.sendall(stream_link.request(2, 1, [500]))  # v1 has 10 chunks
        reply = read_reply(sock)
        assert (reply.status, reply.req, reply.chunk) == (stream_link.UNAVAILABLE, 2, 500)
        sock.sendall(stream_link.request(3, 1, [9, 0]))  # the same connection serves on
        want = _bytes(1)
        for chunk in (9, 0):
            reply = read_reply(sock)
            assert (reply.status, reply.req, reply.chunk) == (stream_link.OK, 3, chunk)
            assert read_exact(sock, reply.size) == want[chunk * CHUNK: (chunk + 1) * CHUNK]
    finally:
        sock.close()
    assert _count(served, "cut") == cut


def test_a_client_that_never_reads_is_cut_at_the_stall_timeout(
        served: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """256 MiB asked (chunk 0, 1024 times) and nothing read: the kernel's buffers fill,
    the connection's sendmsg stops moving, the subscriber is cut after ``stall_timeout``."""
    caplog.set_level(logging.WARNING, "weightpub.publisher")
    cut = _count(served, "cut")
    sock = served["client"].accepted(rcvbuf=4096)
    try:
        sock.sendall(stream_link.request(1, 1, [0] * stream_link.MAX_REQUEST_CHUNKS))
        wait_until(lambda: _count(served, "cut") == cut + 1, 30, "the stalled client cut")
        _logged(caplog, "(stall_timeout)")
        wait_until(lambda: _count(served, "connections") == 0, 10, "its connection closed")
    finally:
        sock.close()
    assert served["server"].scratch_bytes == 0


def test_a_stalled_reader_cannot_hold_back_the_next_version(
        closing: Any, caplog: pytest.LogCaptureFixture) -> None:
    """One version kept: v2's copy overwrites v1's regions, one of which a client that
    never reads holds in a ``sendmsg``. It is cut after ``overwrite_grace`` (not the 30 s
    ``stall_timeout``), named, and v2 goes out bit-exact."""
    caplog.set_level(logging.WARNING, "weightpub.publisher")
    pub = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK,
                                  heartbeat_interval=0.2, keep_versions=1))
    server = pub._stream
    assert server is not None
    server.limits = dataclasses.replace(LIMITS, stall_timeout=30.0, overwrite_grace=0.5)
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    pub.wait_announced(1, timeout=30)
    client = StreamClient(zmq.Context.instance(), pub.endpoint, server.port)
    sock = client.accepted(rcvbuf=4096)
    try:
        sock.sendall(stream_link.request(1, 1, [0] * stream_link.MAX_REQUEST_CHUNKS))
        wait_until(lambda: _sending(pub, 1) > 0, 10, "the publisher in its sendmsg")
        pub.publish(det_weights(SEED, 2, SPEC), version=2)
        pub.wait_announced(2, timeout=30)
        wait_until(lambda: server.status()["cut"] == 1, 10, "the stalled reader cut")
        _logged(caplog, "while a new version waits to overwrite the bytes (overwrite_grace)")
    finally:
        sock.close()
    sub = closing(WeightSubscriber(pub.endpoint, stream=True, request_timeout=3.0))
    staged = sub.wait_for_version(2, timeout=30)
    assert staged.data_path == "stream"
    assert digests(staged.items()) == digests(det_weights(SEED, 2, SPEC).items())


def test_connections_past_max_connections_are_turned_away_and_logged(
        served: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "weightpub.publisher")
    turned = _count(served, "turned_away")
    held = [served["client"].accepted() for _ in range(LIMITS.max_connections)]
    try:
        assert len(threads_named(CONN)) == served["threads"] + LIMITS.max_connections
        closed(served["client"].connect())  # closed at once, before any hello
        assert _count(served, "turned_away") == turned + 1
        _logged(caplog, f"stream: turned a connection away ({LIMITS.max_connections} open)")
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: len(threads_named(CONN)) == served["threads"], 10,
               "the held connections' threads to end")
    sock = served["client"].accepted()  # room again
    sock.close()


def test_a_flood_of_bad_connections_costs_a_few_log_lines(closing: Any) -> None:
    """300 connections with tokens never issued and 300 with a bad magic: each refused or
    cut and counted, the log says so a couple of times (rate-limited), not 600 times."""
    pub = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK))
    server = pub._stream
    assert server is not None
    client = StreamClient(zmq.Context.instance(), pub.endpoint, server.port)
    with LineCounter() as lines:
        for index in range(600):
            sock = client.connect((b"WPsh" if index % 2 else b"XXXX")
                                  + os.urandom(stream_link.TOKEN_BYTES))
            if index % 2:
                assert read_reply(sock).status == stream_link.REFUSED
            closed(sock)
        wait_until(lambda: server.status()["refused"] + server.status()["cut"] == 600, 10,
                   "every connection refused or cut")
    status = server.status()
    assert (status["refused"], status["cut"], status["connections"]) == (300, 300, 0)
    refusals = [line for line in lines.warnings if line.startswith("stream: ")]
    assert 2 <= len(refusals) <= 4, refusals


def test_after_the_hostile_clients_a_real_subscriber_streams_bit_exact(
        served: dict[str, Any]) -> None:
    """Last of the hostile-client cases: every connection thread of theirs has ended, RSS
    has not grown with them, and a real subscriber's versions come over the stream."""
    wait_until(lambda: len(threads_named(CONN)) == served["threads"]
               and _count(served, "connections") == 0, 10, "every hostile connection closed")
    grown = rss_mib() - served["rss"]
    assert grown < 64, f"RSS grew {grown:.0f} MiB over the hostile clients"
    pub = served["pub"]
    sub = WeightSubscriber(pub.endpoint, stream=True, request_timeout=3.0)
    try:
        staged = sub.wait_for_version(1, timeout=30)
        assert staged.data_path == "stream"
        assert digests(staged.items()) == digests(det_weights(SEED, 1, SPEC).items())
        staged.release()
        pub.publish(det_weights(SEED, 2, SPEC), version=2)
        staged = sub.wait_for_version(2, timeout=30)
        assert staged.data_path == "stream"
        assert digests(staged.items()) == digests(det_weights(SEED, 2, SPEC).items())
        assert sub.status()["stream"]["fallbacks"] == 0
    finally:
        sub.close()



@pytest.mark.parametrize("extra", [-16, 4], ids=["short_hello", "hello_with_bytes_after"])
def test_a_hello_of_the_wrong_size_is_cut_and_named(
        served: dict[str, Any], caplog: pytest.LogCaptureFixture, extra: int) -> None:
    """A hello 16 bytes short (then nothing), or a good hello with 4 bytes after it (the
    start of no request): cut within ``hello_timeout`` (or the request's), counted, the
    reason logged."""
    caplog.set_level(logging.WARNING, "weightpub.publisher")
    cut = _count(served, "cut")
    hello = stream_link.hello(served["client"].token())
    sock = served["client"].connect(hello[:extra] if extra < 0 else hello + bytes(extra))
    if extra > 0:
        assert read_reply(sock).status == stream_link.ACCEPTED
    closed(sock)
    assert _count(served, "cut") == cut + 1
    _logged(caplog, "stream hello" if extra < 0 else "stream request")


# -- a hostile stream server: the subscriber's replies broken on the way ------------------

#: fault -> the fallbacks the subscriber must count for it. ``swap``: the neighbour's
#: place gets the bytes and fails its checksum (refetched over frames alone); the chunk
#: whose reply that was never comes on the stream, and waits request_timeout
SERVER_FAULTS: dict[str, dict[str, int]] = {
    "size": {"bad_reply": 1}, "chunk": {"bad_reply": 1},
    "swap": {"checksum": 1, "timeout": 1}, "version": {"bad_reply": 1},
    "garbage": {"bad_reply": 1}, "stall": {"timeout": 1}, "cut": {"closed": 1}}

@pytest.fixture(scope="module")
def mitm_rig() -> Iterator[dict[str, Any]]:
    """A publisher (stream on) behind a ``StreamMitm``; each case publishes the next
    version."""
    pub = WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK,
                          heartbeat_interval=0.2)
    assert pub._stream is not None
    router_port = parse_endpoint(pub.endpoint).port
    pub_port = parse_endpoint(pub._server.pub_endpoint).port
    assert router_port and pub_port
    mitm = StreamMitm(router_port, pub_port, pub._stream.port)
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    pub.wait_announced(1, timeout=30)
    yield {"pub": pub, "mitm": mitm, "endpoint": f"tcp://127.0.0.2:{router_port}",
           "version": 1}
    mitm.close()
    pub.close()


@pytest.mark.parametrize("fault", list(SERVER_FAULTS))
def test_a_broken_stream_reply_costs_frames_with_the_cause_named(
        mitm_rig: dict[str, Any], fault: str) -> None:
    pub, mitm = mitm_rig["pub"], mitm_rig["mitm"]
    held_version = mitm_rig["version"]
    version = mitm_rig["version"] = held_version + 1
    every_version: dict[int, Any] = dict.fromkeys(range(1, 20), SPEC)
    recorder = Recorder(seeds={pub.publisher_id: SEED}, specs=every_version)
    sub = WeightSubscriber(mitm_rig["endpoint"], stream=True, request_timeout=2.0,
                           on_version=recorder)
    try:
        # the version being served (on a loaded box its stream may have timed out: only
        # what the fault adds is counted below)
        held = sub.wait_for_version(held_version, timeout=30)
        before = dict(sub.status()["stream"]["fallback_causes"])
        fired = len(mitm.fired)
        mitm.arm(fault, version)
        pub.publish(det_weights(SEED, version, SPEC), version=version)
        wait_until(lambda: recorder.got(pub.publisher_id, version), 30,
                   f"v{version} after the {fault} fault")
        assert recorder.problems == [], recorder.problems
        assert mitm.fired[fired:] == [fault]
        stream = sub.status()["stream"]
        added = {cause: count - before.get(cause, 0)
                 for cause, count in stream["fallback_causes"].items()
                 if count != before.get(cause, 0)}
        assert added == SERVER_FAULTS[fault], stream
        staged = sub.latest()
        assert staged is not None and staged.version == version
        assert staged.data_path in ("zmq", "stream+zmq")
        # the version the subscriber held meanwhile was not written
        assert digests(held.items()) == digests(det_weights(SEED, held_version, SPEC).items())
        held.release()
    finally:
        close_all(sub, [])


# -- kill -9 of a stream subscriber mid-receive -----------------------------------------------

BIG_SPEC: Spec = [("big", "uint8", (64 * CHUNK,))]  # 16 MiB: 64 chunks, seconds at a paced reader


def _sending(pub: WeightPublisher, version: int) -> int:
    """Regions of ``version``'s snapshot counted as being sent now (``send_begin``)."""
    held = pub._store.get(version)
    return 0 if held is None or held.claims is None else int(held.claims._sending.sum())


def test_a_stream_subscriber_killed_mid_receive_frees_its_connection_and_the_snapshot(
        spawn: Any, closing: Any) -> None:
    """A paced subscriber child is killed -9 while the publisher's connection thread is in
    its ``sendmsg`` (the snapshot's regions counted as being sent): the thread ends, the
    counts drop back, and with one version kept each next copy claims those regions
    at once (no subscriber cut for holding them); the other subscriber streams on."""
    pub = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK,
                                  heartbeat_interval=0.2, keep_versions=1))
    server = pub._stream
    assert server is not None
    base = len(threads_named(CONN))
    other = closing(WeightSubscriber(pub.endpoint, stream=True, request_timeout=3.0))
    pub.publish(det_weights(SEED, 1, BIG_SPEC), version=1)
    staged = other.wait_for_version(1, timeout=30)
    assert staged.data_path == "stream"
    staged.release()
    child = spawn("subscriber", endpoint=pub.endpoint, pace_stream=CHUNK,
                  options={"stream": True, "request_timeout": 30.0})
    child.event("ready", timeout=60)
    wait_until(lambda: child.request("status")["status"]["stream"]["bytes_received"]
               >= 2 * CHUNK and _sending(pub, 1) > 0, 60,
               "the child mid-receive, the publisher in its sendmsg")
    assert len(threads_named(CONN)) == base + 2
    child.kill9()
    wait_until(lambda: len(threads_named(CONN)) == base + 1
               and server.status()["connections"] == 1, 30,
               "the dead subscriber's connection thread to end")
    wait_until(lambda: _sending(pub, 1) == 0, 10, "v1's send counts to drop back")
    for version in (2, 3):  # one version kept: each copy overwrites the one before
        pub.publish(det_weights(SEED, version, BIG_SPEC), version=version)
        staged = other.wait_for_version(version, timeout=30)
        assert staged.data_path == "stream"
        assert digests(staged.items()) == digests(
            det_weights(SEED, version, BIG_SPEC).items())
        staged.release()
    assert server.status()["cut"] == 0  # nothing had to be cut to free the regions
    assert other.status()["stream"]["fallbacks"] == 0
