"""One declaration per option: every door (keywords, YAML, init_info) checks it the same way.

Nothing is started here (but one publisher and one subscriber that refuse to start):
each test builds the option objects the publisher, the subscriber and the worker
extension are configured with. The walk at the top takes EVERY declared option,
derives an in-bound and out-of-bound values from its declaration, and passes each
through every door the option has: the same acceptance, the same error.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from publisher.collective.collective_sender import CollectiveOptions
from publisher.publisher_config import PublisherConfig
from publisher.publisher_options import (
    PublisherKeywords,
    PublisherOptions,
    ShardedKeywords,
    ShardingOptions,
)
from publisher.serving.server import ServerLimits
from subscriber_ext.transport.client.sync_options import SyncOptions
from subscriber_ext.transport.subscriber_config import SubscriberConfig
from subscriber_ext.transport.subscriber_options import SubscriberKeywords, SubscriberOptions
from subscriber_ext.vllm_ext.worker_options import DEFAULT_SOURCE, WorkerKeywords, WorkerOptions
from weightpub.deployment_config import load_config
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ConfigError
from weightpub_wire.option_set import OptionSet

ENDPOINT = "tcp://127.0.0.1:5999"
#: string options that are endpoints: in bound a good one, out of bound a bad scheme
ENDPOINTS = {"coordinator", "announce_endpoint", "advertise", "peer_bind"}
#: what an option needs beside it to mean anything (the rules between options)
CONTEXT: dict[str, dict[str, Any]] = {
    **{name: {"peer_share": True} for name in
       ("peer_bind", "insecure", "upload_mbit", "upload_cpu_share")},
    "curve_secret_key_file": {"curve_server_key_file": "server.key"},
}
SPECIAL: dict[str, tuple[Any, list[Any]]] = {  # name: (in bound, [out of bound])
    "subscriber_id": ("replica-a", ["", "a\x1b[2Jb"]),
    "subscriber_cls": ("tests.vllm.helpers:DirSubscriber", ["NoColon", "a:b:c"]),
}


def _arms(annotation: Any) -> list[Any]:
    """The non-None types of an annotation, ``Annotated`` stripped."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (
        typing.Union, types.UnionType) else (annotation,)
    return [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
            for a in args if a is not type(None)]


def _bounds(info: FieldInfo) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for meta in info.metadata:
        for attr in ("ge", "gt", "le", "lt"):
            if getattr(meta, attr, None) is not None:
                found[attr] = getattr(meta, attr)
    return found


def values_for(name: str, info: FieldInfo) -> tuple[Any, list[Any]]:
    """An in-bound value and out-of-bound ones, derived from the declaration."""
    if name in SPECIAL:
        return SPECIAL[name]
    (kind,) = _arms(info.annotation)
    if kind is bool:
        return True, ["yes", 1]
    if typing.get_origin(kind) is typing.Literal:
        return typing.get_args(kind)[0], ["nonsense", 1]
    if kind is str:
        return (ENDPOINT, ["udp://h:1", 5]) if name in ENDPOINTS else ("x", [5])
    b = _bounds(info)
    if kind is int:
        inside = b.get("ge", b.get("gt", 0) + 1 if "gt" in b else b.get("le", 7))
        outside = [b["ge"] - 1] if "ge" in b else [b["gt"]] if "gt" in b else []
        outside += [b["le"] + 1] if "le" in b else []
        return inside, [*outside, "7", 7.5, True]
    if kind is float:
        inside = b["gt"] + 0.5 if "gt" in b else b.get("ge", 1.0)
        outside = [b["gt"]] if "gt" in b else [b["ge"] - 0.5] if "ge" in b else []
        outside += [b["le"] + 1] if "le" in b else []
        return inside, [*outside, "7", True]
    raise AssertionError(f"{name}: no values for {info.annotation}; add it to SPECIAL")


def cases(model: type[OptionSet]) -> list[tuple[str, Any, bool]]:
    """(option, value, in bound) for every declared option of ``model``."""
    found = []
    for name, info in model.declared_options().items():
        inside, outside = values_for(name, info)
        found += [(name, inside, True)] + [(name, v, False) for v in outside]
    return found


def context(model: type[OptionSet], name: str) -> dict[str, Any]:
    """What ``name`` needs beside it in ``model`` (the publisher's ``insecure`` needs nothing)."""
    needed = CONTEXT.get(name, {})
    return needed if set(needed) <= set(model.model_fields) else {}


