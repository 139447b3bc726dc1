"""A new kind of chunk source plugs into the sync client without touching it.

``MemorySource`` lives here, in the test: it serves a version from bytes it
holds, the way a NIXL reader or a slice source would serve one from wherever its
bytes are. It is handed to a real ``SyncClient`` through ``pickers`` only; the
client asks it for chunks under its credit, places and verifies what it
delivers, tells it of a bad chunk, and stages the version, all through
``staging/chunk_source.py``. The publisher's endpoint is a port nothing listens
on: every byte comes from the new source.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest
import zmq

from subscriber_ext.transport.client.source_choice import SourceChoice
from subscriber_ext.transport.client.sync_client import SyncClient, SyncOptions
from subscriber_ext.transport.staging.assembly import Assembly, StagedVersion
from subscriber_ext.transport.staging.chunk_source import ChunkSource, Retry, SourceSink
from subscriber_ext.transport.staging.request_table import RequestTable
from tests.unit.transport_fakes import CHUNK, OLD
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.checksums import chunk_checksum
from weightpub_wire.errors import WeightPubTimeout

pytestmark = pytest.mark.timeout(20)

CHUNKS = 12


def _version(version: int) -> tuple[wire.Manifest, bytes]:
    data = bytes((i * 7 + version) % 251 for i in range(CHUNKS * CHUNK))
    checksums = tuple(chunk_checksum(memoryview(data)[c * CHUNK:(c + 1) * CHUNK])
                      for c in range(CHUNKS))
    manifest = wire.Manifest(publisher_id=OLD, started_at=1700000000.0, version=version,
                             created_at=1700000001.0, chunk_size=CHUNK, total_bytes=len(data),
                             tensors=(wire.TensorEntry("w", "uint8", (len(data),), 0,
                                                       len(data)),),
                             checksums=checksums)
    return manifest, data


class MemorySource(ChunkSource):
    """Serves chunks from bytes it holds; delivers what it was asked on its next tick."""

    def __init__(self, sink: SourceSink, data: bytes, *, corrupt: set[int] | None = None) -> None:
        self.sink = sink
        self.data = data
        self.corrupt = set(corrupt or ())  # chunks sent wrong once
        self.pending: list[tuple[int, int, int]] = []  # (req, version, chunk)
        self.asked: list[int] = []
        self.arrivals = 0
        self.refusals: list[int] = []
        self.closed = False

    @property
    def label(self) -> str:
        return "memory"

    def room(self, window: int) -> int:
        return window - self.sink.requests.peer_in_flight().get(self, 0)

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        for chunk in chunks:
            req = self.sink.requests.next_id()
            self.sink.requests.track(req, [chunk], now, source=self)
            self.pending.append((req, target.fetch_version, chunk))
            self.asked.append(chunk)
        return []

    def expire(self, now: float, retry: Retry) -> bool:
        return False  # delivers everything on its next tick

    def tick(self, now: float) -> float:
        pending, self.pending = self.pending, []
        for req, version, chunk in pending:
            payload = bytearray(self.data[chunk * CHUNK:(chunk + 1) * CHUNK])
            if chunk in self.corrupt:
                self.corrupt.discard(chunk)
                payload[0] ^= 0xFF
            frame = zmq.Frame(bytes(chunk_frame.build(req=req, version=version, chunk=chunk,
                                                      payload=payload)))
            self.sink.chunk(chunk_frame.parse(frame.buffer), frame, self, self)
        return 0.0

    def arrived(self, via: object, size: int, now: float) -> None:
        assert via is self
        self.arrivals += 1

    def refused(self, via: object, chunk: int, why: str, now: float) -> bool:
        self.refusals.append(chunk)
        return False  # not handled here: the chunk counts a try and is asked again

    def close(self) -> None:
        self.closed = True


class MemoryPicker:
    """Serves the manifests it holds bytes for; None for any other."""

    def __init__(self, versions: dict[int, bytes], corrupt: set[int] | None = None) -> None:
        self.versions = versions
        self.corrupt = corrupt
        self.made: list[MemorySource] = []

    def __call__(self, manifest: wire.Manifest, sink: SourceSink) -> list[ChunkSource] | None:
        data = self.versions.get(manifest.version)
        if data is None:
            return None
        self.made.append(MemorySource(sink, data, corrupt=self.corrupt))
        return [self.made[-1]]

    def close(self) -> None:
        for source in self.made:
            source.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def _client(ctx: zmq.Context, picker: MemoryPicker,
            staged: list[StagedVersion]) -> SyncClient:
    options = SyncOptions(request_timeout=1.0, window_bytes=4 * CHUNK, chunks_per_request=2,
                          max_chunk_retries=2)
    return SyncClient(ctx, "tcp://127.0.0.1:9", "memory-test", options, staged.append,
                      pickers=[picker])


def _run(client: SyncClient, until: int, staged: list[StagedVersion]) -> None:
    for _ in range(200):
        client.tick(time.monotonic())
        if any(s.version == until for s in staged):
            return
    raise AssertionError(f"version {until} was not staged: {client.report.error}")


def test_a_source_from_a_picker_serves_a_whole_version(ctx: zmq.Context) -> None:
    manifest, data = _version(3)
    picker = MemoryPicker({3: data})
    staged: list[StagedVersion] = []
    client = _client(ctx, picker, staged)
    try:
        client.start_target(manifest)
        _run(client, 3, staged)
        assert bytes(staged[0].buffer.numpy()[: len(data)]) == data  # verified, staged
        source = picker.made[0]
        assert sorted(source.asked) == list(range(CHUNKS))  # every chunk once, from it
        assert source.arrivals == CHUNKS
        assert client.requests.in_flight() == 0  # nothing went to the publisher
        staged[0].release()
    finally:
        client.close()
    assert source.closed  # the client closes the pickers it was given


def test_a_bad_chunk_is_refused_to_its_source_and_asked_again(ctx: zmq.Context) -> None:
    manifest, data = _version(4)
    picker = MemoryPicker({4: data}, corrupt={5})
    staged: list[StagedVersion] = []
    client = _client(ctx, picker, staged)
    try:
        client.start_target(manifest)
        _run(client, 4, staged)
        source = picker.made[0]
        assert source.refusals == [5]  # the receiver told the source which chunk failed
        assert source.asked.count(5) == 2  # counted a try, then asked again
        assert client.receiver.checksum_failures == 1
        assert bytes(staged[0].buffer.numpy()[: len(data)]) == data
        staged[0].release()
    finally:
        client.close()


class EvenFirst(MemorySource):
    """A first source (as a NIXL reader falling back chunk by chunk would be): it takes
    the even chunks it is offered and hands the odd ones on."""

    first = True

    def ahead(self) -> int:
        return 4

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        super().ask(target, [c for c in chunks if c % 2 == 0], now)
        return [c for c in chunks if c % 2]


def test_a_first_source_from_a_picker_leaves_the_rest_to_the_publisher(
        ctx: zmq.Context) -> None:
    manifest, data = _version(6)
    firsts: list[EvenFirst] = []

    def picker(m: wire.Manifest, sink: SourceSink) -> list[ChunkSource]:
        firsts.append(EvenFirst(sink, data))
        return [firsts[-1]]

    staged: list[StagedVersion] = []
    options = SyncOptions(request_timeout=30.0, window_bytes=4 * CHUNK, chunks_per_request=2)
    client = SyncClient(ctx, "tcp://127.0.0.1:9", "memory-test", options, staged.append,
                        pickers=[picker])
    try:
        client.start_target(manifest)
        for _ in range(20):
            client.tick(time.monotonic())
        target = client.target
        assert target is not None
        assert sorted(firsts[0].asked) == list(range(0, CHUNKS, 2))  # every even chunk
        assert firsts[0].arrivals == CHUNKS // 2
        assert target.missing == set(range(1, CHUNKS, 2))  # the odd ones: the publisher's,
        publisher = client.requests.peer_in_flight()  # asked of it (nothing answers there)
        assert publisher == {} and client.requests.in_flight() == 4  # its credit: 4 chunks
        assert client.requests.asked() <= set(range(1, CHUNKS, 2))
    finally:
        client.close()


class Refusing(MemorySource):
    def usable(self, manifest: wire.Manifest) -> bool:
        return False


class _Publisher(MemorySource):
    @property
    def label(self) -> str:
        return "publisher"


def test_pickers_in_order_and_an_unusable_source_falls_back() -> None:
    sink = SourceSink(requests=RequestTable(), chunk=lambda *a: None, error=lambda r: None,
                      bad=lambda e: None, discard_rest=lambda m, s: None)
    first, _ = _version(1)
    second, data = _version(2)
    fallback = _Publisher(sink, b"")
    taken = MemorySource(sink, data)
    choice = SourceChoice([lambda m, s: [Refusing(s, data)] if m.version == 1 else None,
                           lambda m, s: [taken]], fallback, sink)
    assert choice.serving(first) == [taken]  # the first picker's source is not usable
    assert choice.serving(second) == [taken]
    choice = SourceChoice([lambda m, s: None], fallback, sink)
    assert choice.serving(second) == [fallback]  # no picker answers: the publisher
    assert choice.live() == [fallback]


def test_timeouts_go_through_the_source(ctx: zmq.Context) -> None:
    """``expire`` is the source's: one that counts a try per silent chunk gives the
    version up after ``max_chunk_retries``, with the client's own error."""

    class Silent(MemorySource):
        def tick(self, now: float) -> float:
            self.pending.clear()  # never answers
            return 0.0

        def expire(self, now: float, retry: Retry) -> bool:
            table = self.sink.requests
            for req, request in list(table.requests.items()):
                if request.source is self and now - request.sent_at >= 1.0:
                    table.forget(req)
                    for chunk in sorted(request.chunks):
                        if retry(chunk, "timed out in memory", WeightPubTimeout):
                            return True
            return False

    manifest, data = _version(5)
    silent: list[Silent] = []

    def picker(m: wire.Manifest, sink: SourceSink) -> list[ChunkSource]:
        silent.append(Silent(sink, data))
        return [silent[-1]]

    staged: list[StagedVersion] = []
    options = SyncOptions(request_timeout=1.0, window_bytes=4 * CHUNK, max_chunk_retries=2)
    client = SyncClient(ctx, "tcp://127.0.0.1:9", "memory-test", options, staged.append,
                        pickers=[picker])
    try:
        client.start_target(manifest)
        start = time.monotonic()
        for step in range(10):
            client.tick(start + step * 2.0)
        assert client.target is None and staged == []
        assert "timed out in memory 3 times" in str(client.report.error)
    finally:
        client.close()


