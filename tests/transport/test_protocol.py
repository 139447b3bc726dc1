"""Wire format: every message round-trips; every malformed field is named in a ProtocolError."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from publisher import ProtocolError, WeightPubError
from weightpub_wire import protocol as wire
from weightpub_wire.collective_layout import CollectiveAnnounce, GroupStatus, IpcHandle
from weightpub_wire.protocol import Limits, Manifest, TensorEntry, decode, encode

pytestmark = pytest.mark.timeout(30)
P = wire.PROTOCOL_VERSION


def manifest(**overrides: Any) -> Manifest:
    tensors = (
        TensorEntry("a.weight", "float32", (4, 8), 0, 128),
        TensorEntry("a.bias", "bfloat16", (), 128, 2),
        TensorEntry("empty", "int8", (0, 7), 192, 0),
        TensorEntry("b", "uint8", (5000,), 192, 5000),
    )
    fields: dict[str, Any] = dict(
        publisher_id="pub-1", started_at=1700000000.5, version=3, created_at=1700000001.25,
        model_id="org/model", chunk_size=4096, total_bytes=5192, tensors=tensors,
        checksums=(1, (1 << 64) - 1),
    )
    fields.update(overrides)
    return Manifest(**fields)


ANNOUNCE = CollectiveAnnounce(backend="gloo", store_port=29500, epoch=3, bucket_bytes=8192,
                              timeout=30.0)


def every_message() -> list[wire.Message]:
    report = wire.Report(subscriber_id="host-1-abc", staged_version=3, applied_version=2,
                         last_error="oops: x")
    ipc = IpcHandle(version=3, device_index=0, handle=b"\x01" * 64, storage_bytes=8192,
                    storage_offset=0, ref_counter_handle=b"/torch_123", ref_counter_offset=8,
                    event_handle=b"\x02" * 64, event_sync_required=True)
    return [
        manifest(),
        manifest(collective=ANNOUNCE),
        manifest(total_bytes=0, tensors=(), checksums=(), version=1),
        wire.Heartbeat(publisher_id="pub-1", started_at=1.5, latest_version=7, sent_at=2.5,
                       interval=0.5),
        wire.LatestRequest(req=1),
        wire.LatestReply(req=2, publisher_id="pub-1", started_at=1.5,
                         pub_endpoint="tcp://127.0.0.1:5556", heartbeat_interval=1.0,
                         manifest=manifest()),
        wire.LatestReply(req=3, publisher_id="pub-1", started_at=1.5,
                         pub_endpoint="ipc:///tmp/x.pub", heartbeat_interval=1.0, manifest=None),
        wire.FetchRequest(req=4, publisher_id="pub-1", version=3, chunks=(0, 1)),
        wire.ErrorReply(req=6, code="version_unavailable", message="gone", version=3),
        wire.ErrorReply(req=7, code="bad_request", message="bad"),
        report,
        wire.Report(subscriber_id="s", staged_version=0, applied_version=0),
        wire.Report(subscriber_id="node", staged_version=4, applied_version=4, ranks=(0, 1)),
        wire.Report(subscriber_id="node", staged_version=4, applied_version=4, data_path="gloo"),
        wire.Report(subscriber_id="rank1", staged_version=4, applied_version=4, ranks=(1,),
                    data_path="slices", received_fraction=0.53),
        wire.Report(subscriber_id="member", staged_version=4, applied_version=4,
                    peer_nixl=wire.PeerNixlFigures(bytes_from_peers=1 << 40, chunks_from_peers=9,
                                                   offers=2, unoffered=(("frames", 1),)),
                    peer_stream=wire.PeerStreamFigures(bytes_from_peers=1 << 40, bytes_served=7,
                                                       chunks_served=1,
                                                       fallbacks=(("closed", 1),))),
        wire.StatusRequest(req=8),
        wire.StatusReply(req=9, publisher_id="pub-1", started_at=1.5, latest_version=3,
                         versions=(2, 3), subscribers=(report,)),
        wire.StatusReply(req=10, publisher_id="pub-1", started_at=1.5, latest_version=3,
                         versions=(3,), subscribers=(),
                         collective=GroupStatus(backend="gloo", state="active", epoch=2,
                                                members=("node-a", "node-b"), rounds=5)),
        wire.LatestReply(req=11, publisher_id="pub-1", started_at=1.5,
                         pub_endpoint="tcp://127.0.0.1:5556", heartbeat_interval=1.0,
                         collective=ANNOUNCE),
        wire.CollectivePoll(req=12, subscriber_id="node-a", state="free", backend="gloo"),
        wire.CollectivePoll(req=13, subscriber_id="node-a", state="member", epoch=4,
                            backend="cuda_ipc", device_uuid="GPU-1234", ipc_done=3),
        wire.CollectiveReply(req=14, publisher_id="pub-1", started_at=1.5, state="forming",
                             epoch=4, rank=2, world_size=3),
        wire.CollectiveReply(req=15, publisher_id="pub-1", started_at=1.5, state="active",
                             ipc=ipc),
    ]


@pytest.mark.parametrize("message", every_message(), ids=lambda m: type(m).__name__)
def test_round_trip(message: wire.Message) -> None:
    frame = encode(message)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert type(back) is type(message)
    assert back == message
    assert decode(frame, expect=(type(message),)) == message


def test_every_message_type_is_covered() -> None:
    covered = {type(m) for m in every_message()}
    assert covered == set(wire.ALL_TYPES)


def test_manifest_geometry() -> None:
    m = manifest()
    assert m.num_chunks == 2
    assert m.chunk_span(0) == (0, 4096)
    assert m.chunk_span(1) == (4096, 1096)
    by_name = {t.name: t for t in m.tensors}
    assert list(m.chunks_of(by_name["a.weight"])) == [0]
    assert list(m.chunks_of(by_name["empty"])) == []
    assert list(m.chunks_of(by_name["b"])) == [0, 1]


def test_encoding_is_plain_msgpack_without_pickle() -> None:
    body = msgpack.unpackb(encode(manifest()), raw=False)
    assert body["p"] == wire.PROTOCOL_VERSION
    assert body["t"] == "manifest"
    assert body["tensors"][0] == {"name": "a.weight", "dtype": "float32", "shape": [4, 8],
                                  "offset": 0, "nbytes": 128}


# -- malformed messages ------------------------------------------------------------------------
def wire_of(message: wire.Message) -> dict[str, Any]:
    return msgpack.unpackb(encode(message), raw=False)


def pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    """A mutation that sets ``a.b[2].c``-style paths inside a wire dict."""
    def apply(body: dict[str, Any]) -> None:
        node: Any = body
        parts = path.replace("]", "").replace("[", ".").split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return apply


def _overlap(body: dict[str, Any]) -> None:
    body["tensors"][1]["offset"] = 64  # inside a.weight's bytes [0, 128)


def _duplicate(body: dict[str, Any]) -> None:
    body["tensors"][2]["name"] = "a.weight"


def _past_end(body: dict[str, Any]) -> None:
    body["tensors"][3]["offset"] = 8192  # 8192 + 5000 > total_bytes 5192


def _offset_beyond_total(body: dict[str, Any]) -> None:
    body["tensors"] = [dict(body["tensors"][0], offset=6400)]


def _huge_tensor_list(body: dict[str, Any]) -> None:
    body["tensors"] = [copy.deepcopy(body["tensors"][0]) for _ in range(1001)]


def _drop(key: str) -> Mutation:
    def apply(body: dict[str, Any]) -> None:
        del body[key]
    return apply


MANIFEST_CASES: list[tuple[str, Mutation, str]] = [
    ("unknown dtype", _set("tensors[0].dtype", "complex64"), "manifest.tensors[0].dtype"),
    ("getattr dtype", _set("tensors[0].dtype", "__class__"), "manifest.tensors[0].dtype"),
    ("dtype not a string", _set("tensors[0].dtype", 5), "manifest.tensors[0].dtype"),
    ("nbytes vs shape", _set("tensors[0].nbytes", 127), "manifest.tensors[0].nbytes"),
    ("nbytes vs dtype", _set("tensors[0].dtype", "float16"), "manifest.tensors[0].nbytes"),
    ("overlap", _overlap, "manifest.tensors[1].offset"),
    ("duplicate name", _duplicate, "manifest.tensors[2].name"),
    ("ends past total_bytes", _past_end, "manifest.tensors[3]"),
    ("offset past total_bytes", _offset_beyond_total, "manifest.tensors[0]"),
    ("misaligned offset", _set("tensors[1].offset", 129), "manifest.tensors[1].offset"),
    ("too few checksums", _set("checksums", [1]), "manifest.checksums"),
    ("too many checksums", _set("checksums", [1, 2, 3]), "manifest.checksums"),
    ("checksum not an int", _set("checksums", [1, "x"]), "manifest.checksums[1]"),
    ("negative checksum", _set("checksums", [1, -1]), "manifest.checksums[1]"),
    ("negative version", _set("version", -1), "manifest.version"),
    ("version zero", _set("version", 0), "manifest.version"),
    ("bool version", _set("version", True), "manifest.version"),
    ("float version", _set("version", 3.0), "manifest.version"),
    ("negative offset", _set("tensors[0].offset", -64), "manifest.tensors[0].offset"),
    ("negative dim", _set("tensors[0].shape", [-4, -8]), "manifest.tensors[0].shape[0]"),
    ("bool dim", _set("tensors[0].shape", [True, 32]), "manifest.tensors[0].shape[0]"),
    ("bool nbytes", _set("tensors[1].nbytes", True), "manifest.tensors[1].nbytes"),
    ("negative total", _set("total_bytes", -1), "manifest.total_bytes"),
    ("too many dims", _set("tensors[2].shape", [1] * 17 + [0]), "manifest.tensors[2].shape"),
    ("shape not a list", _set("tensors[0].shape", "4x8"), "manifest.tensors[0].shape"),
    ("newline in name", _set("tensors[0].name", "a\nweight"), "manifest.tensors[0].name"),
    ("NUL in name", _set("tensors[0].name", "a\x00b"), "manifest.tensors[0].name"),
    ("escape in name", _set("tensors[0].name", "\x1b[31mred"), "manifest.tensors[0].name"),
    ("empty name", _set("tensors[0].name", ""), "manifest.tensors[0].name"),
    ("bytes name", _set("tensors[0].name", b"a.weight"), "manifest.tensors[0].name"),
    ("long name", _set("tensors[0].name", "x" * 5000), "manifest.tensors[0].name"),
    ("control char publisher_id", _set("publisher_id", "p\x07"), "manifest.publisher_id"),
    ("tensor not a map", _set("tensors[0]", [1, 2]), "manifest.tensors[0]"),
    ("tensors not a list", _set("tensors", {"a": 1}), "manifest.tensors"),
    ("missing field", _drop("chunk_size"), "manifest.chunk_size"),
    ("tiny chunk size", _set("chunk_size", 16), "manifest.chunk_size"),
    ("nan started_at", _set("started_at", float("nan")), "manifest.started_at"),
    ("inf created_at", _set("created_at", math.inf), "manifest.created_at"),
    ("checksum algorithm", _set("checksum_algorithm", "md5"), "manifest.checksum_algorithm"),
    ("C1 control in name", _set("tensors[0].name", "a\x9bb"), "manifest.tensors[0].name"),
    ("huge dims of an empty tensor", _set("tensors[2].shape", [1 << 40, 1 << 40, 0]),
     "manifest.tensors[2].shape"),
    ("huge tensor list", _huge_tensor_list, "manifest.tensors"),
]


@pytest.mark.parametrize(("mutate", "field"), [c[1:] for c in MANIFEST_CASES],
                         ids=[c[0] for c in MANIFEST_CASES])
def test_bad_manifest_names_the_field(mutate: Mutation, field: str) -> None:
    body = wire_of(manifest())
    mutate(body)
    with pytest.raises(ProtocolError) as info:
        decode(pack(body), limits=Limits(max_tensors=1000))
    assert field in str(info.value), str(info.value)


def _collective(**fields: Any) -> Mutation:
    def apply(body: dict[str, Any]) -> None:
        body["collective"] = {**wire_of(manifest(collective=ANNOUNCE))["collective"], **fields}
    return apply


COLLECTIVE_CASES: list[tuple[str, Mutation, str]] = [
    ("unknown backend", _collective(backend="mpi"), "manifest.collective.backend"),
    ("buckets not whole chunks", _collective(bucket_bytes=6000), "manifest.collective"),
    ("huge buckets", _collective(bucket_bytes=1 << 31), "manifest.collective.bucket_bytes"),
    ("no rendezvous port", _collective(store_port=0), "manifest.collective.store_port"),
    ("port out of range", _collective(store_port=70000), "manifest.collective.store_port"),
    ("keepalive above timeout", _collective(keepalive=60.0), "manifest.collective.keepalive"),
    ("negative epoch", _collective(epoch=-1), "manifest.collective.epoch"),
    ("escape in device uuid", _collective(device_uuid="\x1b[2J"),
     "manifest.collective.device_uuid"),
]


@pytest.mark.parametrize(("mutate", "field"), [c[1:] for c in COLLECTIVE_CASES],
                         ids=[c[0] for c in COLLECTIVE_CASES])
def test_bad_collective_announce_names_the_field(mutate: Mutation, field: str) -> None:
    body = wire_of(manifest())
    mutate(body)
    with pytest.raises(ProtocolError) as info:
        decode(pack(body))
    assert field in str(info.value), str(info.value)


@pytest.mark.parametrize(("body", "field"), [
    ({"t": "coll_poll", "req": 1, "subscriber_id": "a", "state": "sleeping", "backend": "gloo"},
     "coll_poll.state"),
    ({"t": "coll_poll", "req": 1, "subscriber_id": "a", "state": "free", "backend": "tcp"},
     "coll_poll.backend"),
    ({"t": "coll_poll", "req": 1, "subscriber_id": "a\x1b", "state": "free",
      "backend": "gloo"}, "coll_poll.subscriber_id"),
    ({"t": "coll_rep", "req": 1, "publisher_id": "p", "started_at": 1.0, "state": "active",
      "rank": 3, "world_size": 3}, "coll_rep.rank"),
    ({"t": "coll_rep", "req": 1, "publisher_id": "p", "started_at": 1.0, "state": "active",
      "rank": 1, "world_size": 100_000}, "coll_rep.world_size"),
    ({"t": "coll_rep", "req": 1, "publisher_id": "p", "started_at": 1.0, "state": "active",
      "ipc": {"version": 1, "device_index": 0, "handle": b"x" * 4096, "storage_bytes": 1,
              "storage_offset": 0, "ref_counter_handle": b"", "ref_counter_offset": 0,
              "event_handle": b"", "event_sync_required": False}}, "coll_rep.ipc.handle"),
    ({"t": "report", "subscriber_id": "a", "staged_version": 1, "applied_version": 1,
      "data_path": "carrier-pigeon"}, "report.data_path"),
])
def test_bad_collective_messages_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(pack({"p": P, **body}))
    assert field in str(info.value), str(info.value)


def test_limits_are_enforced_before_use() -> None:
    body = wire_of(manifest())
    with pytest.raises(ProtocolError, match=r"manifest\.total_bytes"):
        decode(pack(body), limits=Limits(max_total_bytes=4096))
    with pytest.raises(ProtocolError, match=r"manifest\.tensors: 4 tensors, more than 3"):
        decode(pack(body), limits=Limits(max_tensors=3))


def test_oversized_lists_are_refused_at_their_header() -> None:
    """Millions of checksums (or fetch ids) are refused before one element is built."""
    body = wire_of(manifest())
    body["checksums"] = list(range(wire.MAX_CHUNKS + 1))
    with pytest.raises(ProtocolError, match=r"manifest\.checksums: Expected `array` of length"):
        decode(pack(body))


def test_chunk_count_must_match_the_size() -> None:
    """A tiny message claiming billions of chunks is refused on arithmetic alone."""
    body = wire_of(manifest())
    body["total_bytes"] = 1 << 40
    body["tensors"] = []
    with pytest.raises(ProtocolError, match=r"manifest\.checksums: 2 entries, expected \d+"):
        decode(pack(body), limits=Limits(max_total_bytes=1 << 40))


def test_empty_tensor_with_overflowing_shape_is_refused() -> None:
    """(2**40, 2**40, 2**40, 0) has no bytes, but its element count overflows torch's int64."""
    body = wire_of(manifest())
    body["tensors"][2]["shape"] = [1 << 40, 1 << 40, 1 << 40, 0]
    with pytest.raises(ProtocolError, match=r"manifest\.tensors\[2\]\.shape"):
        decode(pack(body))


