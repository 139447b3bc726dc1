"""A publisher given no chunk size cuts each version by its size; subscribers follow.

Issue 22.5: the chunk size is chosen per version (``publisher.store.chunk_sizing``) and
carried by its manifest, so versions of different sizes from one publisher have
different chunks, arrive bit-exact, and consecutive versions of one size still
chain as deltas. An explicit ``chunk_size`` is kept whatever the size.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from publisher import WeightPublisher
from publisher.store.chunk_sizing import adaptive_chunk_size
from subscriber_ext import WeightSubscriber
from tests.transport.procs import as_bytes

pytestmark = pytest.mark.timeout(120)

KiB, MiB = 1 << 10, 1 << 20


def _weights(nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    """Two bf16 tensors of ``nbytes`` in all (the second one odd-sized)."""
    gen = torch.Generator().manual_seed(seed)
    first = nbytes // 2 // 2 * 2
    return {"a": torch.randn(first // 2, generator=gen).to(torch.bfloat16),
            "b": torch.randn((nbytes - first) // 2 - 7, generator=gen).to(torch.bfloat16)}


def test_each_version_gets_the_chunk_of_its_size_and_arrives_bit_exact(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(delta_anchor_every=4)
    assert pub.chunk_size is None  # nothing set: chosen per version
    sub = make_sub(pub.endpoint)
    # 4 MiB: 256 KiB chunks (16); 40 MiB: 512 KiB (80); 40 MiB again: a delta on top
    plan = [(4 * MiB, 256 * KiB), (40 * MiB, 512 * KiB), (40 * MiB, 512 * KiB)]
    for number, (nbytes, chunk) in enumerate(plan, start=1):
        weights = _weights(nbytes, seed=number)
        assert pub.publish(weights) == number
        staged = sub.wait_for_version(number, timeout=60)
        manifest = pub.manifest(number)
        assert manifest.chunk_size == chunk == adaptive_chunk_size(manifest.total_bytes)
        assert staged.manifest.chunk_size == chunk
        assert manifest.num_chunks >= 16
        for name, tensor in weights.items():
            assert torch.equal(as_bytes(staged.tensors[name]), as_bytes(tensor)), name
        staged.release()
    # same size, same chunk: the third version chained onto the second as a delta
    assert pub.manifest(3).delta is not None
    assert sub.status()["versions_delta"] == 1


def test_an_explicit_chunk_size_is_kept_for_every_version(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    pub = make_pub(chunk_size=4 * MiB)
    assert pub.chunk_size == 4 * MiB
    sub = make_sub(pub.endpoint)
    for number, nbytes in enumerate((1 * MiB, 24 * MiB), start=1):
        weights = _weights(nbytes, seed=number)
        pub.publish(weights)
        staged = sub.wait_for_version(number, timeout=60)
        assert pub.manifest(number).chunk_size == 4 * MiB
        assert torch.equal(as_bytes(staged.tensors["b"]), as_bytes(weights["b"]))
        staged.release()
