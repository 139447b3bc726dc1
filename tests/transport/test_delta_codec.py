"""The chunk delta codec: every encoding rebuilds the exact bytes, every bad payload is refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard

from tests.transport.procs import det_bytes, det_tensor
from weightpub_wire.delta_codec import (
    HEADER_BYTES,
    decode_chunk,
    encode_chunk,
    payload_encoding,
    version_digest,
)
from weightpub_wire.dtypes import DTYPE_BY_NAME
from weightpub_wire.errors import ProtocolError

pytestmark = pytest.mark.timeout(60)


def rebuild(payload: bytes | None, new: bytes, base: bytes) -> bytes:
    out = bytearray(len(base))
    decode_chunk(memoryview(new if payload is None else payload), memoryview(base),
                 memoryview(out))
    return bytes(out)


def changed(base: bytes, fraction: float, seed: int, width: int = 2) -> bytes:
    """``base`` with about ``fraction`` of its ``width``-byte words changed in the low byte."""
    data = np.frombuffer(bytearray(base), dtype=np.uint8).copy()
    words = data.reshape(-1, width) if len(data) % width == 0 else data.reshape(-1, 1)
    pick = np.frombuffer(det_bytes(seed, len(words) * 2).numpy().tobytes(), dtype="<u2")
    words[pick < int(fraction * 65536), 0] ^= 0x5A
    return data.tobytes()


@pytest.mark.parametrize("dtype_name", sorted(DTYPE_BY_NAME))
def test_every_dtype_round_trips_bit_exact(dtype_name: str) -> None:
    dtype = DTYPE_BY_NAME[dtype_name]
    base_t = det_tensor(3, 1, dtype_name, dtype, (4096,))
    width = base_t.element_size()
    base = base_t.view(torch.uint8).numpy().tobytes()
    for fraction in (0.0, 0.01, 0.3, 0.9):
        new = changed(base, fraction, seed=len(dtype_name), width=width)
        payload = encode_chunk(memoryview(new), memoryview(base), width)
        assert rebuild(payload, new, base) == new, (dtype_name, fraction)
        if fraction == 0.0:
            assert payload_encoding(payload or new, len(new)) == "same"


def test_each_encoding_is_chosen_where_it_is_smallest() -> None:
    base = det_bytes(1, 1 << 20).numpy().tobytes()
    cases = {
        "same": base,
        "sparse": changed(base, 0.02, seed=2),
        "raw": np.random.default_rng(9).bytes(1 << 20),  # unrelated bytes: nothing to gain
    }
    # a dense change in the low byte only: the whole XOR compresses better than indices
    dense = np.frombuffer(bytearray(base), dtype=np.uint8).copy()
    dense[::2] ^= 1
    cases["xor_zstd"] = dense.tobytes()
    for name, new in cases.items():
        payload = encode_chunk(memoryview(new), memoryview(base), 2)
        assert payload_encoding(payload or new, len(new)) == name
        assert payload is None or len(payload) < len(new)
        assert rebuild(payload, new, base) == new, name
    sparse = encode_chunk(memoryview(cases["sparse"]), memoryview(base), 2)
    assert sparse is not None and len(sparse) < 0.05 * len(base)


@pytest.mark.parametrize("span", [4096 + 3, 4096 + 6, 100])
def test_chunks_whose_size_is_not_a_multiple_of_the_word(span: int) -> None:
    base = det_bytes(5, span).numpy().tobytes()
    new = changed(base, 0.05, seed=6, width=1)
    for width in (1, 2, 4, 8):
        payload = encode_chunk(memoryview(new), memoryview(base), width)
        assert rebuild(payload, new, base) == new


def test_in_place_application_of_successive_deltas() -> None:
    """Later steps of a chain are applied onto the staging chunk itself."""
    v0 = det_bytes(7, 65536).numpy().tobytes()
    v1 = changed(v0, 0.01, seed=8)
    v2 = changed(v1, 0.01, seed=9)
    out = bytearray(len(v0))
    view = memoryview(out)
    decode_chunk(memoryview(encode_chunk(memoryview(v1), memoryview(v0)) or v1),
                 memoryview(v0), view)
    decode_chunk(memoryview(encode_chunk(memoryview(v2), memoryview(v1)) or v2), view, view)
    assert bytes(out) == v2


def _header(encoding: int, width: int, count: int) -> bytes:
    return struct.pack("<2sBBI", b"WD", encoding, width, count)


def bad_payloads(span: int) -> dict[str, bytes]:
    zstd = zstandard.ZstdCompressor(write_content_size=True)
    gaps = np.array([5, 0], dtype="<u4")  # second index equals the first: not increasing
    values = np.array([1, 1], dtype="<u2")
    planes = lambda a: np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T)  # noqa: E731
    return {
        "short": b"WD",
        "magic": b"XX" + _header(1, 2, 0)[2:],
        "encoding": _header(9, 2, 0),
        "width": _header(3, 3, 1),
        "count": _header(3, 2, span),  # more words than the chunk has
        "same_with_body": _header(1, 2, 0) + b"x",
        "zstd_garbage": _header(2, 8, 0) + b"\x28\xb5\x2f\xfd" + b"\xff" * 20,
        "zstd_lies_about_size": _header(2, 8, 0) + zstd.compress(bytes(span * 4)),
        "zstd_bomb_header": _header(2, 8, 0) + zstd.compress(bytes(1 << 24))[:64],
        "sparse_not_increasing": _header(3, 2, 2) + zstd.compress(
            planes(gaps).tobytes() + planes(values).tobytes()),
        "sparse_past_the_end": _header(3, 2, 1) + zstd.compress(
            planes(np.array([span], dtype="<u4")).tobytes() + planes(values[:1]).tobytes()),
    }


@pytest.mark.parametrize("case", sorted(bad_payloads(4096)))
def test_hostile_payloads_raise_protocol_error_and_leave_bounded_memory(case: str) -> None:
    span = 4096
    base = det_bytes(1, span).numpy().tobytes()
    out = bytearray(span)
    with pytest.raises(ProtocolError, match="delta chunk"):
        decode_chunk(memoryview(bad_payloads(span)[case]), memoryview(base), memoryview(out))


def test_a_payload_longer_than_the_chunk_is_refused() -> None:
    with pytest.raises(ProtocolError):
        payload_encoding(bytes(HEADER_BYTES + 5000), 4096)


def test_version_digest_names_the_exact_bytes() -> None:
    one = version_digest(8192, 4096, (1, 2))
    assert one == version_digest(8192, 4096, (1, 2))
    assert len({one, version_digest(8192, 4096, (1, 3)), version_digest(8192, 8192, (1, 2)),
                version_digest(8191, 4096, (1, 2))}) == 4
