"""The plugin's one switch and vLLM's backend registry (no engine is started)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from subscriber_ext.vllm_ext.commit import vllm_plugin
from weightpub_wire.errors import ConfigError

if TYPE_CHECKING:  # vLLM is imported by the tests that run, not at collection (7 s a worker)
    from vllm.engine.arg_utils import EngineArgs


@pytest.fixture(autouse=True, scope="module")
def _first_plugin_load_asks() -> None:
    """``EngineArgs()`` loads vLLM's plugins, once per process (forked engine cores
    inherit the decision): make that first load an asking one, so engines built
    later in this test process still get weightpub's hooks."""
    from vllm.plugins import load_general_plugins

    old = os.environ.get(vllm_plugin.FORCE_ENV)
    os.environ[vllm_plugin.FORCE_ENV] = "1"
    try:
        load_general_plugins()
    finally:
        if old is None:
            os.environ.pop(vllm_plugin.FORCE_ENV, None)
        else:
            os.environ[vllm_plugin.FORCE_ENV] = old


def test_backends_register_once_and_a_second_registration_is_refused() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    vllm_plugin.ensure_backends()
    assert vllm_plugin.ensure_backends() is False  # the plugin is idempotent
    with pytest.raises(ConfigError, match="already registered"):
        vllm_plugin.register_backends()
    receiver = WeightTransferEngineFactory._registry["weightpub"]()
    trainer = WeightTransferTrainerFactory._registry["weightpub"]()
    assert receiver.__name__ == "WeightpubWeightTransferEngine"
    assert trainer.__name__ == "WeightpubTrainerEngine"


def _args(**kw: object) -> EngineArgs:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model="/nonexistent", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw, asked", [
    ({}, False),
    ({"weight_transfer_config": {"backend": "nccl"}}, False),
    ({"additional_config": {"other": 1}}, False),
    ({"worker_extension_cls": "mypkg.Ext"}, False),
    ({"weight_transfer_config": {"backend": "weightpub"}}, True),
    ({"additional_config": {"weightpub": {"endpoint": "tcp://127.0.0.1:1"}}}, True),
    ({"worker_extension_cls": "subscriber_ext.worker_extension.BatchWeightSyncWorkerExtension"},
     True),
])
def test_an_engine_asks_for_weightpub_in_one_of_three_ways(kw: dict, asked: bool) -> None:
    args = _args(**kw)
    assert vllm_plugin.wants_weightpub(args) is asked
    assert vllm_plugin.uses_backend(args) is (kw.get("weight_transfer_config") ==
                                              {"backend": "weightpub"})


def test_the_config_being_built_is_found_up_the_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.FORCE_ENV, raising=False)

    def load_plugins() -> bool:  # stands where vLLM's load_general_plugins stands
        return vllm_plugin.asked_here(argv=[])

    def build(self: EngineArgs) -> bool:
        return load_plugins()

    assert build(_args(weight_transfer_config={"backend": "weightpub"})) is True
    assert build(_args()) is False
    monkeypatch.setenv(vllm_plugin.FORCE_ENV, "1")
    assert build(_args()) is True
    monkeypatch.setenv(vllm_plugin.FORCE_ENV, "0")
    assert build(_args(weight_transfer_config={"backend": "weightpub"})) is False


@pytest.mark.parametrize("argv, asked", [
    (["serve", "m"], False),
    (["serve", "m", "--weight-transfer-config", '{"backend": "weightpub"}'], True),
    (["serve", "m", '--weight-transfer-config={"backend":"nccl"}'], False),
    (["serve", "m", "--additional-config", '{"weightpub": {"endpoint": "x"}}'], True),
    (["serve", "m", "--worker-extension-cls=subscriber_ext.vllm_ext.worker_extension.X"], True),
    (["serve", "weightpub-model-name"], False),  # a path or name is not a flag
])
def test_a_serve_command_line_asks_only_through_the_flags(argv: list[str], asked: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.FORCE_ENV, raising=False)
    assert vllm_plugin._argv_asks(argv) is asked


def test_update_info_is_checked_before_any_wait() -> None:
    from subscriber_ext.vllm_ext.weight_transfer_backend import (
        WeightpubInitInfo,
        WeightpubUpdateInfo,
    )

    assert WeightpubUpdateInfo(version=3).timeout > 0
    for bad in ({"version": 0}, {"version": "3"}, {"version": True},
                {"version": 2, "timeout": 0}):
        with pytest.raises(ConfigError, match="update_info"):
            WeightpubUpdateInfo(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="options"):
        WeightpubInitInfo(endpoint="tcp://127.0.0.1:1", options=[])  # type: ignore[arg-type]


def test_the_vllm_backend_checks_init_info_options_by_their_declaration(tmp_path: Path,
                                                                        monkeypatch) -> None:
    """vLLM builds ``WeightpubInitInfo`` from the request's JSON in every worker: a bad
    option, or a code name, fails there, named, before anything is subscribed."""
    from subscriber_ext.vllm_ext import weight_transfer_backend as backend

    marker = tmp_path / "imported"
    (tmp_path / "weightpub_probe_module2.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    endpoint = "tcp://127.0.0.1:5999"
    with pytest.raises(ConfigError, match="subscriber_cls: Python only"):
        backend.WeightpubInitInfo(endpoint=endpoint,
                                  options={"subscriber_cls": "weightpub_probe_module2:x"})
    assert not marker.exists()
    with pytest.raises(ConfigError, match=r"init_info.options: chunks_per_request: Input "):
        backend.WeightpubInitInfo(endpoint=endpoint, options={"chunks_per_request": 0})
    with pytest.raises(ConfigError, match=r"init_info.options: request_timeout: Input "):
        backend.WeightpubInitInfo(endpoint=endpoint, options={"request_timeout": -1})
    with pytest.raises(ConfigError, match="unknown option"):
        backend.WeightpubInitInfo(endpoint=endpoint, options={"request_timout": 1.0})
    assert backend.WeightpubInitInfo(endpoint=endpoint, options={"keep": 3}).options == \
        {"keep": 3}