def by_keyword(model: type[OptionSet], name: str, value: Any) -> str | None:
    """None if accepted, else the error."""
    try:
        model.from_keywords(**{**context(model, name), name: value})
    except ConfigError as exc:
        return str(exc)
    return None


def by_yaml(tmp_path: Path, kind: str, name: str, value: Any) -> str | None:
    """Through a real file and the real loader (``weightpub check-config``'s)."""
    model = {"publisher": PublisherOptions, "sharding": ShardingOptions,
             "subscriber": SubscriberOptions, "replica": WorkerOptions}[kind]
    section = {**context(model, name), name: value}
    body = {
        "publisher": {"endpoint": ENDPOINT, **section},
        "sharding": {"endpoint": ENDPOINT, "sharding": {
            "coordinator": ENDPOINT, "announce_endpoint": ENDPOINT, **section}},
        "subscriber": {"model": "m", "subscriber": {"endpoint": ENDPOINT, **section}},
        "replica": {"model": "m", "subscriber": {"endpoint": ENDPOINT}, **section},
    }[kind]
    top = {"sharding": "publisher", "subscriber": "replica"}.get(kind, kind)
    path = tmp_path / f"{kind}-{name}.yaml"
    path.write_text(yaml.safe_dump({top: body}))
    try:
        load_config(path)
    except ConfigError as exc:
        return str(exc)
    return None


def by_init_info(name: str, value: Any) -> str | None:
    """As vLLM's ``init_info.options`` (JSON from the network)."""
    options = json.loads(json.dumps({**context(WorkerOptions, name), name: value}))
    try:
        WorkerOptions.from_wire(options, "weightpub init_info.options")
    except ConfigError as exc:
        return str(exc)
    return None


def _same(kind: str, name: str, value: Any, inside: bool, keyword: str | None,
          other: str | None) -> None:
    where = f"{kind} {name}={value!r}"
    assert (keyword is None) == inside, f"{where}: keyword door says {keyword!r}"
    assert (other is None) == inside, f"{where}: keyword {keyword!r}, the other door {other!r}"
    if keyword is not None and other is not None:
        assert keyword in other, f"{where}: not the same error: {keyword!r} / {other!r}"
        assert name in keyword


SUBSCRIBER_YAML = sorted(SubscriberOptions.declared_options())
WORKER_ONLY = sorted(set(WorkerOptions.declared_options()) - set(SUBSCRIBER_YAML))
REPLICA_YAML = ("apply_mode", "node_staging", "prepare_budget_bytes")


@pytest.mark.parametrize(("name", "value", "inside"), cases(PublisherOptions))
def test_every_publisher_option_one_bound_through_keywords_and_yaml(
        tmp_path: Path, name: str, value: Any, inside: bool) -> None:
    _same("publisher", name, value, inside, by_keyword(PublisherOptions, name, value),
          by_yaml(tmp_path, "publisher", name, value))


@pytest.mark.parametrize(("name", "value", "inside"), [
    c for c in cases(ShardingOptions) if c[0] != "announce_endpoint" or c[2] is False])
def test_every_sharding_option_one_bound_through_keywords_and_yaml(
        tmp_path: Path, name: str, value: Any, inside: bool) -> None:
    keyword = by_keyword(ShardingOptions, name, value) if name == "coordinator" else \
        _sharding_keyword(name, value)
    _same("sharding", name, value, inside, keyword, by_yaml(tmp_path, "sharding", name, value))


def _sharding_keyword(name: str, value: Any) -> str | None:
    try:
        ShardingOptions.from_keywords(coordinator=ENDPOINT, **{name: value})
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("name", "value", "inside"), cases(SubscriberOptions))
def test_every_subscriber_option_one_bound_through_keywords_yaml_and_init_info(
        tmp_path: Path, name: str, value: Any, inside: bool) -> None:
    keyword = by_keyword(SubscriberOptions, name, value)
    _same("subscriber", name, value, inside, keyword,
          by_yaml(tmp_path, "subscriber", name, value))
    _same("subscriber", name, value, inside, keyword, by_init_info(name, value))
    if name in SyncOptions.model_fields:  # the object the client runs with: the same bound
        try:
            SyncOptions(**{name: value})
            direct = None
        except ConfigError as exc:
            direct = str(exc)
        _same("SyncOptions", name, value, inside, keyword, direct)


