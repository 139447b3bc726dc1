"""The chunk size a publisher picks per version when none is set (issue 22.5).

Pure functions and option objects only: no sockets, no threads.
"""

from __future__ import annotations

import pytest

from publisher.publisher_config import PublisherConfig
from publisher.publisher_options import PublisherOptions
from publisher.store.chunk_sizing import (
    LARGEST,
    MIN_CHUNKS,
    SMALLEST,
    adaptive_chunk_size,
    chunk_size_for,
)
from weightpub_wire.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(("total", "chunk"), [
    (0, 256 * KiB),
    (1, 256 * KiB),
    (16 * MiB, 256 * KiB),  # fewer than 64 chunks rather than chunks under 256 KiB
    (32 * MiB, 512 * KiB),
    (48 * MiB, 512 * KiB),  # the fleet benchmark's version: 96 chunks (4 MiB gave 12)
    (63 * MiB, 512 * KiB),  # 1 MiB would be 63 chunks
    (63 * MiB + 1, 1 * MiB),  # 64 chunks, the last one a byte
    (64 * MiB, 1 * MiB),
    (128 * MiB, 2 * MiB),
    (256 * MiB, 4 * MiB),
    (1 * GiB, 4 * MiB),
    (16 * GiB, 4 * MiB),  # an 8B model in bf16: the old fixed size
])
def test_the_chunk_follows_the_version_size(total: int, chunk: int) -> None:
    assert adaptive_chunk_size(total) == chunk


def test_every_size_is_a_bounded_power_of_two_with_enough_chunks() -> None:
    previous = 0
    for total in [*range(0, 8 * MiB, 99_991), *range(8 * MiB, 2 * GiB, 7 * MiB + 13)]:
        chunk = adaptive_chunk_size(total)
        assert SMALLEST <= chunk <= LARGEST and chunk & (chunk - 1) == 0
        assert (64 << 20) % chunk == 0  # whole chunks in the default collective bucket
        if chunk < LARGEST and total >= MIN_CHUNKS * SMALLEST:
            assert -(-total // chunk) >= MIN_CHUNKS
        if chunk > SMALLEST:  # the largest that still gives MIN_CHUNKS: twice would not
            assert -(-total // (2 * chunk)) < MIN_CHUNKS or chunk == LARGEST
        assert chunk >= previous  # a larger version never gets a smaller chunk
        previous = chunk


def test_an_explicit_chunk_size_is_kept_whatever_the_version() -> None:
    assert chunk_size_for(4096, 1 * GiB) == 4096
    assert chunk_size_for(8 * MiB, 48 * MiB) == 8 * MiB
    assert chunk_size_for(None, 48 * MiB) == 512 * KiB
    with pytest.raises(ValueError, match="negative"):
        adaptive_chunk_size(-1)


def test_options_default_to_adaptive_and_keep_an_explicit_size() -> None:
    assert PublisherOptions().chunk_size is None
    assert PublisherOptions().chunk_size_for(48 * MiB) == 512 * KiB
    explicit = PublisherOptions.from_keywords(chunk_size=4 * MiB)
    assert explicit.chunk_size_for(48 * MiB) == 4 * MiB
    with pytest.raises(ConfigError, match="chunk_size"):
        PublisherOptions(chunk_size=True)  # type: ignore[arg-type]


def test_yaml_chunk_mib_zero_is_adaptive_and_the_default() -> None:
    default = PublisherConfig(endpoint="tcp://127.0.0.1:1")
    assert default.chunk_size is None and default.options().chunk_size is None
    assert PublisherConfig(endpoint="tcp://127.0.0.1:1", chunk_mib=0).chunk_size is None
    assert PublisherConfig(endpoint="tcp://127.0.0.1:1", chunk_mib=1).options()\
        .chunk_size == 1 * MiB


def test_collective_buckets_must_hold_whole_chunks_of_any_adaptive_size() -> None:
    # adaptive chunks go up to 4 MiB: a bucket must be a multiple of that
    PublisherOptions.from_keywords(collective="gloo", collective_bucket_bytes=8 * MiB)
    with pytest.raises(ConfigError, match="largest chunk chosen per version"):
        PublisherOptions.from_keywords(collective="gloo", collective_bucket_bytes=2 * MiB)
    # an explicit chunk keeps its own rule
    PublisherOptions.from_keywords(collective="gloo", chunk_size=1 * MiB,
                                   collective_bucket_bytes=2 * MiB)
    with pytest.raises(ValueError, match="largest chunk chosen per version"):
        PublisherConfig(endpoint="tcp://127.0.0.1:1", collective="gloo",
                        collective_bucket_mib=6)
    PublisherConfig(endpoint="tcp://127.0.0.1:1", collective="gloo", collective_bucket_mib=6,
                    chunk_mib=2)
