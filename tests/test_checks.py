"""Input that is not ours to trust: RPC tensors (one dtype allow-list) and the installed vLLM."""

from __future__ import annotations

import pytest
import torch

from subscriber_ext.vllm_ext.seed.tensor_bytes import decode_one, encode_tensor
from weightpub_wire.dtypes import parse_dtype
from weightpub_wire.errors import ApplyError, ConfigError, ProtocolError


@pytest.mark.parametrize("dtype", ["__class__", "Tensor", "complex64", "torch.nn", 5, None])
def test_rpc_dtypes_come_from_the_one_allow_list(dtype: object) -> None:
    with pytest.raises(ApplyError, match=r"tensor 'w' dtype: "):
        decode_one({"name": "w", "dtype": dtype, "shape": [1], "data": b"\0\0\0\0"})


def test_rpc_tensor_round_trips_and_wrong_sizes_are_named() -> None:
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    name, back = decode_one(encode_tensor("x", t))
    assert name == "x" and torch.equal(back, t)
    with pytest.raises(ApplyError, match=r"tensor 'x': 12 bytes but dtype torch.bfloat16 "
                                         r"shape \(3, 3\) needs 18"):
        decode_one({**encode_tensor("x", t), "shape": [3, 3]})


def test_wire_and_rpc_share_names_and_refuse_alike() -> None:
    assert parse_dtype("torch.float8_e4m3fn") is parse_dtype("float8_e4m3fn")
    assert parse_dtype(torch.int8) is torch.int8
    with pytest.raises(ProtocolError):
        parse_dtype("complex128")
    with pytest.raises(ProtocolError):
        parse_dtype(torch.complex64)


def test_installed_vllm_is_one_we_support() -> None:
    from subscriber_ext.vllm_ext import vllm_compat
    from subscriber_ext.vllm_ext.commit import vllm_patches

    assert vllm_compat.problems() == []
    vllm_patches.install()  # our own patches keep the signatures the check reads
    assert vllm_compat.problems() == []


def test_a_missing_internal_is_named_and_the_override_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from subscriber_ext.vllm_ext import vllm_compat

    fake = vllm_compat.Internal("vllm.v1.engine.core", "EngineCore.no_such_method", None,
                                "a test")
    moved = vllm_compat.Internal("vllm.v1.engine.core", "EngineCore.step", ("self", "extra"),
                                 "a test")
    monkeypatch.setattr(vllm_compat, "INTERNALS", (fake, moved))
    monkeypatch.setattr(vllm_compat, "_checked", None)
    monkeypatch.delenv(vllm_compat.ALLOW_ENV, raising=False)
    with pytest.raises(ConfigError) as info:
        vllm_compat.check_vllm()
    text = str(info.value)
    assert "supports vLLM >=0.32,<0.34" in text
    assert "EngineCore.no_such_method is missing" in text
    assert "EngineCore.step takes ('self',), expected ('self', 'extra')" in text
    assert vllm_compat.ALLOW_ENV in text
    monkeypatch.setenv(vllm_compat.ALLOW_ENV, "1")
    vllm_compat.check_vllm()  # a warning now
    assert "no_such_method" in caplog.text