@pytest.mark.parametrize(("name", "value", "inside"), [
    c for c in cases(WorkerOptions) if c[0] in WORKER_ONLY])
def test_every_worker_option_one_bound_through_keywords_init_info_and_the_replica_file(
        tmp_path: Path, name: str, value: Any, inside: bool) -> None:
    keyword = by_keyword(WorkerOptions, name, value)
    _same("worker", name, value, inside, keyword, by_init_info(name, value))
    if name in REPLICA_YAML:
        _same("worker", name, value, inside, keyword, by_yaml(tmp_path, "replica", name, value))


def test_the_walk_covers_every_declared_option() -> None:
    """A new option is walked by the tests above without anyone listing it."""
    walked = {c[0] for m in (PublisherOptions, ShardingOptions, SubscriberOptions,
                             WorkerOptions) for c in cases(m)}
    declared = {n for m in (PublisherOptions, ShardingOptions, WorkerOptions)
                for n in m.declared_options()}
    assert walked == declared
    assert len(declared) > 40


@pytest.mark.parametrize(("name", "yaml_key", "value", "expected"), [
    ("window_bytes", "window_mib", 8, 8 << 20),
    ("window_bytes", "window_mib", 0, None),
    ("max_version_bytes", "max_version_gib", 1.5, 3 << 29),
    ("max_version_bytes", "max_version_gib", -1, None),
])
def test_a_yaml_unit_spelling_is_the_same_option_and_bound(
        tmp_path: Path, name: str, yaml_key: str, value: Any, expected: int | None) -> None:
    error = by_yaml(tmp_path, "subscriber", yaml_key, value)
    if expected is None:
        keyword = by_keyword(SubscriberOptions, name, int(value * (1 << 20)))
        assert error is not None and keyword is not None
        assert f"replica.subscriber.{yaml_key}: " in error  # named as the file spelt it
        bound = keyword.split(": ", 1)[1].split(" (got")[0]
        assert bound in error
        return
    config = SubscriberConfig.model_validate({"endpoint": ENDPOINT, yaml_key: value})
    assert getattr(config, name) == expected


def test_publisher_yaml_unit_spellings() -> None:
    config = PublisherConfig.model_validate({"endpoint": ENDPOINT, "chunk_mib": 0,
                                             "collective_bucket_mib": 8})
    assert config.chunk_size is None and config.collective_bucket_bytes == 8 << 20
    assert PublisherConfig.model_validate({"endpoint": ENDPOINT, "chunk_mib": 2}).chunk_size \
        == 2 << 20
    with pytest.raises(ValidationError, match="give one of them"):
        PublisherConfig.model_validate({"endpoint": ENDPOINT, "chunk_mib": 2,
                                        "chunk_size": 2 << 20})


@pytest.mark.parametrize("name", ["limits", "sync", "subscriber_cls"])
def test_python_only_options_are_refused_from_files_and_the_network(
        tmp_path: Path, name: str) -> None:
    if name != "sync":
        assert name in WorkerOptions.python_only()
    with pytest.raises(ConfigError, match=name):
        WorkerOptions.from_wire({name: "x"}, "weightpub init_info.options")
    if name == "limits":
        assert by_yaml(tmp_path, "subscriber", name, 1) is not None
        assert by_yaml(tmp_path, "publisher", name, 1) is not None


# -- issue 28.5: nothing starts with a value that cannot work -----------------------------------
@pytest.mark.parametrize(("name", "value"), [
    ("chunks_per_request", 0), ("chunks_per_request", -1),
    ("request_timeout", 0), ("request_timeout", -1), ("request_timeout", 0.0),
])
def test_a_value_that_would_busy_loop_is_refused_at_every_door(
        tmp_path: Path, name: str, value: Any) -> None:
    """Once accepted, these gave a subscriber thread that spun (5.6-7.7 s of CPU per 8 s)
    and never staged a version, with no error."""
    from subscriber_ext import WeightSubscriber

    with pytest.raises(ConfigError, match=rf"^{name}: Input should be greater than"):
        WeightSubscriber("tcp://127.0.0.1:9", **{name: value})  # type: ignore[misc]
    with pytest.raises(ConfigError, match=rf"^{name}: "):
        SyncOptions(**{name: value})
    with pytest.raises(ConfigError, match=rf"^{name}: "):
        WeightSubscriber("tcp://127.0.0.1:9", options=SyncOptions(), **{name: value})
    assert f"{name}: Input should be greater than" in str(by_init_info(name, value))
    assert f"replica.subscriber.{name}: Input should be greater than" in str(
        by_yaml(tmp_path, "subscriber", name, value))