class InPlaceSource(MemorySource):
    """Writes chunks straight into the target's buffer (as a one-sided read does) and
    hands them to ``sink.in_place``: no frame, no copy by the client."""

    first = True

    def __init__(self, sink: SourceSink, data: bytes, *, corrupt: set[int] | None = None) -> None:
        super().__init__(sink, data, corrupt=corrupt)
        self.target: Assembly | None = None
        self.outcomes: dict[int, bool | None] = {}

    def ahead(self) -> int:
        return CHUNKS

    def ask(self, target: Assembly, chunks: Sequence[int], now: float) -> list[int]:
        self.target = target
        super().ask(target, chunks, now)
        return []

    def tick(self, now: float) -> float:
        pending, self.pending = self.pending, []
        for req, version, chunk in pending:
            assert self.target is not None
            place = self.target.chunk_target(chunk)
            place[:] = self.data[chunk * CHUNK:(chunk + 1) * CHUNK]
            if chunk in self.corrupt:
                self.corrupt.discard(chunk)
                place[0] ^= 0xFF
            self.outcomes[chunk] = self.sink.in_place(req, version, chunk, self, self)
        return 0.0

    def refused(self, via: object, chunk: int, why: str, now: float) -> bool:
        self.refusals.append(chunk)
        return False


def test_a_chunk_written_in_place_is_verified_there(ctx: zmq.Context) -> None:
    """``SourceSink.in_place`` (issue 31): the client checksums a chunk already in its
    buffer and marks it, exactly as a copied one; a bad one is refused and asked again."""
    manifest, data = _version(7)
    made: list[InPlaceSource] = []

    def picker(m: wire.Manifest, sink: SourceSink) -> list[ChunkSource]:
        made.append(InPlaceSource(sink, data, corrupt={3}))
        return [made[-1]]

    staged: list[StagedVersion] = []
    options = SyncOptions(request_timeout=1.0, window_bytes=4 * CHUNK, max_chunk_retries=2)
    client = SyncClient(ctx, "tcp://127.0.0.1:9", "memory-test", options, staged.append,
                        pickers=[picker])
    try:
        client.start_target(manifest)
        _run(client, 7, staged)
        source = made[0]
        assert bytes(staged[0].buffer.numpy()[: len(data)]) == data
        assert source.refusals == [3] and source.asked.count(3) == 2
        assert client.receiver.checksum_failures == 1
        assert client.receiver.received_bytes == len(data) + CHUNK  # counted, not copied
        assert client.requests.in_flight() == 0  # the publisher was never asked
        staged[0].release()
    finally:
        client.close()
