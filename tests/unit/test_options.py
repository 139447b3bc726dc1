"""One options object per side: built once from keywords or YAML, checked, passed whole.

Nothing is started here: each test builds the objects the publisher, the
subscriber and the worker extension are configured with, and checks that the
flat keywords and the YAML sections land in the same typed options and that a
bad value is refused with its keyword's name.
"""

from __future__ import annotations

import dataclasses

import pytest

from publisher.collective.collective_sender import CollectiveOptions
from publisher.publisher_config import PublisherConfig
from publisher.publisher_options import PublisherOptions
from publisher.serving.server import ServerLimits
from subscriber_ext.transport.client.sync_client import SyncOptions
from subscriber_ext.transport.subscriber_config import SubscriberConfig
from subscriber_ext.transport.subscriber_options import SubscriberOptions
from subscriber_ext.vllm_ext.worker_options import DEFAULT_SOURCE, WorkerOptions
from weightpub_wire.errors import ConfigError


# -- publisher --------------------------------------------------------------------------------
def test_publisher_keywords_and_yaml_make_the_same_options() -> None:
    from_yaml = PublisherConfig(endpoint="tcp://127.0.0.1:1", chunk_mib=2, keep_versions=3,
                                collective="gloo", collective_bucket_mib=8,
                                collective_timeout=9.0, peer_fanout=2).options()
    from_keywords = PublisherOptions.from_keywords(
        chunk_size=2 << 20, keep_versions=3, collective="gloo",
        collective_bucket_bytes=8 << 20, collective_timeout=9.0, peer_fanout=2)
    assert from_yaml == from_keywords
    assert from_yaml.collective == CollectiveOptions(backend="gloo", bucket_bytes=8 << 20,
                                                     timeout=9.0)  # host: the endpoint's
    assert from_yaml.limits.tracker.fanout == 2


def test_keep_versions_is_one_snapshot_by_default_and_two_with_deltas() -> None:
    assert PublisherOptions().versions_kept == 1
    assert PublisherOptions(delta_anchor_every=4).versions_kept == 2
    assert PublisherOptions(keep_versions=3, delta_anchor_every=4).versions_kept == 3
    assert PublisherConfig(endpoint="tcp://127.0.0.1:1").options().versions_kept == 1


def test_publisher_collective_keywords_shape_nothing_when_the_path_is_off() -> None:
    options = PublisherOptions.from_keywords(collective_timeout=5.0, collective_port=7)
    assert options.collective is None
    assert PublisherOptions.from_keywords(collective="gloo", collective_host="*")\
        .collective == CollectiveOptions(backend="gloo", host="0.0.0.0")


def test_peer_fanout_overrides_the_limits_it_is_given() -> None:
    limits = ServerLimits(max_chunks_per_request=8)
    options = PublisherOptions.from_keywords(limits=limits, peer_fanout=0)
    assert options.limits.max_chunks_per_request == 8 and options.limits.tracker.fanout == 0