def test_subscriber_cls_from_init_info_is_refused_without_importing_it(tmp_path: Path,
                                                                       monkeypatch) -> None:
    """``init_info`` comes from a client of ``/init_weight_transfer_engine``: a module it
    names is never imported (it would run that module's code in every worker)."""
    marker = tmp_path / "imported"
    (tmp_path / "weightpub_probe_module.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\ndef run(*a, **k):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for options in ({"subscriber_cls": "weightpub_probe_module:run"},
                    {"subscriber_cls": "weightpub_probe_module:run", "keep": 2}):
        with pytest.raises(ConfigError, match="subscriber_cls: Python only"):
            WorkerOptions.from_wire(options, "weightpub init_info.options")
    assert not marker.exists() and "weightpub_probe_module" not in sys.modules


# -- typed keywords: the TypedDicts and signatures follow the declaration ----------------------
def _plain(annotation: Any) -> frozenset[Any]:
    arms = _arms(annotation)
    none = type(None) in (typing.get_args(annotation) or ())
    return frozenset(arms + ([type(None)] if none else []))


@pytest.mark.parametrize(("keywords", "models", "extra"), [
    (PublisherKeywords, (PublisherOptions,), set()),
    (ShardedKeywords, (PublisherOptions, ShardingOptions), set()),
    (SubscriberKeywords, (SubscriberOptions,), {"sync"}),
    (WorkerKeywords, (WorkerOptions,), {"sync"}),
])
def test_keyword_typeddicts_match_the_declaration(keywords: Any, models: tuple[Any, ...],
                                                  extra: set[str]) -> None:
    hints = typing.get_type_hints(keywords)
    fields = {n: f for m in models for n, f in m.model_fields.items()}
    assert set(hints) == set(fields) | extra
    for name, info in fields.items():
        assert _plain(hints[name]) == _plain(info.annotation), name


@pytest.mark.parametrize(("function", "keywords"), [
    ("publisher.weight_publisher:WeightPublisher.__init__", PublisherKeywords),
    ("publisher.sharded_publisher:ShardedPublisher.__init__", ShardedKeywords),
    ("subscriber_ext.transport.subscriber:WeightSubscriber.__init__", SubscriberKeywords),
    ("subscriber_ext.vllm_ext.worker_extension:BatchWeightSyncWorkerExtension"
     ".start_weight_subscriber", WorkerKeywords),
])
def test_the_entry_points_take_typed_keywords(function: str, keywords: Any) -> None:
    import importlib
    import inspect

    module, _, path = function.partition(":")
    target: Any = importlib.import_module(module)
    for part in path.split("."):
        target = getattr(target, part)
    target = inspect.unwrap(target)
    (var,) = [p for p in inspect.signature(target).parameters.values()
              if p.kind is inspect.Parameter.VAR_KEYWORD]
    hint = typing.get_type_hints(target)[var.name]
    assert typing.get_origin(hint) is typing.Unpack and typing.get_args(hint) == (keywords,)


# -- the objects each side runs with -----------------------------------------------------------
def test_publisher_keywords_and_yaml_make_the_same_options() -> None:
    from_yaml = PublisherConfig(endpoint="tcp://127.0.0.1:1", chunk_mib=2, keep_versions=3,
                                collective="gloo", collective_bucket_mib=8,
                                collective_timeout=9.0, peer_fanout=2).options()
    from_keywords = PublisherOptions.from_keywords(
        chunk_size=2 << 20, keep_versions=3, collective="gloo",
        collective_bucket_bytes=8 << 20, collective_timeout=9.0, peer_fanout=2)
    assert from_yaml == from_keywords
    assert from_yaml.collective_options == CollectiveOptions(
        backend="gloo", bucket_bytes=8 << 20, timeout=9.0)  # host: the endpoint's
    assert from_yaml.server_limits.tracker.fanout == 2