HEADER_CASES: list[tuple[str, bytes, str]] = [
    ("garbage bytes", b"\xc1\xff\x00garbage", "message"),
    ("empty frame", b"", "message"),
    ("truncated msgpack", pack({"p": P, "t": "latest", "req": 1})[:-2], "message"),
    ("not a map: list", pack([1, "latest"]), "message"),
    ("not a map: int", pack(7), "message"),
    ("not a map: bytes", pack(b"\x00" * 10), "message"),
    ("int map keys", pack({1: 2}), "message"),
    ("old p", pack({"p": 1, "t": "latest", "req": 1}), "latest.p"),
    ("p zero", pack({"p": 0, "t": "latest", "req": 1}), "latest.p"),
    ("bool p", pack({"p": True, "t": "latest", "req": 1}), "latest.p"),
    ("string p", pack({"p": "2", "t": "latest", "req": 1}), "latest.p"),
    ("unknown t", pack({"p": P, "t": "exec", "req": 1}), "message.t"),
    ("missing t", pack({"p": P, "req": 1}), "message.t"),
    ("t not a string", pack({"p": P, "t": 3, "req": 1}), "message.t"),
    ("negative req", pack({"p": P, "t": "latest", "req": -1}), "latest.req"),
    ("bool req", pack({"p": P, "t": "status", "req": False}), "status.req"),
    ("fetch negative chunk",
     pack({"p": P, "t": "fetch", "req": 1, "publisher_id": "x", "version": 1, "chunks": [-1]}),
     "fetch.chunks[0]"),
    ("fetch bool chunk",
     pack({"p": P, "t": "fetch", "req": 1, "publisher_id": "x", "version": 1, "chunks": [True]}),
     "fetch.chunks[0]"),
    ("fetch too many chunks",
     pack({"p": P, "t": "fetch", "req": 1, "publisher_id": "x", "version": 1,
           "chunks": list(range(5000))}), "fetch.chunks"),
    ("fetch chunk past limit",
     pack({"p": P, "t": "fetch", "req": 1, "publisher_id": "x", "version": 1,
           "chunks": [10_000_001]}), "fetch.chunks[0]"),
    ("fetch version zero",
     pack({"p": P, "t": "fetch", "req": 1, "publisher_id": "x", "version": 0, "chunks": [0]}),
     "fetch.version"),
    ("chunk negative size",
     pack({"p": P, "t": "chunk", "req": 1, "version": 1, "chunk": 0, "size": -5}),
     "message.t"),  # protocol 2's msgpack chunk header: chunk replies are binary now
    ("heartbeat zero interval",
     pack({"p": P, "t": "heartbeat", "publisher_id": "x", "started_at": 1.0,
           "latest_version": 1, "sent_at": 1.0, "interval": 0}), "heartbeat.interval"),
    ("error unknown code",
     pack({"p": P, "t": "error", "req": 1, "code": "nope", "message": "", "version": 0}),
     "error.code"),
    ("report control char id",
     pack({"p": P, "t": "report", "subscriber_id": "a\rb", "staged_version": 1,
           "applied_version": 1}), "report.subscriber_id"),
    ("report long error",
     pack({"p": P, "t": "report", "subscriber_id": "a", "staged_version": 1,
           "applied_version": 1, "last_error": "x" * 5000}), "report.last_error"),
    ("report missing field",
     pack({"p": P, "t": "report", "subscriber_id": "a", "staged_version": 1}),
     "report.applied_version"),
    ("report too many ranks",
     pack({"p": P, "t": "report", "subscriber_id": "a", "staged_version": 1,
           "applied_version": 1, "ranks": list(range(2000))}), "report.ranks"),
    ("report negative rank",
     pack({"p": P, "t": "report", "subscriber_id": "a", "staged_version": 1,
           "applied_version": 1, "ranks": [0, -1]}), "report.ranks[1]"),
    ("latest_rep bad manifest",
     pack({"p": P, "t": "latest_rep", "req": 1, "publisher_id": "x", "started_at": 1.0,
           "pub_endpoint": "tcp://h:1", "heartbeat_interval": 1.0, "manifest": [1]}),
     "latest_rep.manifest"),
    ("status_rep many versions",
     pack({"p": P, "t": "status_rep", "req": 1, "publisher_id": "x", "started_at": 1.0,
           "latest_version": 1, "versions": [1] * 5000, "subscribers": []}),
     "status_rep.versions"),
]


