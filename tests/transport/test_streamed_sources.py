"""Sharded weights are published one layer group at a time: bit-exact, and no rank holds the model.

Two FSDP2 (``fully_shard``) gloo ranks on CPU in their own processes: rank 0
publishes, rank 1 runs ``gather_full_tensors``; a subscriber here checks every
byte (``weightpub/bench/fsdp_streaming.py``, the harness of
``benchmarks/fsdp_streaming.py``). Each rank's peak resident set beyond its own
(rank 0: beyond its snapshot, the version itself) must stay within 3 layer
groups of an 8-layer model: a whole-model gather holds 8.
"""

from __future__ import annotations

import pytest
import torch

from publisher.sources.layer_grouping import layer_groups
from publisher.sources.shard_owners import owner_ranks
from publisher.sources.streamed_copy import gather_full_tensors
from weightpub.bench.fsdp_streaming import ModelShape, run_streaming


@pytest.mark.timeout(240)
def test_fsdp2_ranks_publish_bit_exact_within_three_layer_groups() -> None:
    shape = ModelShape(layers=8, hidden=1024)
    run = run_streaming(shape, timeout=90)
    assert run.verified_tensors == 2 + 3 * shape.layers  # embed, head, 3 per layer
    layer = shape.hidden * shape.hidden * 4 + 2 * shape.hidden * 4
    assert run.largest_group_bytes == layer
    assert run.model_bytes >= shape.layers * layer  # a whole gather: >= 8 groups
    by_rank = {r.rank: r for r in run.ranks}
    assert by_rank[0].snapshot_bytes >= run.model_bytes  # the version itself, aligned
    for rank, figures in by_rank.items():
        assert figures.peak_extra_bytes <= 3 * run.largest_group_bytes, (rank, run.row())


def test_layer_groups_follow_decoder_layers() -> None:
    names = ["embed.weight", "layers.1.a", "layers.0.a", "layers.0.b", "norm.weight",
             "layers.1.b", "head.weight"]
    assert layer_groups(names) == [["embed.weight"], ["layers.0.a", "layers.0.b"],
                                   ["layers.1.a", "layers.1.b"],
                                   ["norm.weight", "head.weight"]]
    assert layer_groups(["model.layers.3.mlp.experts.7.w1", "model.layers.3.mlp.experts.8.w1"]) \
        == [["model.layers.3.mlp.experts.7.w1", "model.layers.3.mlp.experts.8.w1"]]


def test_owner_ranks_balance_bytes_the_same_way_everywhere() -> None:
    pairs = [(f"layers.{i}.w", torch.empty(100 * (i % 3 + 1), device="meta"))
             for i in range(9)] + [("norm", torch.empty(1, dtype=torch.bfloat16))]
    owners = owner_ranks(pairs, 2)
    assert owners == owner_ranks(list(pairs), 2) and set(owners) == {n for n, _ in pairs}
    loads = [sum(t.numel() * t.element_size() for n, t in pairs if owners[n] == rank)
             for rank in (0, 1)]
    assert abs(loads[0] - loads[1]) <= 400 and sum(loads) == 7202
    assert set(owner_ranks(pairs[:2], 4).values()) == {0, 1}  # ranks 2, 3 own nothing
    assert set(owner_ranks(pairs, 1).values()) == {0}


def test_plain_weights_have_nothing_to_gather() -> None:
    weights = {"a": torch.ones(3)}
    assert gather_full_tensors(weights) is None
    assert gather_full_tensors(iter(weights.items())) is None
