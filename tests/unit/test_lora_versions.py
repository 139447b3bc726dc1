"""LoRA adapter versions without an engine: the manifest's ``adapters`` field is checked
and bounded as a peer sends it; the publisher ships only adapter tensors, every adapter's
newest, and refuses to mix adapters with model weights."""

from __future__ import annotations

import msgspec
import pytest
import torch

from publisher import AdapterSpec, ConfigError, WeightPublisher
from publisher.adapters import adapter_tensors
from weightpub_wire import protocol as wire
from weightpub_wire.adapters import AdapterInfo
from weightpub_wire.errors import ProtocolError

A = "a/base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "a/base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def frame(**adapter_changes) -> dict:
    size = 8 * 16 * 4
    manifest = wire.Manifest(
        publisher_id="p" * 8, started_at=1.0, version=1, created_at=2.0, chunk_size=4096,
        total_bytes=2 * size, checksums=(0,),
        tensors=(wire.TensorEntry(A, "float32", (8, 16), 0, size),
                 wire.TensorEntry(B, "float32", (16, 8), size, size)),
        adapters=(AdapterInfo(name="a", rank=8, alpha=16.0,
                                   target_modules=("q_proj",)),))
    raw = msgspec.msgpack.decode(wire.encode(manifest))
    raw["adapters"][0].update(adapter_changes)
    return raw


def decode(raw: dict) -> wire.Manifest:
    return wire.decode_as(msgspec.msgpack.encode(raw), wire.Manifest)


def test_a_good_adapter_manifest_round_trips() -> None:
    manifest = decode(frame())
    assert manifest.adapters is not None and manifest.adapters[0].scale == 2.0


@pytest.mark.parametrize(("changes", "field"), [
    ({"rank": 0}, "rank"), ({"rank": 1 << 20}, "rank"), ({"alpha": float("nan")}, "alpha"),
    ({"alpha": -1.0}, "alpha"), ({"name": "a b"}, "name"), ({"name": "x" * 200}, "name"),
    ({"target_modules": []}, "target_modules"),
    ({"target_modules": ["m"] * 1000}, "target_modules"),
])
def test_bad_adapter_fields_are_refused_by_name(changes: dict, field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        decode(frame(**changes))


def test_tensors_must_belong_to_a_listed_adapter() -> None:
    raw = frame(name="b")  # the tensors say "a/"
    with pytest.raises(ProtocolError, match="names no listed adapter"):
        decode(raw)
    raw = frame()
    raw["tensors"][0]["name"] = "a/model.layers.0.self_attn.q_proj.weight"  # not LoRA
    with pytest.raises(ProtocolError, match="lora_A/lora_B"):
        decode(raw)
    raw = frame()
    raw["adapters"].append(dict(raw["adapters"][0], name="empty"))
    with pytest.raises(ProtocolError, match="no tensors"):
        decode(raw)
    raw = frame()
    raw["adapters"].append(dict(raw["adapters"][0]))
    with pytest.raises(ProtocolError, match="duplicate"):
        decode(raw)


def peft_model_state(seed: int) -> dict[str, torch.Tensor]:
    """How a PEFT model names its state in memory: base weights too, adapter ``default``."""
    torch.manual_seed(seed)
    p = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{p}.base_layer.weight": torch.randn(64, 64),
            f"{p}.lora_A.default.weight": torch.randn(4, 64),
            f"{p}.lora_B.default.weight": torch.randn(64, 4)}


def test_publisher_ships_each_adapters_newest_tensors_only() -> None:
    spec_a = AdapterSpec.from_peft("a", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    spec_b = AdapterSpec(name="b", rank=4, alpha=8.0, target_modules=("q_proj",))
    assert set(adapter_tensors(peft_model_state(0))) == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"}
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        first = peft_model_state(1)
        v1 = pub.publish(first, adapter=spec_a)
        pub.wait_announced(v1)
        assert pub.manifest(v1).total_bytes == 2 * 64 * 4 * 4  # not the 16 KiB base weight
        first["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] += 1
        v2 = pub.publish(peft_model_state(2), adapter=spec_b)
        pub.wait_announced(v2)
        manifest = pub.manifest(v2)
        assert [a.name for a in manifest.adapters or ()] == ["a", "b"]
        assert manifest.total_bytes == 2 * 2 * 64 * 4 * 4
        with pytest.raises(ConfigError, match="serves LoRA adapters"):
            pub.publish({"w": torch.zeros(4)})
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        pub.publish({"w": torch.zeros(4)})
        with pytest.raises(ConfigError, match="serves model weights"):
            pub.publish(peft_model_state(0), adapter=spec_a)


def test_adapter_spec_is_checked_before_anything_is_sent() -> None:
    with pytest.raises(ConfigError, match="rank"):
        AdapterSpec(name="a", rank=0, alpha=8.0, target_modules=("q_proj",)).info()
    with pytest.raises(ConfigError, match="regex"):
        AdapterSpec.from_peft("a", {"r": 4, "target_modules": ".*proj"})
    with pytest.raises(ConfigError, match="no lora_A"):
        adapter_tensors({"model.w": torch.zeros(2)})


class PeftLike(torch.nn.Module):
    """A PEFT model's shape as the callback sees it: ``peft_config`` and ``.default.``
    names beside the frozen base weight (peft itself is not a dependency)."""

    def __init__(self) -> None:
        super().__init__()
        self.peft_config = {"default": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}}
        self.active_adapter = "default"
        for name, tensor in peft_model_state(3).items():
            self.register_buffer(name.replace(".", "_"), tensor)

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        return peft_model_state(3)


def test_publish_callback_publishes_only_the_adapter() -> None:
    from types import SimpleNamespace

    from publisher import PublishCallback

    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        callback = PublishCallback(pub, every_n_steps=1, adapter="policy")
        state = SimpleNamespace(global_step=1, is_world_process_zero=True)
        callback.on_step_end(None, state, None, model=PeftLike())
        (_, version), = callback.published
        pub.wait_announced(version)
        manifest = pub.manifest(version)
        assert manifest.adapters is not None and manifest.adapters[0].name == "policy"
        assert manifest.adapters[0].rank == 4 and manifest.adapters[0].alpha == 8.0
        assert {t.name for t in manifest.tensors} == {
            "policy/base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "policy/base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"}


def test_a_node_shared_view_is_recognised_as_adapters() -> None:
    """Node staging hands followers (and, at TP>1, the owner) a ``SharedView``: it must
    carry the manifest, or an adapter version reaches the applier as model weights."""
    from subscriber_ext.transport.staging.assembly import SharedView
    from subscriber_ext.vllm_ext.commit.coordinator import is_adapters
    from subscriber_ext.vllm_ext.lora import adapter_version

    manifest = decode(frame())
    staged_a, staged_b = torch.ones(8, 16), torch.ones(16, 8)
    view = SharedView(manifest, {A: staged_a, B: staged_b}, lambda: None)
    assert is_adapters(view)
    (held,) = adapter_version(view) or ()
    assert held.info.name == "a" and held.version == 1
    assert set(held.tensors) == {A.removeprefix("a/"), B.removeprefix("a/")}
    staged_a.zero_()  # the staging buffer is reused after the commit: the adapter kept a copy
    assert held.tensors[A.removeprefix("a/")].sum() == 8 * 16
