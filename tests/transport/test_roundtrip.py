"""Every wire dtype and odd shapes arrive bit-exact in a subscriber in another process."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from publisher import WeightPublisher
from tests.transport.procs import Child, as_bytes, digests, roundtrip_case, scribble
from weightpub_wire.dtypes import DTYPE_BY_NAME

pytestmark = pytest.mark.timeout(90)


def test_every_dtype_and_odd_shapes_cross_processes_bit_exact(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child],
) -> None:
    pub = make_pub(chunk_size=4096)  # small chunks: tensors straddle chunk boundaries
    sub = spawn("subscriber", endpoint=pub.endpoint, verify="roundtrip")
    sub.event("ready", timeout=60)
    for version in (1, 2, 3):
        source, expected, originals = roundtrip_case(version)
        assert pub.publish(source) == version
        # the trainer may overwrite its tensors as soon as publish() returns
        scribble(originals)
        for want, original in zip(expected.values(), originals, strict=True):
            if want.numel():  # the overwrite really changed the caller's tensors
                assert not torch.equal(as_bytes(want), as_bytes(original))
        got = sub.event("staged", timeout=30, version=version)
        assert got["publisher_id"] == pub.publisher_id
        assert got["mismatches"] == [], got["mismatches"]  # torch.equal in the child
        assert got["names"] == list(expected)  # order preserved
        assert got["digests"] == digests(expected.items())  # and checked on this side too
        assert got["shapes"] == {k: list(v.shape) for k, v in expected.items()}
        assert got["dtypes"] == {k: str(v.dtype) for k, v in expected.items()}
    v1_dtypes = set(roundtrip_case(1)[1][f"dtype.{n}"].dtype for n in DTYPE_BY_NAME)
    assert v1_dtypes == set(DTYPE_BY_NAME.values())


def test_overwriting_right_after_publish_in_process(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., object],
) -> None:
    """Same promise, checked on the staged tensors themselves (no digests)."""
    pub = make_pub(chunk_size=4096)
    sub = make_sub(pub.endpoint)
    weights = {"w": torch.arange(10_000, dtype=torch.float32).reshape(100, 100),
               "b": torch.ones(3, dtype=torch.bfloat16)}
    expected = {k: v.clone() for k, v in weights.items()}
    version = pub.publish(weights)
    for tensor in weights.values():
        tensor.fill_(-1)
    staged = sub.wait_for_version(version, timeout=30)
    assert set(staged.tensors) == set(expected)
    for name, want in expected.items():
        assert torch.equal(as_bytes(staged.tensors[name]), as_bytes(want)), name