@pytest.mark.parametrize(("frame", "field"), [c[1:] for c in HEADER_CASES],
                         ids=[c[0] for c in HEADER_CASES])
def test_bad_frame_names_the_field(frame: bytes, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    message = str(info.value)
    assert message.startswith(field), message


def test_unexpected_type_is_refused() -> None:
    beat = encode(wire.Heartbeat(publisher_id="p", started_at=1.0, latest_version=1,
                                 sent_at=1.0, interval=1.0))
    with pytest.raises(ProtocolError, match=r"message\.t: unexpected 'heartbeat'"):
        decode(beat, expect=(wire.FetchRequest, wire.LatestRequest))


def test_oversized_control_frame_is_refused_before_parsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wire, "MAX_CONTROL_BYTES", 64)
    with pytest.raises(ProtocolError, match=r"^message: \d+ bytes exceeds 64"):
        decode(encode(manifest()))


def test_protocol_error_is_a_weightpub_error() -> None:
    with pytest.raises(WeightPubError):
        decode(b"\xc1")


def test_missing_protocol_version_means_ours() -> None:
    """``p`` may be left out (this version assumed); any other value is refused."""
    assert decode(pack({"t": "latest", "req": 1})) == wire.LatestRequest(req=1)


def test_decode_as_returns_the_one_expected_type() -> None:
    frame = encode(wire.StatusRequest(req=3))
    assert wire.decode_as(frame, wire.StatusRequest).req == 3
    with pytest.raises(ProtocolError, match=r"message\.t: unexpected 'status'"):
        wire.decode_as(frame, wire.StatusReply)


