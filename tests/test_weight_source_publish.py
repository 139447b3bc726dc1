"""``publish()`` takes vLLM's ``WeightSource`` (``ModuleSource`` too), group by group.

A real publisher and a real subscriber, vLLM's own source classes, no engine.
Groups are vLLM's ``layerwise_groups``; each is copied and dropped before the next
is asked for; a refusal (budget, a group this rank lacks) still walks every group,
so the other ranks' gathers are never left waiting.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from publisher import WeightPublisher, gather_full_tensors
from publisher.sources.layer_grouping import layer_groups
from subscriber_ext import WeightSubscriber
from weightpub_wire.errors import ConfigError, StagingBudgetError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(32, 16)
    model.layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)) for _ in range(4))
    model.head = torch.nn.Linear(16, 32, bias=False).to(torch.bfloat16)
    return model

@pytest.fixture(scope="module")
def vs() -> ModuleType:
    """vLLM's ``ModuleSource`` and the test sources built on it, imported when a test
    runs: at collection every xdist worker would pay vLLM's 7 s."""
    from tests import module_sources

    return module_sources



def test_layer_groups_are_vllms(vs: ModuleType) -> None:
    names = [n for n, _ in _model().named_parameters()]
    cases = [names, list(reversed(names)),
             ["model.language_model.layers.0.a", "visual.blocks.1.x", "visual.blocks.0.x",
              "lm_head.weight", "model.layers.3.mlp.experts.7.w1", "norm", "model.layers.2.b"]]
    for case in cases:
        assert layer_groups(case) == vs.layerwise_groups(case)


@pytest.mark.timeout(60)
def test_module_source_is_published_group_by_group_and_received(vs: ModuleType) -> None:
    model = _model()
    source = vs.Watched(model)
    with WeightPublisher("tcp://127.0.0.1:0") as pub, \
            WeightSubscriber(pub.endpoint, report_interval=0.2) as sub:
        version = pub.publish(source)
        staged = sub.wait_for_version(version, timeout=30)
        want = {n: p.detach() for n, p in model.named_parameters()}
        assert sorted(staged.tensors) == sorted(want)
        for name, tensor in staged.tensors.items():
            assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
        # manifest order is the group order: embed, layers 0..3, head
        manifest = [t.name for t in pub.manifest(version).tensors]
        assert manifest == [n for g in vs.layerwise_groups(list(want)) for n in g]
        staged.release()
        with torch.no_grad():  # the next version is copied over this one's buffer
            for param in model.parameters():
                param.add_(1)
        second = pub.publish(source)
        staged = sub.wait_for_version(second, timeout=30)
        for name, tensor in staged.tensors.items():
            assert torch.equal(tensor, dict(model.named_parameters())[name].detach()), name
    largest = max(len(g) for g in vs.layerwise_groups(list(want)))  # 4 tensors per layer
    assert source.yielded == list(want) * 2  # two versions, each tensor yielded once
    assert source.most_live <= largest + 1  # a group and the next one's first tensor
    assert source.live == 0


def test_other_ranks_walk_every_group_and_hold_none(vs: ModuleType) -> None:
    source = vs.Watched(_model())
    assert gather_full_tensors(source) is None
    assert source.yielded == [n for n, _ in _model().named_parameters()]
    assert source.most_live <= 5 and source.live == 0


@pytest.mark.timeout(60)
def test_refusals_still_walk_every_group(vs: ModuleType) -> None:
    model = _model()
    names = [n for n, _ in model.named_parameters()]

    class Partial(vs.Watched):
        def held_names(self) -> list[str]:  # this rank lacks layer 2 (pipeline stages)
            return [n for n in names if not n.startswith("layers.2.")]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:  # the held groups only
            return (p for p in super().__iter__() if not p[0].startswith("layers.2."))

    with WeightPublisher("tcp://127.0.0.1:0", host_budget_bytes=1024) as pub:
        whole = vs.Watched(model)
        with pytest.raises(StagingBudgetError):
            pub.publish(whole)
        assert whole.yielded == names  # the other ranks' gathers completed
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        partial = Partial(model)
        with pytest.raises(ConfigError, match="must hold every parameter"):
            pub.publish(partial)
        assert partial.yielded == names and partial.live == 0  # walked to the last group


@pytest.mark.timeout(60)
def test_a_source_that_disagrees_with_its_metadata_is_refused(vs: ModuleType) -> None:
    class Lying(vs.ModuleSource):
        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in super().__iter__():
                yield name, tensor.double() if name == "head.weight" else tensor

    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        with pytest.raises(ConfigError, match="head.weight"):
            pub.publish(Lying(_model()))
        with pytest.raises(Exception, match="not held"):
            pub.manifest(1)


@pytest.mark.timeout(60)
def test_a_publish_failing_midway_withdraws_the_version_it_overwrote(vs: ModuleType) -> None:
    """One snapshot (keep_versions=1): version 2 is copied over version 1's buffer and
    fails at its last group, so version 1 is no longer whole: it is withdrawn (never
    served half overwritten), and the next good version is served and received whole."""
    class Lying(vs.ModuleSource):
        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in super().__iter__():
                yield name, tensor.double() if name == "head.weight" else tensor

    model = _model()
    want = dict(model.named_parameters())
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        assert pub.publish(vs.ModuleSource(model)) == 1
        pub.wait_announced(1)
        with pytest.raises(ConfigError, match="head.weight"):
            pub.publish(Lying(model))
        with pytest.raises(Exception, match="not held"):
            pub.manifest(1)
        assert pub.publish(vs.ModuleSource(model)) == 3
        with WeightSubscriber(pub.endpoint) as sub:
            staged = sub.wait_for_version(3, timeout=30)
            assert staged.version == 3
            assert sorted(staged.tensors) == sorted(want)
            for name, tensor in staged.tensors.items():
                assert torch.equal(tensor, want[name].detach()), name
            staged.release()


