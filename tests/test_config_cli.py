"""Config files, the command line and the relay: real files, real processes, real sockets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.procs import wait_until
from weightpub.cli import main
from weightpub.deployment_config import (
    PublisherConfig,
    RelayConfig,
    ReplicaConfig,
    load_config,
    load_relay_config,
    load_replica_config,
)
from weightpub.relay import Relay
from weightpub.replica import replica_command
from weightpub_wire.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize(("name", "kind"), [("publisher.yaml", PublisherConfig),
                                            ("replica.yaml", ReplicaConfig),
                                            ("relay.yaml", RelayConfig)])
def test_shipped_configs_load(name, kind):
    assert isinstance(load_config(CONFIGS / name), kind)


@pytest.mark.parametrize(("text", "expected"), [
    ("publisher:\n  endpoint: tcp://h:1\n  keep_versions: 0\n", "publisher.keep_versions"),
    ("publisher:\n  endpoint: udp://h:1\n", "scheme 'udp'"),
    ("publisher:\n  endpoint: tcp://h:1\n  colour: red\n", "publisher.colour"),
    ("replica:\n  model: m\n  subscriber: {endpoint: 'tcp://h:1', window_mib: -1}\n",
     "replica.subscriber.window_mib"),
    ("replica:\n  model: m\n  apply_mode: sometimes\n  subscriber: {endpoint: 'tcp://h:1'}\n",
     "replica.apply_mode"),
    ("replica:\n  model: m\n  subscriber: {endpoint: 'tcp://h:1', staging_budget_bytes: 0}\n",
     "replica.subscriber.staging_budget_bytes"),
    ("replica:\n  model: m\n  node_staging: perhaps\n  subscriber: {endpoint: 'tcp://h:1'}\n",
     "replica.node_staging"),
    ("publisher:\n  endpoint: tcp://h:1\n  collective: mpi\n",
     "publisher.collective: Input should be"),
    ("publisher:\n  endpoint: tcp://h:1\n  chunk_mib: 4\n  collective: gloo\n"
     "  collective_bucket_mib: 6\n",
     "collective_bucket_bytes: 6291456 must be a multiple of chunk_size 4194304"),
    ("replica:\n  model: m\n  subscriber: {endpoint: 'tcp://h:1', chunks_per_request: 0}\n",
     "replica.subscriber.chunks_per_request: Input should be greater than or equal to 1"),
    ("replica:\n  model: m\n  subscriber: {endpoint: 'tcp://h:1', request_timeout: -1}\n",
     "replica.subscriber.request_timeout: Input should be greater than 0"),
    ("replica:\n  model: m\n  subscriber: {endpoint: 'tcp://h:1', window_mib: '8'}\n",
     "replica.subscriber.window_mib: Input should be a valid integer"),
    ("publisher:\n  endpoint: tcp://h:1\n  limits: {}\n", "limits: Python only"),
    ("publisher:\n  endpoint: tcp://h:1\n  collective_timeout: 0\n",
     "publisher.collective_timeout"),
    ("replica:\n  model: m\n  subscriber: {endpoint: 'tcp://h:1', collective: maybe}\n",
     "replica.subscriber.collective"),
    ("replica:\n  model: m\n  subscriber: {endpoint: 'tcp://h:1', upload_mbit: 100}\n",
     "upload_mbit: only with peer_share=True"),
    ("publisher:\n  endpoint: tcp://h:1\n  peer_fanout: 17\n", "publisher.peer_fanout"),
    ("publisher:\n  endpoint: tcp://h:1\n  sharding: {coordinator: 'tcp://h:2'}\n",
     "publisher.sharding.announce_endpoint"),
    ("publisher:\n  endpoint: tcp://h:1\n  sharding: {coordinator: 'ipc:x', "
     "announce_endpoint: 'tcp://h:3', shard_timeout: 0}\n", "publisher.sharding.shard_timeout"),
    ("nonsense: {}\n", "unknown top-level key 'nonsense'"),
    ("publisher: [unclosed\n", "not valid YAML"),
])
def test_bad_config_names_the_key(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert expected in str(err.value)
    assert str(path) in str(err.value)


def test_check_config_cli_reports_error_without_traceback(tmp_path):
    """The one real ``python -m weightpub`` process of this module (exit code, stderr);
    the other commands run ``main`` in process."""
    path = tmp_path / "bad.yaml"
    path.write_text("relay:\n  upstream: {endpoint: 'tcp://h:1'}\n")
    run = subprocess.run([sys.executable, "-m", "weightpub", "check-config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "relay.downstream" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.timeout(60)
def test_status_cli_lists_versions_and_subscribers(capsys):
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        version = pub.publish({"w": torch.ones(8)})
        with WeightSubscriber(pub.endpoint, report_interval=0.2) as sub:
            sub.wait_for_version(version, timeout=20)
            pub.wait_for_subscribers(version, 1, applied=False, timeout=20)
            code = main(["status", pub.endpoint, "--json"])
    run = capsys.readouterr()
    assert code == 0, run.err
    status = json.loads(run.out)
    assert status["latest_version"] == version
    assert [s["staged_version"] for s in status["subscribers"]] == [version]


@pytest.mark.timeout(60)
def test_status_watch_redraws_the_fleet_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        version = pub.publish({"w": torch.ones(8)})
        with WeightSubscriber(pub.endpoint, report_interval=0.2, subscriber_id="replica-a") as sub:
            sub.wait_for_version(version, timeout=20)
            sub.mark_applied(0, "boom \x1b[2J\x1b]0;pwned\x07")  # error text is free-form
            wait_until(lambda: any(r.last_error for r in pub.fleet()), 20, "the error report")
            code = main(["status", pub.endpoint, "--watch", "--count", "3",
                         "--interval", "0.1"])
    run = capsys.readouterr()
    assert code == 0, run.err
    assert run.out.count("latest version 1") >= 1
    assert "subscriber" in run.out and "lag" in run.out
    assert "replica-a" in run.out and "boom" in run.out
    assert "\x1b[2J" not in run.out and "\x1b]0" not in run.out  # escapes stripped


def test_subscriber_id_with_control_characters_is_refused_at_once():
    with pytest.raises(ConfigError, match="subscriber_id"):
        WeightSubscriber("tcp://127.0.0.1:9", subscriber_id="a\x1b[2Jb")


def test_status_cli_times_out_cleanly(capsys):
    assert main(["status", "tcp://127.0.0.1:9", "--timeout", "0.5"]) == 2
    assert "no status reply" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_relay_forwards_versions_bit_exact():
    upstream_cfg = {"endpoint": "tcp://127.0.0.1:0"}
    with WeightPublisher(upstream_cfg["endpoint"]) as trainer:
        config = RelayConfig.model_validate({
            "upstream": {"endpoint": trainer.endpoint},
            "downstream": {"endpoint": "tcp://127.0.0.1:0"},
        })
        with Relay(config) as relay, WeightSubscriber(relay.endpoint) as replica:
            for step in range(3):
                weights = {"w": torch.randn(256, 256), "step": torch.tensor(step)}
                version = trainer.publish(weights)
                staged = replica.wait_for_version(version, timeout=20)
                assert torch.equal(staged.tensors["w"], weights["w"])
                assert int(staged.tensors["step"]) == step


def test_replica_command_carries_endpoint_in_additional_config():
    config = load_replica_config(CONFIGS / "replica.yaml")
    argv = replica_command(config)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    assert extra["weightpub"]["endpoint"] == config.subscriber.endpoint
    assert "node_staging" not in extra["weightpub"]  # the replica decides (on when TP > 1)
    assert "receive" not in extra["weightpub"]  # the replica decides (slices at TP > 1)
    assert "staging_budget_bytes" not in extra["weightpub"]  # derived by the replica
    assert "prepare_budget_bytes" not in extra["weightpub"]  # the replica's default: 0
    assert "--worker-extension-cls" in argv


def test_staging_budget_and_node_staging_reach_the_replica_command():
    replica = ReplicaConfig.model_validate({
        "model": "m", "node_staging": False, "prepare_budget_bytes": 1 << 30,
        "receive": "whole",
        "subscriber": {"endpoint": "tcp://h:1", "staging_budget_bytes": 3 << 30}})
    argv = replica_command(replica)
    extra = json.loads(argv[argv.index("--additional-config") + 1])["weightpub"]
    assert extra["staging_budget_bytes"] == 3 << 30
    assert extra["prepare_budget_bytes"] == 1 << 30
    assert extra["node_staging"] is False
    assert extra["receive"] == "whole"
    assert "collective" not in extra
    collective = ReplicaConfig.model_validate({
        "model": "m", "subscriber": {"endpoint": "tcp://h:1", "collective": True}})
    argv = replica_command(collective)
    assert json.loads(argv[argv.index("--additional-config") + 1])["weightpub"]["collective"]


@pytest.mark.timeout(60)
def test_collective_publisher_from_yaml_announces_its_path(tmp_path):
    path = tmp_path / "publisher.yaml"
    path.write_text("publisher:\n  endpoint: tcp://127.0.0.1:0\n  collective: gloo\n"
                    "  collective_bucket_mib: 8\n  collective_timeout: 12\n")
    with WeightPublisher.from_config(path) as pub:
        pub.wait_announced(pub.publish({"w": torch.arange(5)}), timeout=20)
        announce = pub.manifest().collective
        assert announce is not None and announce.backend == "gloo"
        assert (announce.bucket_bytes, announce.timeout) == (8 << 20, 12.0)
        assert announce.store_port > 0 and pub.collective_status().state == "idle"


@pytest.mark.timeout(60)
def test_publisher_from_yaml_and_curve_keys_reach_the_replica_command(tmp_path):
    from weightpub_wire.keys import create_key_pair

    public, secret = (str(p) for p in create_key_pair(tmp_path, "server"))
    path = tmp_path / "publisher.yaml"
    path.write_text("publisher:\n  endpoint: tcp://127.0.0.1:0\n  keep_versions: 3\n"
                    f"  curve_secret_key_file: {secret}\n")
    with WeightPublisher.from_config(path) as pub:
        version = pub.publish({"w": torch.arange(5)})
        with WeightSubscriber(pub.endpoint, curve_server_key_file=public) as sub:
            assert torch.equal(sub.wait_for_version(version, timeout=20).tensors["w"],
                               torch.arange(5))
    replica = ReplicaConfig.model_validate({
        "model": "m", "subscriber": {"endpoint": "tcp://h:1", "curve_server_key_file": public}})
    argv = replica_command(replica)
    extra = json.loads(argv[argv.index("--additional-config") + 1])["weightpub"]
    assert extra["curve_server_key_file"] == public
    assert "max_version_bytes" not in extra  # default: derived from this machine's memory


@pytest.mark.timeout(60)
def test_peer_share_from_yaml_reaches_the_replica_and_the_subscriber():
    replica = ReplicaConfig.model_validate({"model": "m", "subscriber": {
        "endpoint": "tcp://127.0.0.1:1", "peer_share": True, "upload_mbit": 200,
        "upload_cpu_share": 0.1}})
    argv = replica_command(replica)
    extra = json.loads(argv[argv.index("--additional-config") + 1])["weightpub"]
    assert extra["peer_share"] is True and extra["upload_mbit"] == 200
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        kwargs = {**replica.subscriber.subscriber_kwargs()}
        with WeightSubscriber(pub.endpoint, **kwargs) as sub:
            peers = sub.status()["peers"]
            assert peers["endpoint"].startswith("tcp://127.0.0.1:")  # a loopback publisher
            assert peers["upload_rate_limit"] == 200e6 / 8
            assert peers["upload_cpu_share_limit"] == 0.1
        for bad, key in (({"peer_bind": "tcp://0.0.0.0:0"}, "peer_bind"),
                         ({"upload_mbit": -1}, "upload_mbit"),
                         ({"peer_share": "yes"}, "peer_share")):
            with pytest.raises(ConfigError, match=key):
                WeightSubscriber(pub.endpoint, **{"peer_share": True, **bad})
        with pytest.raises(ConfigError, match="only with peer_share"):
            WeightSubscriber(pub.endpoint, upload_mbit=10)


def test_a_file_of_another_kind_is_refused_by_name(tmp_path):
    path = tmp_path / "relay.yaml"
    path.write_text((CONFIGS / "relay.yaml").read_text())
    with pytest.raises(ConfigError, match=r"top-level key 'relay' \(expected one of replica\)"):
        load_replica_config(path)
    assert isinstance(load_relay_config(path), RelayConfig)


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"chunk_size": 100}, "chunk_size"),
    ({"first_version": 0}, "first_version"),
    ({"keep_versions": 0}, "keep_versions"),
    ({"heartbeat_interval": 0}, "heartbeat_interval"),
    ({"collective": "mpi"}, "collective"),
    ({"collective": "gloo", "collective_bucket_bytes": 5 << 20}, "collective_bucket_bytes"),
    ({"collective": "gloo", "collective_timeout": 0.5}, "collective_timeout"),
    ({"collective": "nccl"} if not torch.cuda.is_available() else {"collective": "x"},
     "collective"),
])
def test_bad_publisher_arguments_raise_config_error_naming_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        WeightPublisher("tcp://127.0.0.1:0", **kwargs)


def test_bind_failure_is_a_transport_error():
    from weightpub_wire.errors import TransportError

    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        with pytest.raises(TransportError, match="cannot bind") as info:
            WeightPublisher(pub.endpoint)
        assert info.value.__cause__ is not None


def test_every_rank_of_a_sharded_trainer_starts_from_the_same_file(tmp_path, monkeypatch):
    from publisher import ShardedPublisher

    path = tmp_path / "publisher.yaml"
    path.write_text("publisher:\n  endpoint: tcp://127.0.0.1:0\n  heartbeat_interval: 0.2\n"
                    "  sharding:\n    coordinator: tcp://127.0.0.1:0\n"
                    "    announce_endpoint: tcp://127.0.0.1:0\n    shard_timeout: 5\n")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=r"rank: not given and \$RANK"):
        ShardedPublisher.from_config(path, world_size=2)
    with pytest.raises(ConfigError, match="publisher.sharding: missing"):
        ShardedPublisher.from_config(PublisherConfig(endpoint="tcp://127.0.0.1:0"), rank=0,
                                     world_size=1)
    rank0 = ShardedPublisher.from_config(path, rank=0, world_size=2)
    try:
        assert rank0.coordinator is not None and rank0.coordinator.shard_timeout == 5
        # rank 1's file names the coordinator rank 0 bound (on a cluster: the same file)
        config = load_config(path)
        assert isinstance(config, PublisherConfig) and config.sharding is not None
        config = config.model_copy(update={"sharding": config.sharding.model_copy(
            update={"coordinator": rank0.coordinator.collect_endpoint})})
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with ShardedPublisher.from_config(config) as rank1:
            assert (rank1.rank, rank1.world_size, rank1.coordinator) == (1, 2, None)
            sub = WeightSubscriber(rank0.coordinator.endpoint)
            try:
                rank0.publish({"a": torch.arange(10.0)}, version=7)
                rank1.publish({"b": torch.ones(3, 5)}, version=7)
                staged = sub.wait_for_version(7, timeout=30)
                assert torch.equal(staged.tensors["a"], torch.arange(10.0))
                assert torch.equal(staged.tensors["b"], torch.ones(3, 5))
                staged.release()
            finally:
                sub.close()
    finally:
        rank0.close()
