"""The stream path end to end (issue 29): a publisher process with ``stream=True``, a
subscriber here with ``stream=True``, real sockets.

What must hold: versions come bit-exact with every chunk over the plain TCP port (the
publisher sends no chunk frame) and ``data_path`` says "stream"; whatever stops the
path (a token refused, corrupt bytes, a publisher killed -9) costs ZeroMQ frames with
the cause counted, never a wrong or partial version; either side without the option
keeps to frames; under CURVE only an admitted subscriber gets a token.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from publisher import WeightPublisher
from publisher.serving.stream_server import StreamLimits
from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.client import stream_source
from tests.transport.data_path_cases import (
    CHUNK,
    SPEC,
    child_stats,
    exact,
    kill_mid_stream_stages_nothing,
    pace_stream_reads,
    publish,
    start_publisher,
    subscriber,
)
from tests.transport.procs import Child, det_weights, spec_bytes, wait_until
from tests.transport.test_metrics import scrape
from weightpub.cli import main as cli_main
from weightpub.status import fetch_status
from weightpub_wire import stream_link
from weightpub_wire.errors import ProtocolError

pytestmark = pytest.mark.timeout(120)

def test_three_versions_over_the_stream_bit_exact(spawn: Callable[..., Child],
                                                  closing: Callable[[Any], Any],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    pub = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=7, chunk_size=CHUNK,
                stream=True, metrics_port=0)
    ready = pub.event("ready", timeout=60)
    endpoint = ready["endpoint"]
    before = scrape(ready["metrics_url"])
    assert before[("weightpub_publisher_stream_bytes_total", ())] == 0
    sub = subscriber(closing, endpoint, stream=True)
    for version in (1, 2, 3):
        publish(pub, version)
        staged = sub.wait_for_version(version, timeout=60)
        assert staged.version == version and exact(staged, version)
        assert staged.data_path == "stream"
        staged.release()
    stream = sub.status()["stream"]
    assert stream["fallbacks"] == 0, stream
    assert stream["state"] == "up" and stream["bytes_received"] >= 3 * spec_bytes(SPEC)
    # a connection's thread counts a batch once sendmsg returns: maybe after it was staged
    wait_until(lambda: child_stats(pub)["stats"]["bytes_sent_stream"]
               >= stream["bytes_received"], 10, "the publisher to count what it sent")
    stats = child_stats(pub)
    assert stats["stats"]["bytes_sent_full"] == 0  # not one chunk frame
    assert stats["stats"]["bytes_sent_stream"] == stream["bytes_received"]
    assert stats["stream"]["accepted"] == 1  # one connection (one token) for all versions
    assert stats["stream"]["tokens_issued"] == 1 and stats["stream"]["connections"] == 1
    # the same counters in ``weightpub status`` and in the publisher's /metrics
    reply = fetch_status(endpoint).stream
    assert reply is not None and reply.port > 0
    assert (reply.accepted, reply.tokens_issued, reply.bytes_sent, reply.chunks_sent) == (
        1, 1, stream["bytes_received"], stats["stream"]["chunks_sent"])
    assert cli_main(["status", endpoint]) == 0
    out = capsys.readouterr().out
    assert f"stream port {reply.port}: 1 open, 1 accepted, 0 refused" in out
    assert "tokens 1 issued, 0 denied" in out
    after = scrape(ready["metrics_url"])
    assert after[("weightpub_publisher_stream_bytes_total", ())] == stream["bytes_received"]
    assert after[("weightpub_publisher_stream_chunks_total", ())] == reply.chunks_sent
    assert after[("weightpub_publisher_stream_connections_total",
                  (("outcome", "accepted"),))] == 1
    assert after[("weightpub_publisher_stream_tokens_total", (("outcome", "issued"),))] == 1
    assert after[("weightpub_publisher_stream_open_connections", ())] == 1


def test_a_bad_token_is_refused_counted_and_frames_serve(
        spawn: Callable[..., Child], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_source.StreamPicker, "present",
                        lambda self, token: bytes(b ^ 0x5A for b in token))
    pub, endpoint = start_publisher(spawn, stream=True)
    sub = subscriber(closing, endpoint, stream=True)
    publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and staged.data_path == "zmq"
    stream = sub.status()["stream"]
    assert stream["fallback_causes"] == {"refused": 1}, stream
    assert "refused" in stream["last_error"]
    stats = child_stats(pub)
    assert stats["stream"]["refused"] == 1 and stats["stream"]["accepted"] == 0
    assert stats["stream"]["tokens_issued"] == 1
    reply = fetch_status(endpoint).stream
    assert reply is not None and (reply.refused, reply.accepted, reply.bytes_sent) == (1, 0, 0)
    assert stats["stats"]["bytes_sent_stream"] == 0
    assert stats["stats"]["bytes_sent_full"] >= spec_bytes(SPEC)


def test_corrupt_bytes_on_the_stream_are_refetched_over_frames(
        spawn: Callable[..., Child], closing: Callable[[Any], Any]) -> None:
    pub, endpoint = start_publisher(spawn, stream=True, stream_fault="corrupt:2")
    sub = subscriber(closing, endpoint, stream=True, request_timeout=20.0)
    publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1)  # the bad chunk never staged
    assert staged.data_path == "stream+zmq"
    status = sub.status()
    assert status["checksum_failures"] == 1
    assert status["stream"]["fallback_causes"] == {"checksum": 1}
    assert child_stats(pub)["stats"]["bytes_sent_full"] == CHUNK  # that chunk alone, as a frame


def test_a_publisher_killed_mid_stream_never_stages_a_partial_version(
        spawn: Callable[..., Child], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pace_stream_reads(monkeypatch)
    pub, endpoint = start_publisher(spawn, stream=True)
    sub = closing(WeightSubscriber(endpoint, stream=True, request_timeout=2.0,
                                   max_chunk_retries=1, window_bytes=2 * CHUNK))
    kill_mid_stream_stages_nothing(pub, sub, [("big", "uint8", [32 * CHUNK])])


def test_either_side_without_the_option_keeps_to_frames(
        spawn: Callable[..., Child], closing: Callable[[Any], Any]) -> None:
    pub, endpoint = start_publisher(spawn, stream=True)
    old = subscriber(closing, endpoint)  # an old (non-stream) subscriber
    publish(pub, 1)
    staged = old.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and staged.data_path == "zmq"
    assert old.status()["stream"] == {**old.status()["stream"], "mode": "off", "fallbacks": 0}
    stats = child_stats(pub)
    assert stats["stream"]["accepted"] == 0 and stats["stats"]["bytes_sent_stream"] == 0

    plain, plain_endpoint = start_publisher(spawn)  # a publisher without the stream port
    eager = subscriber(closing, plain_endpoint, stream=True)
    publish(plain, 1)
    staged = eager.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and staged.data_path == "zmq"
    stream = eager.status()["stream"]
    assert stream["fallbacks"] == 0 and stream["state"] is None  # nothing was offered


def test_under_curve_only_an_admitted_subscriber_gets_a_token(
        tmp_path: Any, closing: Callable[[Any], Any]) -> None:
    """The token rides on the authenticated ROUTER only: a subscriber whose key is not
    admitted never gets one (nor any byte), an admitted one streams."""
    from weightpub_wire.errors import WeightPubTimeout
    from weightpub_wire.keys import create_key_pair

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_public, server_secret = create_key_pair(tmp_path, "server")
    _, client_secret = create_key_pair(allowed, "client")
    _, stranger_secret = create_key_pair(tmp_path, "stranger")
    pub = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK,
                                  curve_secret_key_file=str(server_secret),
                                  curve_allowed_clients_dir=str(allowed)))
    member = subscriber(closing, pub.endpoint, stream=True,
                         curve_server_key_file=str(server_public),
                         curve_secret_key_file=str(client_secret))
    stranger = subscriber(closing, pub.endpoint, stream=True,
                           curve_server_key_file=str(server_public),
                           curve_secret_key_file=str(stranger_secret))
    pub.publish(det_weights(7, 1, SPEC), version=1)
    staged = member.wait_for_version(1, timeout=60)
    assert staged.data_path == "stream" and exact(staged, 1)
    with pytest.raises(WeightPubTimeout):
        stranger.wait_for_version(1, timeout=3)
    assert stranger.status()["stream"]["bytes_received"] == 0
    status = pub.stream_status()
    assert status is not None and status["accepted"] == 1 and status["refused"] == 0
    assert pub.data_stats()["bytes_sent_full"] == 0
    staged.release()
    # the member's key revoked: its open stream connection is cut at its next request
    for key_file in allowed.iterdir():
        key_file.unlink()
    time.sleep(1.5)  # the allow-list is re-read at most once a second
    pub.publish(det_weights(7, 2, SPEC), version=2)
    wait_until(lambda: (pub.stream_status() or {}).get("cut", 0) >= 1, 30,
               "the revoked key's stream cut")
    assert member.latest() is not None and member.latest().version == 1


def test_stream_formats_are_bounded_and_name_what_is_wrong() -> None:
    token = bytes(range(stream_link.TOKEN_BYTES))
    assert stream_link.parse_hello(stream_link.hello(token)) == token
    with pytest.raises(ProtocolError, match="magic"):
        stream_link.parse_hello(b"XXXX" + token)
    data = stream_link.request(7, 3, [5, 1, 9])
    head = stream_link.parse_request_head(data[:stream_link.REQUEST_BYTES])
    assert (head.req, head.version, head.count) == (7, 3, 3)
    assert stream_link.request_chunks(data[stream_link.REQUEST_BYTES:], head) == (5, 1, 9)
    huge = bytearray(data[:stream_link.REQUEST_BYTES])
    huge[4:8] = (1 << 30).to_bytes(4, "little")  # a count refused before any id is read
    with pytest.raises(ProtocolError, match="count"):
        stream_link.parse_request_head(bytes(huge))
    reply = stream_link.parse_reply(stream_link.reply_header(stream_link.OK, 7, 3, 5, 1024))
    assert (reply.req, reply.version, reply.chunk, reply.size) == (7, 3, 5, 1024)
    with pytest.raises(ProtocolError, match="status"):
        stream_link.parse_reply(b"WPsr" + bytes([9]) + bytes(27))
    with pytest.raises(ProtocolError, match="size"):
        stream_link.parse_reply(stream_link.reply_header(stream_link.UNAVAILABLE, size=5))
    with pytest.raises(ProtocolError, match="header bytes"):
        stream_link.parse_reply(b"short")


def test_no_token_or_no_port_costs_frames_with_the_cause_named(
        closing: Callable[[Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher that never answers the token request (``no_answer``), one with too many
    tokens out (denied: ``refused``), and one whose port is gone (``connect``): each
    version still comes whole, over frames, and the publisher counts what it did."""
    from publisher.serving import server

    weights = det_weights(7, 1, SPEC)
    silent = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK))
    monkeypatch.setattr(server.ServingThread, "_stream_token",
                        lambda self, peers, peer, request: None)
    sub = subscriber(closing, silent.endpoint, stream=True, request_timeout=1.0)
    silent.publish(weights, version=1)
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and staged.data_path == "zmq"
    assert sub.status()["stream"]["fallback_causes"] == {"no_answer": 1}
    monkeypatch.undo()

    crowded = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK,
                                      metrics_port=0))
    assert crowded._stream is not None
    crowded._stream.limits = StreamLimits(max_tokens=0)  # every token asked is denied
    sub = subscriber(closing, crowded.endpoint, stream=True)
    crowded.publish(weights, version=1)
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and staged.data_path == "zmq"
    status = sub.status()["stream"]
    assert status["fallback_causes"] == {"refused": 1} and "outstanding" in status["last_error"]
    counters = crowded.stream_status()
    assert counters is not None and counters["tokens_denied"] == 1
    assert counters["tokens_issued"] == 0 and counters["accepted"] == 0
    assert crowded.metrics is not None
    samples = scrape(crowded.metrics.url)
    assert samples[("weightpub_publisher_stream_tokens_total", (("outcome", "denied"),))] == 1

    portless = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK))
    stream = portless._stream
    assert stream is not None
    stream.close()  # tokens are still handed out; nobody listens on the port any more
    sub = subscriber(closing, portless.endpoint, stream=True)
    portless.publish(weights, version=1)
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and staged.data_path == "zmq"
    status = sub.status()["stream"]
    assert status["fallback_causes"] == {"connect": 1}, status
    assert str(stream.port) in status["last_error"]