@pytest.mark.timeout(60)
def test_sharded_ranks_each_keep_their_part_of_a_source(vs: ModuleType) -> None:
    """Two ``ShardedPublisher`` ranks (here in one process: a ``ModuleSource`` needs no
    collective) pass the same source; each walks every group, keeps its own tensors and
    drops the rest at once; the union is the model."""
    from publisher.sharded_publisher import ShardedPublisher
    from publisher.sharding.shard_coordinator import SHARD_PAD

    model = _model()
    want = {n: p.detach() for n, p in model.named_parameters()}
    sources = [vs.Watched(model), vs.Watched(model)]
    with ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=2,
                          coordinator="tcp://127.0.0.1:0", announce_endpoint="tcp://127.0.0.1:0",
                          chunk_size=4096) as rank0:
        assert rank0.coordinator is not None
        with ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2,
                              coordinator=rank0.coordinator.collect_endpoint,
                              chunk_size=4096) as rank1, \
                WeightSubscriber(rank0.coordinator.endpoint) as sub:
            for pub, source in zip((rank0, rank1), sources, strict=True):
                pub.publish(source, version=1)
            staged = sub.wait_for_version(1, timeout=30)
            assert sorted(staged.tensors) == sorted(want)
            for name, tensor in staged.tensors.items():
                assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name])
            kept = [{t.name for t in pub.shard.manifest(1).tensors} - {SHARD_PAD}
                    for pub in (rank0, rank1)]
            staged.release()
    assert kept[0] and kept[1] and not kept[0] & kept[1]  # every tensor has one owner
    for source in sources:
        assert source.yielded == list(want) and source.live == 0  # every group walked
        assert source.most_live <= 5  # a group (4 tensors) and the next one's first


@pytest.mark.timeout(60)
def test_a_sharded_rank_owning_nothing_still_walks_every_group(vs: ModuleType) -> None:
    """One tensor, two ranks: rank 1 keeps nothing (its shard is its pad) yet joins the
    gathers, and the version is announced."""
    from publisher.sharded_publisher import ShardedPublisher

    torch.manual_seed(1)
    model = torch.nn.Linear(8, 8, bias=False)
    sources = [vs.Watched(model), vs.Watched(model)]
    with ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=2,
                          coordinator="tcp://127.0.0.1:0", announce_endpoint="tcp://127.0.0.1:0",
                          chunk_size=4096) as rank0:
        assert rank0.coordinator is not None
        with ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2,
                              coordinator=rank0.coordinator.collect_endpoint,
                              chunk_size=4096) as rank1, \
                WeightSubscriber(rank0.coordinator.endpoint) as sub:
            for pub, source in zip((rank0, rank1), sources, strict=True):
                pub.publish(source, version=1)
            staged = sub.wait_for_version(1, timeout=30)
            assert torch.equal(staged.tensors["weight"], model.weight.detach())
            assert len(rank1.shard.manifest(1).tensors) == 1  # its pad only
            staged.release()
    assert [s.yielded for s in sources] == [["weight"], ["weight"]]
    assert [s.live for s in sources] == [0, 0]


@pytest.mark.timeout(60)
def test_a_publish_failing_before_it_overwrites_leaves_the_previous_version_served(
        vs: ModuleType) -> None:
    """keep_versions=1 (issue 28.7): a publish that fails at its first group has copied
    nothing over version 1's buffer, so version 1 stays listed and whole: a late joiner
    gets it bit-exact, and status names no withdrawn version (until then the failure
    withdrew version 1 whatever it had overwritten)."""
    from weightpub.status import fetch_status

    model = _model()
    want = {name: t.detach().clone() for name, t in model.named_parameters()}
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        assert pub.publish(vs.ModuleSource(model)) == 1
        pub.wait_announced(1)
        with pytest.raises(ConfigError, match="embed.weight"):
            pub.publish(vs.LyingAt(model, "embed.weight"))
        assert pub.manifest(1).version == 1  # still held
        with WeightSubscriber(pub.endpoint) as sub:
            staged = sub.wait_for_version(1, timeout=30)
            for name, tensor in staged.tensors.items():
                assert torch.equal(tensor, want[name]), name
            staged.release()
            memory = fetch_status(pub.endpoint).memory
            assert memory is not None and memory.withdrawn_version == 0
            assert pub.publish(vs.ModuleSource(model)) == 3  # the buffer is lent again, reused
            assert sub.wait_for_version(3, timeout=30).version == 3
            with pytest.raises(Exception, match="not held"):
                pub.manifest(1)


@pytest.mark.timeout(60)
def test_status_names_the_version_a_failed_publish_withdrew_and_why(vs: ModuleType) -> None:
    """keep_versions=1: a publish failing at its last group has overwritten most of
    version 1, which is withdrawn (one buffer: nothing left to serve it from); the
    status reply and ``weightpub status`` say which version and why."""
    from weightpub.fleet_view import memory_line
    from weightpub.status import fetch_status

    model = _model()
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        pub.publish(vs.ModuleSource(model))
        pub.wait_announced(1)
        with pytest.raises(ConfigError, match="head.weight"):
            pub.publish(vs.LyingAt(model, "head.weight"))
        memory = fetch_status(pub.endpoint).memory
        assert memory is not None and memory.withdrawn_version == 1
        assert "publish of version 2 failed midway" in memory.withdrawn_reason
        assert "head.weight" in memory.withdrawn_reason
        assert "keep_versions=1" in memory.withdrawn_reason
        line = memory_line(memory)
        assert line is not None and "version 1 withdrawn: publish of version 2" in line.plain
