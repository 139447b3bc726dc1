"""The seed broadcast's packed buckets: both sides derive one layout; bad specs are named."""

from __future__ import annotations

import pytest
import torch

from subscriber_ext.vllm_ext.seed.packing import (
    MARKER,
    layout,
    pack,
    packed_specs,
    parse_specs,
    unpack,
)
from weightpub_wire.errors import ApplyError

pytestmark = pytest.mark.timeout(30)


def named() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [("a", torch.randn(100, 7)), ("b", torch.randint(-5, 5, (3,), dtype=torch.int64)),
            ("scalar", torch.tensor(2.5, dtype=torch.bfloat16)), ("empty", torch.empty(0, 4)),
            ("big", torch.randn(70_000)), ("flag", torch.tensor([True, False])),
            ("last", torch.randn(5, 5).half())]


def test_pack_then_unpack_gives_every_tensor_back_in_few_buckets():
    pairs = named()
    size, specs = parse_specs(packed_specs(pairs, bucket_bytes=1 << 18))
    assert size == 1 << 18 and [s[0] for s in specs] == [n for n, _ in pairs]
    buckets = layout(specs, size)
    assert len(buckets) == 3  # before "big" (280 KB > the 256 KiB bucket), big alone, the rest
    assert [p.name for p in buckets[1].tensors] == ["big"]
    out = {}
    for bucket in buckets:
        buffer = pack(bucket, dict(pairs), torch.device("cpu"))
        assert all(p.offset % 64 == 0 for p in bucket.tensors)
        out.update(unpack(bucket, buffer.clone()))
    for name, tensor in pairs:
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name


def test_a_list_without_the_marker_is_the_seed_protocol():
    size, specs = parse_specs([("w", "torch.float32", [2, 3]), ("b", "bfloat16", (4,))])
    assert size is None and specs[0][1] == torch.float32 and specs[1][2] == (4,)


@pytest.mark.parametrize(("params", "message"), [
    ([(MARKER, "uint8", [12])], "bucket_bytes"),
    ([(MARKER, "uint8", "big")], "bucket_bytes"),
    ([("w", "complex128", [2])], "tensor 'w' dtype"),
    ([("w", "__class__", [2])], "tensor 'w' dtype"),
    ([("w", "float32", [-1])], "tensor 'w': shape"),
    ([("w", "float32", [1] * 9)], "tensor 'w': shape"),
    ([("w", "float32")], "params_list[0]"),
    ([("", "float32", [1])], "params_list[0]: name"),
])
def test_bad_specs_are_refused_naming_the_tensor(params, message):
    with pytest.raises(ApplyError, match=message.replace("[", r"\[")):
        parse_specs(params)


def test_a_tensor_that_differs_from_its_spec_is_refused_when_packing():
    pairs = named()
    _, specs = parse_specs(packed_specs(pairs))
    with pytest.raises(ApplyError, match="tensor 'a'"):
        pack(layout(specs, 1 << 20)[0], {**dict(pairs), "a": torch.randn(7, 100)},
             torch.device("cpu"))
