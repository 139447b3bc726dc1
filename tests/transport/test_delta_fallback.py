"""Deltas that must not be trusted, late, or relayed: the staged bytes are always the real ones."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

import publisher.deltas.delta_encoder as publisher_delta
from publisher import ProtocolError, WeightPublisher
from subscriber_ext import StagedVersion, WeightSubscriber
from tests.transport.procs import (
    InlineChunks,
    digests,
    drift_weights,
    spec_bytes,
    wait_until,
)
from tests.transport.test_metrics import scrape
from weightpub.cli import main as cli_main
from weightpub.deployment_config import RelayConfig
from weightpub.relay import Relay
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.delta_codec import HEADER_BYTES

pytestmark = pytest.mark.timeout(90)

SEED = 21
SPEC = [("w", "bfloat16", (256, 512)), ("b", "float32", (999,)), ("i", "int8", (77, 3))]
CHUNK = 32 << 10


def expected(version: int) -> dict[str, str]:
    return digests(drift_weights(SEED, version, SPEC).items())


class Recorder:
    """``on_version`` callback: the digests of every version the subscriber ever staged."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, str]] = {}

    def __call__(self, staged: StagedVersion) -> None:
        self.seen[staged.version] = digests(staged.items())

    def wait(self, version: int) -> None:
        """``wait_for_version`` may return before the callback ran: wait for the callback."""
        wait_until(lambda: version in self.seen, 30, f"on_version for version {version}")


