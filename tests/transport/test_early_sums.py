"""Early announcement (issue 29, ``announce_early``): the manifest before the hashes, the
checksums after it over the ROUTER, real processes and sockets.

What must hold: versions come bit-exact over the stream and over frames although every
byte lands before its sum (the publisher's hashes wait on a gate file here, so the
order is forced, not timed), and nothing is staged until every sum came and matched; a
corrupt chunk is caught when its sum arrives and fetched again as a frame; a publisher
killed -9 while the sums are out stages nothing; a subscriber that predates early sums
(the release before them, run from git) refuses the early manifest naming its
``checksum_algorithm`` and takes the complete one once it is announced, and a new
subscriber follows an old publisher as before. The new message and manifest rules are
bounded and named.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests.transport.data_path_cases import CHUNK
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError
from weightpub_wire.sum_messages import (
    MAX_SUMS_PER_REPLY,
    SUM_REPLIES,
    SUM_REQUESTS,
    ChunkSums,
    ChunkSumsReply,
)

pytestmark = pytest.mark.timeout(120)

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
