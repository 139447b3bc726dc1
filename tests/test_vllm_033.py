"""vLLM 0.33 (a CUDA-only wheel) checked from its sources, and its trainer ``WeightSource`` API.

The wheel is fetched once (``scripts/fetch_vllm_wheel.py``, ``--no-deps``, cached in
``~/.cache/weightpub/wheels``) and read, never installed: every vLLM internal we
patch or call (``vllm_compat.INTERNALS``) and every name our modules import from
vLLM must exist there with the parameters we use; the weight-transfer interfaces
we implement must not have changed. The static reader is itself checked against
the runtime check on the installed vLLM, so a reader bug cannot pass silently.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from publisher import WeightPublisher
from publisher.sources.layer_grouping import layer_runs
from publisher.sources.vllm_sources import FullIterSource, as_grouped
from scripts.fetch_vllm_wheel import fetch_wheel
from subscriber_ext import WeightSubscriber
from subscriber_ext.vllm_ext import vllm_compat
from subscriber_ext.vllm_ext.vllm_sources import (
    SourceTree,
    imported_names,
    internal_problems,
    missing_imports,
)
from weightpub_wire.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
VLLM_033 = "0.33.0"
_BASE = "vllm/distributed/weight_transfer/base.py"


@pytest.fixture(scope="module")
def wheel_033() -> Iterator[SourceTree]:
    tree = SourceTree(fetch_wheel(VLLM_033))
    yield tree
    tree.close()


@pytest.fixture(scope="module")
def installed() -> SourceTree:
    import vllm

    return SourceTree(Path(vllm.__file__).parent.parent)


def _our_vllm_imports() -> set[tuple[str, str]]:
    files = [p for pkg in ("subscriber_ext", "weightpub") for p in (REPO / pkg).rglob("*.py")]
    return imported_names(files)


def test_the_source_reader_agrees_with_the_runtime_check(installed: SourceTree) -> None:
    """On the installed vLLM both say 'fine'; both name a planted gap and a changed signature."""
    assert vllm_compat.problems() == []
    assert internal_problems(installed) == []
    planted = (vllm_compat.Internal("vllm.v1.engine.core", "EngineCore.no_such_method"),
               vllm_compat.Internal("vllm.v1.engine.core", "EngineCore.step", ("self", "x")),
               vllm_compat.Internal("vllm.v1.engine", "EngineCoreRequestType.NO_SUCH"))
    found = internal_problems(installed, planted)
    assert len(found) == 3, found
    assert "EngineCore.no_such_method is missing" in found[0]
    assert "EngineCore.step takes ('self',), expected ('self', 'x')" in found[1]
    assert "NO_SUCH is missing" in found[2]
    assert missing_imports(installed, _our_vllm_imports()) == []
    assert missing_imports(installed, {("vllm.v1.engine.core", "NoSuchThing"),
                                       ("vllm.no_such_module", "")}) == [
        "module vllm.no_such_module is missing", "vllm.v1.engine.core:NoSuchThing is missing"]


def test_every_internal_we_patch_or_call_exists_in_vllm_033(wheel_033: SourceTree) -> None:
    assert internal_problems(wheel_033) == []
    assert missing_imports(wheel_033, _our_vllm_imports()) == []


def test_the_range_we_claim_includes_033_and_patches_are_all_listed() -> None:
    lo, hi = vllm_compat.SUPPORTED_VLLM
    assert lo <= (0, 33) < hi
    listed = {i.qualname for i in vllm_compat.INTERNALS}
    patches = (REPO / "subscriber_ext/vllm_ext/commit/vllm_patches.py").read_text()
    for node in ast.walk(ast.parse(patches)):  # ``EngineCore.x = ...`` and friends
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id in ("EngineCore", "WorkerWrapperBase") \
                        and not target.attr.startswith("weightpub_"):
                    assert f"{target.value.id}.{target.attr}" in listed, target.attr


def _methods(tree: SourceTree, cls: str) -> dict[str, tuple[str, ...]]:
    module = tree.module("vllm.distributed.weight_transfer.base")
    assert module is not None
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {f.name: tuple(a.arg for a in [*f.args.posonlyargs, *f.args.args,
                                                  *f.args.kwonlyargs])
                    for f in node.body if isinstance(f, ast.FunctionDef)}
    raise AssertionError(f"no class {cls}")


def test_the_weight_transfer_interfaces_we_implement_are_unchanged(
        installed: SourceTree, wheel_033: SourceTree) -> None:
    from subscriber_ext.vllm_ext.weight_transfer_backend import WeightpubWeightTransferEngine
    from weightpub.vllm_trainer import WeightpubTrainerEngine

    for cls, ours, allowed in (
            ("WeightTransferEngine", WeightpubWeightTransferEngine, set()),
            # 0.33's trainer engine takes ``rank`` (we set it from the init info ourselves)
            ("TrainerWeightTransferEngine", WeightpubTrainerEngine, {"__init__"})):
        old, new = _methods(installed, cls), _methods(wheel_033, cls)
        for name in vars(ours):
            if name in old and name not in allowed:
                assert new.get(name) == old[name], (cls, name, old[name], new.get(name))


def _load_033_base(tree: SourceTree) -> ModuleType:
    """0.33's ``weight_transfer/base.py`` (pure Python; its vLLM imports exist in 0.32)."""
    text = tree._text(_BASE)
    assert text is not None
    name = "weightpub_test_vllm033_base"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(text, f"vllm-{VLLM_033}/{_BASE}", "exec"), module.__dict__)  # noqa: S102
    return module


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(16, 8)
    model.layers = layers
    model.norm = torch.nn.LayerNorm(8)
    return model


def test_a_vllm_033_module_source_is_published_group_by_group(wheel_033: SourceTree) -> None:
    base = _load_033_base(wheel_033)
    model = _model(0)
    source = base.ModuleSource(model)
    assert not callable(getattr(source, "iter_groups", None))  # the 0.33 API indeed
    grouped = as_grouped(source)
    assert isinstance(grouped, FullIterSource)
    runs = grouped.groups()
    assert runs[0] == ["embed.weight"] and runs[-1] == ["norm.weight", "norm.bias"]
    assert len(runs) == 5  # embed, three layers, norm: one gather group each
    with WeightPublisher("tcp://127.0.0.1:0") as pub, \
            WeightSubscriber(pub.endpoint) as sub:
        for version, seed in ((1, 1), (2, 2)):
            model.load_state_dict(_model(seed).state_dict())
            assert pub.publish(source) == version
            staged = sub.wait_for_version(version, timeout=30)
            want = dict(model.named_parameters())
            assert sorted(staged.tensors) == sorted(want)
            for name, tensor in staged.tensors.items():
                assert torch.equal(tensor, want[name].detach()), name
            staged.release()


def test_a_033_source_that_strays_from_its_metadata_is_named(wheel_033: SourceTree) -> None:
    base = _load_033_base(wheel_033)

    class Shuffled(base.ModuleSource):  # type: ignore[name-defined,misc]
        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            pairs = list(super().iter_full())
            yield from reversed(pairs)

    with pytest.raises(ConfigError, match="out of metadata order"):
        list(as_grouped(Shuffled(_model(0))).iter_groups())


def test_layer_runs_keep_metadata_order() -> None:
    names = ["lm_head.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a",
             "model.norm.weight", "model.layers.2.a"]
    assert layer_runs(names) == [["lm_head.weight"], ["model.layers.0.a", "model.layers.0.b"],
                                 ["model.layers.1.a"], ["model.norm.weight"],
                                 ["model.layers.2.a"]]