class DeltaTamperingProxy(threading.Thread):
    """ROUTER <-> DEALER between one subscriber and the publisher that spoils every delta
    chunk reply of the versions in ``spoil``: ``mode`` "flip" flips a byte of the payload,
    "same" swaps it for a well-formed "unchanged" payload (decodes fine, wrong bytes)."""

    def __init__(self, ctx: zmq.Context, upstream: str, mode: str, spoil: set[int]) -> None:
        super().__init__(name="test-delta-mitm", daemon=True)
        self.frontend = ctx.socket(zmq.ROUTER)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self.frontend.bind("tcp://127.0.0.1:0")
        self.endpoint = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend = ctx.socket(zmq.DEALER)
        self.backend.setsockopt(zmq.LINGER, 0)
        self.backend.connect(upstream)
        self.mode, self.spoil = mode, spoil
        self.delta_requests: set[int] = set()
        self.spoiled = 0
        self.inline = InlineChunks()  # header + payload messages -> one frame to spoil
        self.stop = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        client = None
        try:
            while not self.stop.is_set():
                events = dict(poller.poll(50))
                if self.frontend in events:
                    client, *body = self.frontend.recv_multipart()
                    self._note(body)
                    self.backend.send_multipart(body)
                if self.backend in events:
                    frames = self.inline.feed(self.backend.recv_multipart()) or []
                    if client is not None and frames:
                        self.frontend.send_multipart([client, *self._tamper(frames)])
        finally:
            self.frontend.close()
            self.backend.close()

    def _note(self, body: list[bytes]) -> None:
        try:
            request = wire.decode(body[0], expect=(wire.FetchRequest,))
        except ProtocolError:
            return
        if isinstance(request, wire.FetchRequest) and request.base:
            self.delta_requests.add(request.req)

    def _tamper(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) != 1 or not chunk_frame.is_chunk(frames[0]):
            return frames
        header = chunk_frame.parse(frames[0])
        if header.req not in self.delta_requests or header.version not in self.spoil:
            return frames
        self.spoiled += 1
        if self.mode == "same":
            payload = b"WD\x01\x02\x00\x00\x00\x00"  # SAME: "copy the base"
            assert len(payload) == HEADER_BYTES
            return [bytes(chunk_frame.build(req=header.req, version=header.version,
                                            chunk=header.chunk, payload=payload))]
        data = bytearray(frames[0])
        data[chunk_frame.HEADER_BYTES + header.size // 2] ^= 0x10
        return [bytes(data)]


@pytest.mark.parametrize("mode", ["flip", "same"])
def test_a_spoiled_delta_falls_back_to_full_and_never_stages_wrong_bytes(
    mode: str, make_pub: Callable[..., WeightPublisher],
    make_sub: Callable[..., WeightSubscriber],
) -> None:
    ctx = zmq.Context()
    pub = make_pub(chunk_size=CHUNK, delta_anchor_every=8)
    proxy = DeltaTamperingProxy(ctx, pub.endpoint, mode, spoil={2})
    proxy.start()
    try:
        recorder = Recorder()
        sub = make_sub(proxy.endpoint, on_version=recorder)
        for version in (1, 2, 3):
            pub.publish(drift_weights(SEED, version, SPEC), version=version)
            sub.wait_for_version(version, timeout=30)
            recorder.wait(version)
        assert proxy.spoiled >= 1
        assert recorder.seen == {v: expected(v) for v in (1, 2, 3)}  # never a wrong version
        status = sub.status()
        assert status["delta_fallbacks"] == 1 and status["checksum_failures"] >= 1, status
        assert (status["versions_full"], status["versions_delta"]) == (2, 1)  # 1, 2 in full
        assert status["bytes_received_full"] >= 2 * spec_bytes(SPEC)
        assert "fetching version 2 in full" in (status["last_error"] or ""), status
    finally:
        proxy.stop.set()
        proxy.join(timeout=5)
        ctx.term()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Holds the publisher's delta encoder back until set."""
    event = threading.Event()
    real = publisher_delta.encode_chunk

    def held_back(new: memoryview, base: memoryview, width: int = 2) -> Any:
        event.wait(30)
        return real(new, base, width)

    monkeypatch.setattr(publisher_delta, "encode_chunk", held_back)
    yield event
    event.set()


def test_the_full_version_is_announced_and_served_while_its_delta_is_encoding(
    gate: threading.Event, make_pub: Callable[..., WeightPublisher],
    make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(chunk_size=CHUNK, delta_anchor_every=8)
    holder = make_sub(pub.endpoint)
    pub.publish(drift_weights(SEED, 1, SPEC), version=1)
    holder.wait_for_version(1, timeout=30)
    try:
        pub.publish(drift_weights(SEED, 2, SPEC), version=2)
        pub.wait_announced(2, timeout=10)  # not held back by the encoder
        fresh = make_sub(pub.endpoint)
        got = fresh.wait_for_version(2, timeout=30)  # no base: the full bytes, right away
        assert digests(got.items()) == expected(2)
        assert holder.latest().version == 1  # its delta chunks wait for the encoder
    finally:
        gate.set()
    via_delta = holder.wait_for_version(2, timeout=30)
    assert digests(via_delta.items()) == expected(2)
    assert holder.status()["versions_delta"] == 1 and fresh.status()["versions_delta"] == 0
    assert fresh.status()["bytes_received_delta"] == 0


def test_hostile_delta_fetches_get_errors_and_the_publisher_keeps_serving(
    gate: threading.Event, make_pub: Callable[..., WeightPublisher],
    make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(chunk_size=CHUNK, delta_anchor_every=8)
    for version in (1, 2):
        pub.publish(drift_weights(SEED, version, SPEC), version=version)
    pub.wait_announced(2)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(pub.endpoint)

    def ask(req: int, base: int, chunks: tuple[int, ...]) -> None:
        peer.send(wire.encode(wire.FetchRequest(req=req, publisher_id=pub.publisher_id,
                                                version=2, base=base, chunks=chunks)))

    inline = InlineChunks()

    def error_reply() -> wire.ErrorReply:
        while True:
            assert peer.poll(10_000), "no reply"
            frames = inline.feed(peer.recv_multipart())
            if frames is None or chunk_frame.is_chunk(frames[0]):
                continue
            return wire.decode_as(frames[0], wire.ErrorReply)

    try:
        ask(1, 7, (0,))  # a base no delta is made against
        assert error_reply().code == "version_unavailable"
        ask(2, 1, (10_000,))  # past the last chunk
        assert error_reply().code == "bad_request"
        for req in range(3, 20):  # the same held-back chunk, over and over: a bounded queue
            ask(req, 1, (0,) * 256)
        reply = error_reply()
        assert reply.code == "bad_request" and "too many delta chunks" in reply.message
        fresh = make_sub(pub.endpoint)  # and the publisher still serves everyone else
        assert digests(fresh.wait_for_version(2, timeout=30).items()) == expected(2)
    finally:
        gate.set()
        peer.close()
        ctx.term()


def test_a_relay_passes_deltas_downstream(make_pub: Callable[..., WeightPublisher],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``weightpub status --json`` of the relay runs ``main`` in this process (an
    interpreter start costs seconds of CPU; ``test_config_cli`` runs the real one)."""
    trainer = make_pub(chunk_size=CHUNK, delta_anchor_every=8, metrics_port=0)
    config = RelayConfig.model_validate({
        "upstream": {"endpoint": trainer.endpoint},
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "chunk_mib": 1,
                       "delta_anchor_every": 8},
    })
    recorder = Recorder()
    with Relay(config) as relay, WeightSubscriber(relay.endpoint,
                                                  on_version=recorder) as replica:
        for version in range(1, 5):
            trainer.publish(drift_weights(SEED, version, SPEC), version=version)
            replica.wait_for_version(version, timeout=30)
            recorder.wait(version)
        assert recorder.seen == {v: expected(v) for v in range(1, 5)}
        full = spec_bytes(SPEC)
        upstream, downstream = relay.subscriber.status(), replica.status()
        for hop in (upstream, downstream):
            assert (hop["versions_full"], hop["versions_delta"]) == (1, 3), hop
            assert 0 < hop["bytes_received_delta"] < 0.5 * full, hop
        capsys.readouterr()
        code = cli_main(["status", relay.endpoint, "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        reply = json.loads(out)
        assert reply["bytes_sent_delta"] == downstream["bytes_received_delta"]
        assert reply["bytes_sent_full"] == downstream["bytes_received_full"]
        sent = trainer.data_stats()
        assert sent["bytes_sent_delta"] == upstream["bytes_received_delta"]
        assert sent["bytes_sent_full"] == upstream["bytes_received_full"]
        assert trainer.metrics is not None
        samples = scrape(trainer.metrics.url)  # the same figures on the Prometheus endpoint
        assert samples[("weightpub_publisher_served_delta_bytes_total", ())] == \
            sent["bytes_sent_delta"]
        assert samples[("weightpub_publisher_served_bytes_total", ())] == \
            sent["bytes_sent_delta"] + sent["bytes_sent_full"]


@pytest.mark.parametrize("value", [0, 65, "often"])
def test_a_bad_delta_anchor_every_is_a_config_error_naming_the_key(tmp_path: Any,
                                                                  value: object) -> None:
    from publisher import ConfigError
    from publisher.publisher_config import load_publisher_config

    path = tmp_path / "publisher.yaml"
    path.write_text(f"publisher:\n  endpoint: tcp://127.0.0.1:0\n  delta_anchor_every: {value}\n")
    with pytest.raises(ConfigError, match="publisher.delta_anchor_every"):
        load_publisher_config(path)
    with pytest.raises(ConfigError, match="delta_anchor_every"):
        WeightPublisher("tcp://127.0.0.1:0", delta_anchor_every=0)
