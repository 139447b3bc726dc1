"""One snapshot by default: each version is copied over the previous one (issue 18).

Real sockets throughout. What must hold while version N+1 overwrites N's buffer:
every chunk anyone receives is one version's bytes whole (checked against its
manifest's checksum, or the staged tensors against the source, bit for bit), a
subscriber mid-fetch of N ends with N+1, a late joiner gets N+1, and the host
memory held is ``keep_versions`` snapshots.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import zmq

from publisher import WeightPublisher
from subscriber_ext import StagedVersion, WeightSubscriber
from tests.transport.procs import det_weights, digests, pace_replies, spec_bytes, wait_until
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.checksums import chunk_checksum
from weightpub_wire.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

SEED = 18
CHUNK = 64 << 10
SPEC = [("w", "float32", [2048, 1024]), ("v", "float32", [1024, 1024]),
        ("b", "bfloat16", [4096])]  # 12 MiB: 192 chunks
BIG = [("w", "float32", [16384, 1024]), ("b", "bfloat16", [4096])]  # 64 MiB


def _fetch_one(sock: zmq.Socket, manifest: wire.Manifest, chunk: int,
               req: int) -> str:
    """Fetch one chunk of ``manifest``'s version: "ok" (its checksum matches), "gone"
    (version_unavailable) or "MIXED" (bytes that are not that version's)."""
    sock.send(wire.encode(wire.FetchRequest(req=req, publisher_id=manifest.publisher_id,
                                            version=manifest.version, chunks=(chunk,))))
    while True:
        assert sock.poll(10_000), "no reply within 10 s"
        frame = sock.recv(copy=False)
        if chunk_frame.is_chunk(frame.buffer):
            header = chunk_frame.parse(frame.buffer)
            if header.follows:  # the payload is the next message, straight from the snapshot
                assert sock.poll(10_000), "no payload within 10 s"
                frame = sock.recv(copy=False)
            if header.req != req:
                continue
            payload = chunk_frame.payload(frame.buffer, header)
            assert len(payload) == header.size
            return "ok" if chunk_checksum(payload) == manifest.checksums[chunk] else "MIXED"
        reply = wire.decode(frame.buffer)
        if isinstance(reply, wire.ErrorReply) and reply.req == req:
            assert reply.code == "version_unavailable", reply
            return "gone"


def test_chunks_of_the_old_version_are_its_own_bytes_or_unavailable_never_mixed(
    make_pub: Callable[..., WeightPublisher],
) -> None:
    """A reader keeps fetching version N while N+1, N+2, ... are copied over its buffer."""
    pub = make_pub(chunk_size=CHUNK)
    pub.publish(det_weights(SEED, 1, SPEC))
    pub.wait_announced(1)
    ctx = zmq.Context()
    outcomes: dict[str, int] = {"ok": 0, "gone": 0, "MIXED": 0}
    done = threading.Event()

    def trainer() -> None:
        try:
            for version in range(2, 12):
                pub.publish(det_weights(SEED, version, SPEC))
        finally:
            done.set()

    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(pub.endpoint)
        manifest = pub.manifest(1)
        thread = threading.Thread(target=trainer, name="test-trainer", daemon=True)
        thread.start()
        req = 0
        while not done.is_set() or req < 50:
            req += 1
            outcome = _fetch_one(sock, manifest, req % manifest.num_chunks, req)
            outcomes[outcome] += 1
            if outcome == "gone":
                manifest = pub.manifest()  # move to the newest, as a subscriber would
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        ctx.destroy(linger=0)
    assert outcomes["MIXED"] == 0, outcomes
    assert outcomes["ok"] > 0 and outcomes["gone"] > 0, outcomes


def test_a_subscriber_mid_fetch_of_n_ends_with_n_plus_1_verified(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(chunk_size=CHUNK)
    staged_versions: list[int] = []
    sub = make_sub(pub.endpoint, on_version=lambda s: staged_versions.append(s.version),
                   window_bytes=4 * CHUNK)  # a few chunks in flight: the rest still to ask
    wait_until(lambda: getattr(sub, "_client", None) is not None, 10, "the sync client")
    pace_replies(sub._client, 0.01)  # ~100 chunks a second: 2 s for version 1
    pub.publish(det_weights(SEED, 1, SPEC))
    wait_until(lambda: pub.data_stats()["bytes_sent_full"] > 20 * CHUNK, 20,
               "the subscriber to be fetching version 1")
    assert not staged_versions  # mid-fetch
    second = det_weights(SEED, 2, SPEC)
    pub.publish(second)
    staged = sub.wait_for_version(2, timeout=60)
    assert staged.version == 2
    assert digests(staged.items()) == digests(second.items())  # bit for bit: never mixed
    staged.release()
    assert 1 not in staged_versions  # version 1 was overwritten before it was complete


def test_back_to_back_publishes_with_a_slow_reader_deliver_only_whole_versions(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(chunk_size=CHUNK)
    mismatched: list[int] = []
    delivered: list[int] = []

    def on_version(staged: StagedVersion) -> None:
        delivered.append(staged.version)
        if digests(staged.items()) != digests(det_weights(SEED, staged.version, SPEC).items()):
            mismatched.append(staged.version)

    sub = make_sub(pub.endpoint, on_version=on_version, window_bytes=16 * CHUNK)
    wait_until(lambda: getattr(sub, "_client", None) is not None, 10, "the sync client")
    pace_replies(sub._client, 0.002)
    for version in range(1, 31):
        assert pub.publish(det_weights(SEED, version, SPEC)) == version
    pub.wait_announced(30)
    staged = sub.wait_for_version(30, timeout=60)
    assert digests(staged.items()) == digests(det_weights(SEED, 30, SPEC).items())
    staged.release()
    wait_until(lambda: delivered and delivered[-1] == 30, 10, "the callback to see 30")
    assert not mismatched
    assert delivered == sorted(set(delivered))
    assert pub.data_stats()["host_held_bytes"] == pub.manifest().total_bytes  # one snapshot


def test_a_late_joiner_during_the_copy_gets_the_new_version(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(chunk_size=CHUNK)
    pub.publish(det_weights(SEED, 1, BIG))
    pub.wait_announced(1)
    first = pub._store.get(1)
    assert first is not None
    second = det_weights(SEED, 2, BIG)
    trainer = threading.Thread(target=pub.publish, args=(second,), name="test-trainer",
                               daemon=True)
    trainer.start()
    wait_until(lambda: first.lent, 20, "the copy of version 2 to take version 1's buffer")
    seen: list[tuple[int, bool]] = []

    def on_version(staged: StagedVersion) -> None:
        source = det_weights(SEED, staged.version, BIG)
        seen.append((staged.version, digests(staged.items()) == digests(source.items())))

    sub = make_sub(pub.endpoint, on_version=on_version)
    staged = sub.wait_for_version(2, timeout=60)
    wait_until(lambda: seen and seen[-1][0] == 2, 20, "the callback to see version 2")
    assert digests(staged.items()) == digests(second.items())
    staged.release()
    trainer.join(timeout=30)
    assert all(whole for _, whole in seen), seen  # whatever it staged was whole


def test_kept_versions_are_the_host_memory_held_and_reported(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    size = spec_bytes(SPEC)
    lean = make_pub(chunk_size=CHUNK)
    sub = make_sub(lean.endpoint)
    for version in range(1, 5):
        lean.publish(det_weights(SEED, version, SPEC))
        sub.wait_for_version(version, timeout=30).release()
    stats = lean.data_stats()
    assert stats["keep_versions"] == 1
    assert stats["host_held_bytes"] == size  # one snapshot, reused by every version

    # deltas keep their base whole: two snapshots by default, counted the same way
    deltas = make_pub(chunk_size=CHUNK, delta_anchor_every=4)
    delta_sub = make_sub(deltas.endpoint)
    for version in range(1, 5):
        deltas.publish(det_weights(SEED, version, SPEC))
        delta_sub.wait_for_version(version, timeout=30).release()
    stats = deltas.data_stats()
    assert stats["keep_versions"] == 2
    assert stats["host_held_bytes"] == 2 * size

    kept = make_pub(chunk_size=CHUNK, keep_versions=3, host_budget_bytes=size * 5 // 2)
    kept.publish(det_weights(SEED, 1, SPEC))
    kept.publish(det_weights(SEED, 2, SPEC))
    with pytest.raises(Exception, match="keep_versions=3"):  # a third does not fit
        kept.publish(det_weights(SEED, 3, SPEC))


def test_deltas_with_one_kept_version_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="keep_versions.*delta_anchor_every|"
                                          "delta_anchor_every.*keep_versions"):
        WeightPublisher("tcp://127.0.0.1:0", keep_versions=1, delta_anchor_every=2)
