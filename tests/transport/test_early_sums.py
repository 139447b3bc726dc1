"""Early announcement (issue 29, ``announce_early``): the manifest before the hashes, the
checksums after it over the ROUTER, real processes and sockets.

What must hold: versions come bit-exact over the stream and over frames although every
byte lands before its sum (the publisher's sums wait on a gate file here, so the
order is forced, not timed), and nothing is staged until every sum came and matched; a
corrupt chunk is caught when its sum arrives and fetched again as a frame; a publisher
killed -9 while the sums are out stages nothing; a subscriber that predates early sums
(the release before them, run from git) refuses the early manifest naming its
``checksum_algorithm`` and takes the complete one once it is announced, and a new
subscriber follows an old publisher as before. The new message and manifest rules are
bounded and named.
"""

from __future__ import annotations

import subprocess
import tarfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.client import early_sums
from tests.transport.data_path_cases import (
    CHUNK,
    SPEC,
    child_stats,
    exact,
    start_publisher,
    subscriber,
)
from tests.transport.procs import (
    REPO,
    Child,
    det_weights,
    digests,
    held_sums,
    spec_bytes,
    wait_until,
)
from tests.unit.scrape import worker_view
from weightpub_wire import protocol as wire
from weightpub_wire.checksums import chunk_checksum
from weightpub_wire.errors import ProtocolError, VersionUnavailable
from weightpub_wire.sum_messages import (
    MAX_SUMS_PER_REPLY,
    SUM_REPLIES,
    SUM_REQUESTS,
    ChunkSums,
    ChunkSumsReply,
)

pytestmark = pytest.mark.timeout(120)

#: the last release whose subscribers and publishers predate early sums
BEFORE_EARLY_SUMS = "5e9efea"


# -- the wire ------------------------------------------------------------------------------
def _early(**fields: Any) -> dict[str, Any]:
    base = dict(publisher_id="p", started_at=1.0, version=3, created_at=1.0,
                chunk_size=CHUNK, total_bytes=3 * CHUNK, tensors=[], checksums=[0, 0, 0],
                sums_follow=True, checksum_algorithm=wire.SUMS_FOLLOW, t="manifest", p=4)
    return {**base, **fields}


@pytest.mark.parametrize(("fields", "named"), [
    ({"checksums": [0, 7, 0]}, "manifest.checksums: must be zeros when sums_follow"),
    ({"checksum_algorithm": "xxh3_64"}, "manifest.checksum_algorithm: 'xxh3_64' with "
                                        "sums_follow"),
    ({"sums_follow": False}, "manifest.checksum_algorithm: unsupported 'xxh3_64, sums "
                             "follow later'"),
    ({"delta": {"chain": [{"version": 1, "digest": 5}]}}, "manifest.delta: not offered with "
                                                          "sums_follow"),
    ({"checksums": [0, 0]}, "manifest.checksums: 2 entries, expected 3"),
])
def test_an_early_manifest_breaking_a_rule_is_refused_by_name(fields: dict[str, Any],
                                                               named: str) -> None:
    with pytest.raises(ProtocolError, match=named):
        wire.decode(msgspec.msgpack.encode(_early(**fields)))


def test_an_early_manifest_completes_into_an_ordinary_one() -> None:
    early = wire.decode(msgspec.msgpack.encode(_early()))
    assert isinstance(early, wire.Manifest) and early.sums_follow and early.num_chunks == 3
    full = early.with_sums((11, 12, 13))
    assert wire.decode(wire.encode(full)) == full
    assert (full.sums_follow, full.checksum_algorithm, full.checksums) == (
        False, wire.CHECKSUM_ALGORITHM, (11, 12, 13))


def _reply(**fields: Any) -> bytes:
    base = dict(t="chunk_sums_rep", p=4, req=1, version=3, first=0, chunks=[0], sums=[9])
    return msgspec.msgpack.encode({**base, **fields})