@pytest.mark.parametrize("size", [0, 1, 4095, 256 << 10, (256 << 10) + 1, (1 << 20) + 17])
def test_copy_checksum_places_the_bytes_and_hashes_them_as_one_sweep_would(size: int) -> None:
    """The receiver's one pass (copy a block, hash it while it is in the cache) gives the
    manifest's checksum of the whole chunk, whatever the size against the block."""
    from weightpub_wire.checksums import chunk_checksum, copy_checksum

    src = memoryview(bytes((i * 131 + 7) % 251 for i in range(size)))
    dst = memoryview(bytearray(size + 8))
    assert copy_checksum(dst[:size], src) == chunk_checksum(src)
    assert dst[:size] == src and dst[size:] == bytes(8)  # nothing written past the chunk


@pytest.mark.parametrize("where", ["first", "block_end", "block_start", "last"])
def test_copy_checksum_sees_one_corrupt_byte_on_either_side_of_a_block_boundary(
        where: str) -> None:
    """A byte that arrives changed changes the fused pass's digest wherever it sits against
    the blocks it copies in (the first, the last of a block, the first of the next, the
    chunk's last): the chunk is refused, not staged."""
    from weightpub_wire.checksums import chunk_checksum, copy_checksum

    block, size = 4096, 3 * 4096 + 100
    good = bytes((i * 131 + 7) % 251 for i in range(size))
    at = {"first": 0, "block_end": block - 1, "block_start": block, "last": size - 1}[where]
    bad = bytearray(good)
    bad[at] ^= 0x01
    dst = memoryview(bytearray(size))
    assert copy_checksum(dst, memoryview(bad), block) != chunk_checksum(good)
    assert bytes(dst) == bytes(bad)  # placed as received; the digest is what refuses it
    assert copy_checksum(dst, memoryview(good), block) == chunk_checksum(good)