def test_keep_versions_is_one_snapshot_by_default_and_two_with_deltas() -> None:
    assert PublisherOptions().versions_kept == 1
    assert PublisherOptions(delta_anchor_every=4).versions_kept == 2
    assert PublisherOptions(keep_versions=3, delta_anchor_every=4).versions_kept == 3
    assert PublisherConfig(endpoint="tcp://127.0.0.1:1").options().versions_kept == 1


def test_the_bounds_that_used_to_differ_keep_the_looser_safe_one(tmp_path: Path) -> None:
    """heartbeat_interval 100 and keep_versions 100 were accepted as keywords and refused
    from YAML; both are safe (subscribers wait 3 intervals; snapshots are counted in
    host_budget_bytes), so both doors accept them now, and refuse the same beyond."""
    for name, value in (("heartbeat_interval", 100), ("keep_versions", 100)):
        assert by_keyword(PublisherOptions, name, value) is None
        assert by_yaml(tmp_path, "publisher", name, value) is None
    assert by_keyword(PublisherOptions, "heartbeat_interval", 3601) is not None
    assert by_yaml(tmp_path, "publisher", "heartbeat_interval", 3601) is not None


def test_publisher_collective_keywords_shape_nothing_when_the_path_is_off() -> None:
    options = PublisherOptions.from_keywords(collective_timeout=5.0, collective_port=7)
    assert options.collective_options is None
    assert PublisherOptions.from_keywords(collective="gloo", collective_host="*")\
        .collective_options == CollectiveOptions(backend="gloo", host="0.0.0.0")


def test_peer_fanout_overrides_the_limits_it_is_given() -> None:
    limits = ServerLimits(max_chunks_per_request=8)
    options = PublisherOptions.from_keywords(limits=limits, peer_fanout=0)
    assert options.server_limits.max_chunks_per_request == 8
    assert options.server_limits.tracker.fanout == 0
    assert PublisherOptions(limits=limits).server_limits is limits


def test_peer_members_per_address_reaches_the_tracker_of_a_publisher_and_a_coordinator(
) -> None:
    """Many replicas behind one NAT address: the sybil bound is a user's setting."""
    from publisher.sharding.shard_coordinator import ShardCoordinator

    options = PublisherOptions.from_keywords(peer_members_per_address=32, peer_fanout=2)
    assert options.server_limits.tracker.max_members_per_address == 32
    assert options.server_limits.tracker.fanout == 2
    coordinator = ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 1,
                                   peer_members_per_address=0)
    try:
        assert coordinator._server.limits.tracker.max_members_per_address == 0
    finally:
        coordinator.close()
    with pytest.raises(ConfigError, match="peer_members_per_address"):
        ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 1,
                         peer_members_per_address=-1)


@pytest.mark.parametrize(("keywords", "key"), [
    ({"keep_versions": 1, "delta_anchor_every": 2}, "keep_versions"),
    ({"collective": "gloo", "collective_bucket_bytes": 3 << 20}, "collective_bucket_bytes"),
    ({"colour": "red"}, "colour"),
    ({"announce_early": True, "delta_anchor_every": 2, "keep_versions": 2},
     "announce_early: not with delta_anchor_every"),
    ({"announce_early": True, "collective": "gloo"}, "announce_early: not with collective"),
    ({"announce_early": True, "nixl": True}, "announce_early: not with nixl"),
    ({"announce_early": "yes"}, "announce_early"),
])
def test_a_bad_publisher_option_combination_is_named(keywords: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        PublisherOptions.from_keywords(**keywords)


def test_options_are_frozen_and_keyword_only_and_checked_however_made() -> None:
    options = PublisherOptions()
    with pytest.raises(ValidationError, match="frozen"):
        options.chunk_size = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        PublisherOptions("m")  # type: ignore[misc]
    with pytest.raises(ConfigError, match="chunk_size"):
        options.replace(chunk_size=1)
    assert options.replace(model_id="m").model_id == "m"


def test_weight_publisher_takes_options_whole_or_keywords_not_both() -> None:
    from publisher.weight_publisher import WeightPublisher

    with pytest.raises(ConfigError, match="model_id given with options="):
        WeightPublisher("tcp://127.0.0.1:0", options=PublisherOptions(), model_id="m")
    with WeightPublisher("tcp://127.0.0.1:0", options=PublisherOptions(model_id="m")) as pub:
        assert pub.model_id == "m" and pub.options.model_id == "m"


def test_sharded_publisher_takes_publisher_options_plus_sharding_options() -> None:
    from publisher.sharded_publisher import ShardedPublisher

    with pytest.raises(ConfigError, match="shard_timeout: Input should be greater than 0"):
        ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2, coordinator=ENDPOINT,
                         shard_timeout=0)
    with pytest.raises(ConfigError, match="heartbeat_interval: Input should be"):
        ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2, coordinator=ENDPOINT,
                         heartbeat_interval=0)
    with pytest.raises(ConfigError, match="coordinator: Field required"):
        ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2)
    with pytest.raises(ConfigError, match="announce_early: not supported with sharded"):
        ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2, coordinator=ENDPOINT,
                         announce_early=True)


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
    assert SubscriberOptions.from_keywords(**config.subscriber_kwargs()) == from_yaml