@pytest.mark.parametrize(("fields", "named"), [
    ({"chunks": list(range(MAX_SUMS_PER_REPLY + 1)), "sums": [1] * (MAX_SUMS_PER_REPLY + 1)},
     r"chunk_sums_rep.chunks: Expected `array` of length <= 4096"),
    ({"chunks": [0, 1], "sums": [1]}, "chunk_sums_rep.sums: 1 entries for 2 chunks"),
    ({"chunks": [], "sums": []}, r"chunk_sums_rep.chunks: Expected `array` of length >= 1"),
    ({"chunks": [10_000_000]}, r"chunk_sums_rep.chunks\[0\]: Expected `int` <= 9999999"),
    ({"sums": [-1]}, r"chunk_sums_rep.sums\[0\]: Expected `int` >= 0"),
    ({"first": -1}, r"chunk_sums_rep.first: Expected `int` >= 0"),
])
def test_a_sums_reply_breaking_a_bound_is_refused_by_name(fields: dict[str, Any],
                                                           named: str) -> None:
    with pytest.raises(ProtocolError, match=named):
        wire.decode(_reply(**fields), expect=SUM_REPLIES)


@pytest.mark.parametrize(("fields", "have", "named"), [
    ({"chunks": [0, 3], "sums": [1, 2]}, 0, "chunk_sums_rep.chunks: chunk 3, the version has 3"),
    ({"chunks": [1, 1], "sums": [1, 1]}, 0, "chunk_sums_rep.chunks: a chunk named twice"),
    ({"first": 2}, 1, r"chunk_sums_rep.first: 2, past the 1 sums held \(a gap\)"),
])
def test_a_sums_reply_that_does_not_fit_the_version_is_refused_by_name(
        fields: dict[str, Any], have: int, named: str) -> None:
    reply = wire.decode(_reply(**fields), expect=SUM_REPLIES)
    assert isinstance(reply, ChunkSumsReply)
    with pytest.raises(ProtocolError, match=named):
        reply.check(3, have)


def test_a_sums_request_is_bounded() -> None:
    ok = ChunkSums(req=1, publisher_id="p", version=3, have=2)
    assert wire.decode(wire.encode(ok), expect=SUM_REQUESTS) == ok
    for bad, named in (({"have": -1}, "chunk_sums.have"), ({"publisher_id": "x" * 1025},
                                                           "chunk_sums.publisher_id")):
        frame = msgspec.msgpack.encode({**msgspec.to_builtins(ok), "t": "chunk_sums", **bad})
        with pytest.raises(ProtocolError, match=named):
            wire.decode(frame, expect=SUM_REQUESTS)


def _complete(pub: Any, version: int) -> bool:
    """Whether ``version``'s manifest has every sum; False while it is not held yet (a
    loaded box: still being laid out or hashed, ``VersionUnavailable``)."""
    try:
        return not pub.manifest(version).sums_follow
    except VersionUnavailable:
        return False


@pytest.mark.parametrize("chunk", [4096, 65536])
def test_early_sums_equal_the_sums_hashed_the_ordinary_way(
        make_pub: Callable[..., Any], chunk: int) -> None:
    """Whole chunks copied and hashed in one pass, edge chunks hashed from the sources:
    the same sums as a publisher without early sums (odd sizes, chunks across tensors)."""
    weights = {"a": torch.arange(70_001, dtype=torch.int32), "b": torch.ones(3, 1000),
               "c": torch.arange(12_345, dtype=torch.uint8), "d": torch.zeros(0)}
    manifests = []
    for early in (False, True):
        pub = make_pub(chunk_size=chunk, announce_early=early)
        version = pub.publish(weights)
        wait_until(lambda p=pub, v=version: _complete(p, v), 30, "every sum in")
        manifests.append(pub.manifest(version))
    assert manifests[0].checksums == manifests[1].checksums
    assert manifests[0].num_chunks > 4


# -- end to end ----------------------------------------------------------------------------
class Gate:
    """The publisher child's sums wait until ``path`` exists (``procs.held_sums``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self) -> None:
        self.path.touch()

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


@pytest.fixture
def gate(tmp_path: Path) -> Gate:
    return Gate(tmp_path / "hashes-go")


def _publish_async(pub: Child, version: int) -> None:
    """``publish`` returns once hashed (CPU sources): asked now, answered after the gate."""
    pub.send(cmd="publish", id=str(version), version=version, spec=SPEC)


def _published(pub: Child, version: int) -> None:
    pub.expect(lambda e: e.get("event") == "published" and e.get("version") == version, 60,
               f"version {version} published")


def _all_bytes_held(sub: WeightSubscriber, version: int) -> None:
    """Every byte of ``version`` is in staging, none verified, nothing staged: the
    publisher's hashes have not run."""
    wait_until(lambda: sub.status()["fetching_version"] == version
               and sub.status()["fetching_fraction"] == 1.0, 60,
               f"every chunk of version {version} in, waiting for its sums")
    status = sub.status()
    assert status["staged_version"] == version - 1 and status["checksum_failures"] == 0
    assert sub.latest() is None or sub.latest().version == version - 1  # type: ignore[union-attr]