def _unanswered(port: int) -> list[socket.socket]:
    """A listener on ``port`` that never accepts, its accept queue filled: Linux drops any
    further SYN there, so a connect to it neither completes nor fails (it hangs until
    the connecting side gives up). Returns the sockets to close."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(0)
    held = [listener]
    for _ in range(16):
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        held.append(probe)
        try:
            probe.connect(("127.0.0.1", port))
        except TimeoutError:
            return held  # this one hangs: so will the subscriber's
    for sock in held:
        sock.close()
    raise AssertionError(f"port {port} kept accepting connects (accept queue never full)")


def test_a_connect_that_never_completes_is_bounded_and_named(
        closing: Callable[[Any], Any]) -> None:
    """The stream port's accept queue full (SYNs dropped): the subscriber's connect is
    polled, never waited on, and given up after request_timeout as ``connect_timeout``;
    the version comes whole over frames and the subscriber keeps serving meanwhile."""
    pub = closing(WeightPublisher("tcp://127.0.0.1:0", stream=True, chunk_size=CHUNK))
    stream = pub._stream
    assert stream is not None
    stream.close()  # tokens are still handed out for its port, where nobody answers now
    held = _unanswered(stream.port)
    try:
        sub = subscriber(closing, pub.endpoint, stream=True)  # request_timeout 3 s
        pub.publish(det_weights(7, 1, SPEC), version=1)
        wait_until(lambda: sub.status()["stream"]["state"] == "connect", 30,
                   "the connect under way (polled: it shows in status meanwhile)")
        staged = sub.wait_for_version(1, timeout=60)
        assert exact(staged, 1) and staged.data_path == "zmq"
        status = sub.status()["stream"]
        assert status["fallback_causes"] == {"connect_timeout": 1}, status
        assert f"{stream.port}: not connected within 3.0s" in status["last_error"]
        assert stream.tokens_issued == 1 and stream.accepted == 0
    finally:
        for sock in held:
            sock.close()