@pytest.mark.parametrize(("keywords", "key"), [
    ({"chunk_size": 100}, "chunk_size"),
    ({"keep_versions": 0}, "keep_versions"),
    ({"keep_versions": 1, "delta_anchor_every": 2}, "keep_versions"),
    ({"first_version": 0}, "first_version"),
    ({"heartbeat_interval": 0}, "heartbeat_interval"),
    ({"peer_fanout": 99}, "peer_fanout"),
    ({"metrics_port": 70000}, "metrics_port"),
    ({"collective": "mpi"}, "collective"),
    ({"collective": "gloo", "collective_bucket_bytes": 3 << 20}, "collective_bucket_bytes"),
    ({"colour": "red"}, "colour"),
])
def test_a_bad_publisher_option_is_named(keywords: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        PublisherOptions.from_keywords(**keywords)


def test_publisher_options_are_frozen_and_keyword_only() -> None:
    options = PublisherOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.chunk_size = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        PublisherOptions("m")  # type: ignore[misc]
    with pytest.raises(ConfigError, match="chunk_size"):
        dataclasses.replace(options, chunk_size=1)  # checked however it is made


def test_weight_publisher_takes_options_whole_or_keywords_not_both() -> None:
    from publisher.weight_publisher import WeightPublisher

    with pytest.raises(ConfigError, match="model_id given with options="):
        WeightPublisher("tcp://127.0.0.1:0", options=PublisherOptions(), model_id="m")
    with WeightPublisher("tcp://127.0.0.1:0", options=PublisherOptions(model_id="m")) as pub:
        assert pub.model_id == "m" and pub.options.model_id == "m"


# -- subscriber -------------------------------------------------------------------------------
def test_subscriber_keywords_and_yaml_make_the_same_options() -> None:
    config = SubscriberConfig(endpoint="tcp://127.0.0.1:1", window_mib=8, max_version_gib=1,
                              staging_budget_bytes=1 << 30, peer_share=True, upload_mbit=80)
    from_yaml = config.subscriber_options()
    from_keywords = SubscriberOptions.from_keywords(
        request_timeout=5.0, max_chunk_retries=5, window_bytes=8 << 20,
        max_version_bytes=1 << 30, staging_budget_bytes=1 << 30, peer_share=True,
        insecure=False, upload_cpu_share=0.25, upload_mbit=80)
    assert from_yaml == from_keywords
    assert from_yaml.sync.window_bytes == 8 << 20
    assert from_yaml.sync.limits.max_total_bytes == 1 << 30
    assert from_yaml.sync.peers is not None and from_yaml.sync.peers.upload_bytes_per_s == 1e7


def test_subscriber_keywords_override_a_sync_options_base() -> None:
    base = SyncOptions(request_timeout=1.0, window_bytes=1 << 20)
    options = SubscriberOptions.from_keywords(sync=base, window_bytes=2 << 20)
    assert options.sync == SyncOptions(request_timeout=1.0, window_bytes=2 << 20)


@pytest.mark.parametrize(("keywords", "key"), [
    ({"window_byte": 1}, "window_byte"),
    ({"staging_budget_bytes": 0}, "staging_budget_bytes"),
    ({"upload_mbit": 10}, "upload_mbit: only with peer_share"),
    ({"peer_share": "yes"}, "peer_share"),
    ({"peer_share": True, "upload_mbit": -1}, "upload_mbit"),
    ({"curve_secret_key_file": "k"}, "curve_secret_key_file: given without"),
    ({"subscriber_id": ""}, "subscriber_id"),
])
def test_a_bad_subscriber_option_is_named(keywords: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        SubscriberOptions.from_keywords(**keywords)


# -- the worker extension ---------------------------------------------------------------------
def test_worker_options_split_ours_from_the_subscriber_s() -> None:
    options = WorkerOptions.from_keywords(apply_mode="reload", prepare=True, keep=3,
                                          request_timeout=2.0, collective=True)
    assert (options.apply_mode, options.prepare, options.keep) == ("reload", True, 3)
    assert options.subscriber_cls == DEFAULT_SOURCE
    assert options.subscriber.sync.request_timeout == 2.0 and options.subscriber.sync.collective
    # the settings a coordinator is built with: a change there (only) rebuilds it
    assert options.commit != dataclasses.replace(options, keep=2).commit
    assert options.commit == dataclasses.replace(options, record_requests=False).commit


def test_prepared_shadows_have_no_budget_unless_asked_for() -> None:
    """Default: no shadows (a replica holds the staged copy only); ``prepare=True`` alone:
    unbounded; a budget given is kept as given."""
    assert WorkerOptions().commit.prepare_budget_bytes == 0
    assert WorkerOptions(prepare=True).commit.prepare_budget_bytes is None
    assert WorkerOptions.from_keywords(prepare_budget_bytes=1 << 30).commit \
        .prepare_budget_bytes == 1 << 30
    assert WorkerOptions(prepare_budget_bytes=5).commit != WorkerOptions().commit


@pytest.mark.parametrize(("keywords", "key"), [
    ({"apply_mode": "sometimes"}, "apply_mode"),
    ({"keep": 0}, "keep"),
    ({"prepare": "yes"}, "prepare"),
    ({"node_staging": 2}, "node_staging"),
    ({"subscriber_cls": "NoColon"}, "subscriber_cls"),
    ({"prepare_budget_bytes": -1}, "prepare_budget_bytes"),
    ({"mmap_threshold_bytes": 0}, "mmap_threshold_bytes"),
    ({"mmap_threshold_bytes": 64 << 20}, "mmap_threshold_bytes"),
    ({"prepare_budget_bytes": 1.5}, "prepare_budget_bytes"),
    ({"prepare": True, "prepare_budget_bytes": 0}, "prepare_budget_bytes"),
    ({"request_timout": 1.0}, "request_timout"),  # a subscriber keyword, misspelt
])
def test_a_bad_worker_option_is_named(keywords: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        WorkerOptions.from_keywords(**keywords)