def _sums_in_manifest(staged: Any) -> bool:
    manifest = staged.manifest
    view = staged.buffer.numpy().data
    return not manifest.sums_follow and manifest.checksums == tuple(
        chunk_checksum(view[s: s + n]) for s, n in map(manifest.chunk_span,
                                                        range(manifest.num_chunks)))


def test_versions_come_bit_exact_while_their_sums_follow(
        spawn: Callable[..., Child], closing: Callable[[Any], Any], gate: Gate,
        tmp_path: Path) -> None:
    pub, endpoint = start_publisher(spawn, stream=True, announce_early=True,
                                    sums_gate=str(gate.path))
    streamed = subscriber(closing, endpoint, stream=True)
    framed = subscriber(closing, endpoint)
    chunks = -(-spec_bytes(SPEC) // CHUNK)
    for version in (1, 2, 3):
        gate.close()
        _publish_async(pub, version)
        for sub in (streamed, framed):
            _all_bytes_held(sub, version)
        gate.open()
        _published(pub, version)
        for sub, path in ((streamed, "stream"), (framed, "zmq")):
            staged = sub.wait_for_version(version, timeout=60)
            assert staged.version == version and exact(staged, version)
            assert staged.data_path == path and _sums_in_manifest(staged)
            staged.release()
    for sub in (streamed, framed):
        status = sub.status()
        assert status["checksum_failures"] == 0 and status["last_error"] is None, status
        early = status["early_sums"]
        assert early["versions"] == 3 and early["held"] >= 3 * chunks, early
    # the replica's /metrics counts them (nothing changes them once every version is in)
    early = framed.status()["early_sums"]
    _, text = worker_view(framed, tmp_path / "board")
    for key, what in (("versions", "versions"), ("replies", "replies"),
                      ("held", "chunks_held")):
        assert f'weightpub_early_sums_total{{rank="0",what="{what}"}} {float(early[key])}' \
            in text, text
    assert streamed.status()["stream"]["fallbacks"] == 0
    # and the publisher's manifest is the complete one now, as a late subscriber sees it
    late = subscriber(closing, endpoint)
    staged = late.wait_for_version(3, timeout=60)
    assert exact(staged, 3) and _sums_in_manifest(staged)
    assert late.status()["early_sums"]["versions"] == 0


def test_a_corrupt_chunk_is_caught_when_its_sum_arrives_and_refetched_as_a_frame(
        spawn: Callable[..., Child], closing: Callable[[Any], Any], gate: Gate) -> None:
    pub, endpoint = start_publisher(spawn, stream=True, announce_early=True,
                                    sums_gate=str(gate.path), stream_fault="corrupt:2")
    sub = subscriber(closing, endpoint, stream=True, request_timeout=20.0)
    _publish_async(pub, 1)
    _all_bytes_held(sub, 1)  # the corrupt chunk too: nothing can tell yet
    gate.open()
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and _sums_in_manifest(staged)  # the bad bytes never staged
    assert staged.data_path == "stream+zmq"
    status = sub.status()
    assert status["checksum_failures"] == 1
    assert status["stream"]["fallback_causes"] == {"checksum": 1}
    assert child_stats(pub)["stats"]["bytes_sent_full"] == CHUNK  # that chunk alone


def test_a_publisher_killed_while_the_sums_are_out_stages_nothing(
        spawn: Callable[..., Child], closing: Callable[[Any], Any], gate: Gate) -> None:
    pub, endpoint = start_publisher(spawn, stream=True, announce_early=True,
                                    sums_gate=str(gate.path))
    sub = subscriber(closing, endpoint, stream=True, request_timeout=1.0,
                     max_chunk_retries=1)
    _publish_async(pub, 1)
    _all_bytes_held(sub, 1)
    pub.kill9()
    wait_until(lambda: sub.status()["failures"], 60, "the sums given up")
    status = sub.status()
    assert sub.latest() is None and status["staged_version"] == 0, status
    assert "chunk_sums" in str(status["last_error"]), status


def test_the_complete_manifest_announced_again_brings_every_sum(
        spawn: Callable[..., Child], closing: Callable[[Any], Any], gate: Gate,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No chunk_sums asked here: the publisher's second announcement (PUB) completes the
    held version, which stages bit-exact."""
    monkeypatch.setattr(early_sums.EarlySums, "tick", lambda self, now: None)
    pub, endpoint = start_publisher(spawn, stream=True, announce_early=True,
                                    sums_gate=str(gate.path))
    sub = subscriber(closing, endpoint, stream=True)
    _publish_async(pub, 1)
    _all_bytes_held(sub, 1)
    gate.open()
    staged = sub.wait_for_version(1, timeout=60)
    assert exact(staged, 1) and _sums_in_manifest(staged) and staged.data_path == "stream"
    assert sub.status()["early_sums"]["replies"] == 0


@pytest.mark.parametrize("cut_through", [True, False], ids=["cut-through", "store-forward"])
def test_a_relay_forwards_an_early_version_only_once_its_sums_matched(
        make_pub: Callable[..., Any], closing: Callable[[Any], Any],
        cut_through: bool) -> None:
    """In this process: the trainer's sums wait on an event, so the relay's upstream
    subscriber holds every byte before any sum; nothing reaches downstream until then."""
    from weightpub.deployment_config import RelayConfig
    from weightpub.relay import Relay

    go = threading.Event()
    pub = make_pub(chunk_size=CHUNK, stream=True, announce_early=True)
    held_sums(pub, go.is_set)
    relay = closing(Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": pub.endpoint, "stream": True, "request_timeout": 5.0},
        "cut_through": cut_through,
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "heartbeat_interval": 0.2,
                       "announce_early": not cut_through}})))
    down = subscriber(closing, relay.endpoint)
    for version in (1, 2):
        go.clear()
        weights = det_weights(7, version, SPEC)
        publishing = threading.Thread(target=pub.publish, args=(weights,),
                                      kwargs={"version": version})
        publishing.start()
        _all_bytes_held(relay.subscriber, version)
        assert relay.publisher.latest_version == version - 1  # nothing forwarded yet
        go.set()
        publishing.join(60)
        staged = down.wait_for_version(version, timeout=60)
        assert digests(staged.items()) == digests(weights.items())
        assert staged.publisher_id == relay.publisher.publisher_id
        staged.release()
    assert relay.subscriber.status()["early_sums"]["versions"] == 2
    assert down.status()["checksum_failures"] == 0


# -- the release before early sums, from git ---------------------------------------------------
@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    tree = tmp_path_factory.mktemp("before-early-sums")
    archive = tree / "tree.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive),
                    BEFORE_EARLY_SUMS], check=True, timeout=60)
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    yield tree


def _status(child: Child) -> dict[str, Any]:
    return child.request("status")["status"]


def test_an_old_subscriber_refuses_an_early_manifest_by_name_then_takes_the_complete_one(
        spawn: Callable[..., Child], closing: Callable[[Any], Any], gate: Gate,
        old_tree: Path) -> None:
    pub, endpoint = start_publisher(spawn, announce_early=True, sums_gate=str(gate.path))
    old = closing(Child("subscriber", {"endpoint": endpoint,
                                       "options": {"request_timeout": 3.0}}, repo=old_tree))
    old.event("ready", timeout=60)
    _publish_async(pub, 1)
    wait_until(lambda: _status(old)["last_error"], 60, "the early manifest refused")
    status = _status(old)
    assert "checksum_algorithm: unsupported 'xxh3_64, sums follow later'" in \
        status["last_error"], status
    assert status["staged_version"] == 0 and status["fetching_version"] is None, status
    gate.open()  # hashed: the complete manifest is announced again
    staged = old.expect(lambda e: e.get("event") == "staged", 60, "version 1 staged")
    assert staged["version"] == 1
    assert staged["digests"] == digests(det_weights(7, 1, SPEC).items())


def test_a_new_subscriber_follows_an_old_publisher_as_before(
        closing: Callable[[Any], Any], old_tree: Path) -> None:
    pub = closing(Child("publisher", {"endpoint": "tcp://127.0.0.1:0", "seed": 7,
                                      "chunk_size": CHUNK, "stream": True}, repo=old_tree))
    endpoint = pub.event("ready", timeout=60)["endpoint"]
    sub = subscriber(closing, endpoint, stream=True)
    for version in (1, 2):
        pub.request("publish", timeout=60, version=version, spec=SPEC)
        staged = sub.wait_for_version(version, timeout=60)
        assert exact(staged, version) and staged.data_path == "stream"
        staged.release()
    status = sub.status()
    assert status["early_sums"] == {"versions": 0, "replies": 0, "held": 0}
    assert status["last_error"] is None and status["bad_messages"] == 0, status