def test_subscriber_keywords_override_a_sync_options_base() -> None:
    base = SyncOptions(request_timeout=1.0, window_bytes=1 << 20,
                       limits=wire.Limits(max_pinned_bytes=5 << 20))
    options = SubscriberOptions.from_keywords(sync=base, window_bytes=2 << 20)
    assert options.sync == SyncOptions(request_timeout=1.0, window_bytes=2 << 20,
                                       limits=wire.Limits(max_pinned_bytes=5 << 20))


@pytest.mark.parametrize(("keywords", "key"), [
    ({"window_byte": 1}, "window_byte"),
    ({"upload_mbit": 10}, "upload_mbit: only with peer_share"),
    ({"curve_secret_key_file": "k"}, "curve_secret_key_file: given without"),
])
def test_a_bad_subscriber_option_is_named(keywords: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        SubscriberOptions.from_keywords(**keywords)


def test_worker_options_split_ours_from_the_subscriber_s() -> None:
    options = WorkerOptions.from_keywords(apply_mode="reload", prepare=True, keep=3,
                                          request_timeout=2.0, collective=True)
    assert (options.apply_mode, options.prepare, options.keep) == ("reload", True, 3)
    assert options.subscriber_cls == DEFAULT_SOURCE
    assert options.subscriber.sync.request_timeout == 2.0 and options.subscriber.sync.collective
    # the settings a coordinator is built with: a change there (only) rebuilds it
    assert options.commit != options.replace(keep=2).commit
    assert options.commit == options.replace(record_requests=False).commit


def test_prepared_shadows_have_no_budget_unless_asked_for() -> None:
    """Default: no shadows (a replica holds the staged copy only); ``prepare=True`` alone:
    unbounded; a budget given is kept as given."""
    assert WorkerOptions().commit.prepare_budget_bytes == 0
    assert WorkerOptions(prepare=True).commit.prepare_budget_bytes is None
    assert WorkerOptions.from_keywords(prepare_budget_bytes=1 << 30).commit \
        .prepare_budget_bytes == 1 << 30
    assert WorkerOptions(prepare_budget_bytes=5).commit != WorkerOptions().commit
    with pytest.raises(ConfigError, match="prepare_budget_bytes: 0 leaves nothing"):
        WorkerOptions.from_keywords(prepare=True, prepare_budget_bytes=0)
    with pytest.raises(ConfigError, match="request_timout"):  # a subscriber keyword, misspelt
        WorkerOptions.from_keywords(request_timout=1.0)


def test_the_options_doc_is_generated_from_the_declarations() -> None:
    """docs/options.md lists every option as declared (``weightpub options`` writes it)."""
    from weightpub.options_doc import render

    doc = Path(__file__).resolve().parents[2] / "docs" / "options.md"
    assert doc.read_text() == render(), "run: python -m weightpub options > docs/options.md"


def test_files_and_folders_may_be_given_as_paths(tmp_path: Path) -> None:
    """Strict checking still takes a ``pathlib.Path`` where a file or folder is named."""
    from publisher.publisher_options import PublisherOptions

    options = PublisherOptions.from_keywords(curve_allowed_clients_dir=tmp_path)
    assert options.curve_allowed_clients_dir == str(tmp_path)
    with pytest.raises(ConfigError, match="curve_allowed_clients_dir"):
        PublisherOptions.from_keywords(curve_allowed_clients_dir=5)
