"""NIXL offers from sharded trainer ranks (issue 31): each rank registers its own snapshot
with its own NIXL agent and the coordinator's manifest carries every rank's offer
(``ShardSource.nixl``); a subscriber READs each rank's range from that rank.

Ranks are real processes (``shard_procs.py``, forked from the zygote), real NIXL agents
on both sides, UCX on loopback. What must hold: every rank's bytes come one-sided (no
rank sends a chunk frame), bit-exact, whole or sliced; a rank without NIXL costs frames
for its range only, counted against it; a rank killed -9 mid-read never lets a partial
version stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from subscriber_ext import WeightSubscriber
from tests.transport.procs import Child, wait_until
from tests.transport.test_sharded import SEED, SPECS, SPECS4, _check, _expected, _publish

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("nixl_loopback")]

CHUNK = 16 << 10
#: three ranks of a few hundred KiB each (16 to 40 chunks), unequal on purpose
SPECS3 = [
    [("layers.0.w", "float32", (256, 160)), ("layers.0.b", "bfloat16", (160,))],
    [("layers.1.w", "float32", (300, 200)), ("embed", "float16", (1000, 33))],
    [("head", "bfloat16", (200, 400)), ("norm", "float32", (7,))],
]


def _ranks(spawn: Callable[..., Child], specs: list[Any], nixl: list[bool], *,
           chunk_size: int = CHUNK, **extra: Any) -> tuple[list[Child], str]:
    """The rank processes (rank 0 with the coordinator), ``nixl[r]`` on rank ``r``; returns
    them and the address subscribers dial."""
    world = len(specs)
    rank0 = spawn("shard_rank", rank=0, world_size=world, spec=specs[0], seed=SEED,
                  chunk_size=chunk_size, announce_endpoint="tcp://127.0.0.1:0", nixl=nixl[0],
                  **extra)
    ready0 = rank0.event("ready", timeout=60)
    ranks = [rank0] + [spawn("shard_rank", rank=rank, world_size=world, spec=specs[rank],
                             seed=SEED, chunk_size=chunk_size, coordinator=ready0["collect"],
                             nixl=nixl[rank], **extra)
                       for rank in range(1, world)]
    for child in ranks[1:]:
        child.event("ready", timeout=60)
    return ranks, ready0["announce"]


def test_every_rank_is_read_over_nixl_bit_exact(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    ranks, endpoint = _ranks(spawn, SPECS3, [True, True, True])
    # a window of a few chunks: READs queue behind the posted ones (at most two windows),
    # and no rank's chunks spill to frames past the window
    sub = make_sub(endpoint, request_timeout=3.0, window_bytes=4 * CHUNK)
    for version in (1, 2):
        _publish(ranks, version)
        staged = sub.wait_for_version(version, timeout=60)
        _check(staged, _expected(version, SPECS3))
        assert staged.data_path == "nixl"
        shards = staged.manifest.shards
        assert shards is not None and len(shards) == 3
        agents = {shard.nixl.agent for shard in shards if shard.nixl is not None}
        assert len(agents) == 3  # each rank's own agent, its own offer
        staged.release()
    nixl = sub.status()["nixl"]
    assert nixl["fallbacks"] == 0 and nixl["rank_fallbacks"] == {}, nixl
    assert nixl["bytes_read"] == 2 * staged.manifest.total_bytes
    for rank in ranks:
        status = rank.request("status")
        assert status["bytes_sent"] == 0, status  # not one chunk frame from any rank
        assert status["nixl"]["on"] and status["nixl"]["offers"] == 2
        # its snapshot buffer, registered once and reused for the second version
        assert status["shard_total"] <= status["nixl"]["registered_bytes"] \
            < 2 * status["shard_total"] + (1 << 20), status


def test_a_rank_without_nixl_costs_frames_for_its_range_only(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    ranks, endpoint = _ranks(spawn, SPECS3, [True, False, True])
    sub = make_sub(endpoint, request_timeout=3.0)
    for version in (1, 2):
        _publish(ranks, version)
        staged = sub.wait_for_version(version, timeout=60)
        _check(staged, _expected(version, SPECS3))
        assert staged.data_path == "nixl+zmq"
        staged.release()
    nixl = sub.status()["nixl"]
    assert nixl["fallback_causes"] == {"unoffered": 2}, nixl  # once per version
    assert nixl["rank_fallbacks"] == {1: 2} and "trainer rank 1" in nixl["last_error"]
    sent = [rank.request("status") for rank in ranks]
    assert sent[0]["bytes_sent"] == sent[2]["bytes_sent"] == 0
    assert sent[1]["bytes_sent"] >= 2 * sent[1]["shard_bytes"]  # its range, as frames
    assert nixl["bytes_read"] == 2 * (sent[0]["shard_total"] + sent[2]["shard_total"])


def test_a_sliced_subscriber_reads_each_ranks_part_over_nixl(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    """Four ranks, a plan touching ranks 0 and 1 only (``test_slice_fetch``): each one's
    planned ranges READ from its agent, verified against its slice sums; no rank sends
    a chunk or a slice frame, ranks 2 and 3 are never read."""
    from tests.transport.test_sharded import CHUNK as SHARD_CHUNK
    from tests.transport.test_slice_fetch import _check_sharded, _sharded_plan

    ranks, endpoint = _ranks(spawn, SPECS4, [True] * 4, chunk_size=SHARD_CHUNK)
    plan = _sharded_plan()
    sub = make_sub(endpoint, slice_plan=plan, request_timeout=3.0)
    _publish(ranks, 1)
    staged = sub.wait_for_version(1, timeout=60)
    _check_sharded(staged, 1, SPECS4)
    assert staged.data_path == "nixl"
    nixl = sub.status()["nixl"]
    assert nixl["fallbacks"] == 0, nixl
    assert nixl["bytes_read"] == plan.needed_bytes
    # only the pages the plan touches are registered (pinned), not the sparse buffer
    assert plan.needed_bytes <= nixl["registered_bytes"] < staged.manifest.total_bytes // 2
    for rank in ranks:
        status = rank.request("status")
        assert status["bytes_sent"] == status["slice_bytes_sent"] == 0, status


def test_a_rank_killed_mid_read_never_stages_a_partial_version(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber],
        paced_reads: Callable[[int], list[float]]) -> None:
    """Rank 1 (most of the version) is killed -9 once a few READs are done: its READs
    fail or time out (counted against rank 1 only), its frames cannot come either, and
    the version is given up: nothing is staged."""
    big = [SPECS[0], [("layers.1.w", "float32", (512, 256))]]  # rank 1: 32 chunks
    ranks, endpoint = _ranks(spawn, big, [True, True], shard_timeout=1.0)
    paced = paced_reads(CHUNK)  # one chunk per READ, seen done one per 0.3 s
    # READs get 2 s (their floor): the first one to a rank sets up its UCX endpoint, slow
    # on a loaded box, and a rank timed out before the kill would not be read mid-version
    sub = make_sub(endpoint, request_timeout=2.0, max_chunk_retries=1, window_bytes=2 * CHUNK)
    for child in ranks:
        child.send(cmd="publish", version=1)
    wait_until(lambda: len(paced) >= 3, 60, "a few chunks read one-sided")
    ranks[1].kill9()
    fraction = sub.status()["fetching_fraction"]
    assert fraction is not None and fraction < 1.0  # killed mid-version
    wait_until(lambda: sub.status()["fetching_version"] is None, 60,
               "the version given up (rank 1's READs and frames both failed)")
    assert sub.latest() is None  # nothing partial was ever staged
    status = sub.status()
    assert status["staged_version"] == 0, status
    nixl = status["nixl"]
    assert set(nixl["fallback_causes"]) <= {"transfer", "unreachable", "timeout"}, nixl
    assert set(nixl["rank_fallbacks"]) <= {1}, nixl  # rank 0 was never blamed


def test_under_curve_only_an_admitted_subscriber_gets_the_ranks_offers(
        tmp_path: Any, make_sub: Callable[..., WeightSubscriber]) -> None:
    """Each rank's offer names its registered memory: it rides the rank's submit on the
    CURVE collect socket and the coordinator's authenticated PUB/ROUTER only, so an
    admitted subscriber READs every rank and a stranger never learns an offer (nor a
    byte). Ranks in this process, both with the trainer's key pair."""
    from publisher.sharded_publisher import ShardedPublisher
    from tests.transport.procs import det_weights
    from weightpub_wire.errors import WeightPubTimeout
    from weightpub_wire.keys import create_key_pair

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    public, secret = create_key_pair(tmp_path, "trainer")
    _, replica = create_key_pair(allowed, "replica")
    _, stranger_key = create_key_pair(tmp_path, "stranger")
    curve = {"curve_secret_key_file": str(secret), "curve_allowed_clients_dir": str(allowed),
             "chunk_size": CHUNK, "nixl": True}
    rank0 = ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=2,
                             coordinator="tcp://127.0.0.1:0",
                             announce_endpoint="tcp://127.0.0.1:0", **curve)  # type: ignore[arg-type]
    try:
        assert rank0.coordinator is not None
        with ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2,
                              coordinator=rank0.coordinator.collect_endpoint,
                              **curve) as rank1:  # type: ignore[arg-type]
            endpoint = rank0.coordinator.endpoint
            member = make_sub(endpoint, curve_server_key_file=str(public),
                              curve_secret_key_file=str(replica), request_timeout=3.0)
            stranger = make_sub(endpoint, curve_server_key_file=str(public),
                                curve_secret_key_file=str(stranger_key), request_timeout=3.0)
            specs: list[Any] = SPECS3[:2]
            for pub, spec in zip([rank0, rank1], specs, strict=True):
                pub.publish(det_weights(SEED, 1, [(n, d, tuple(s)) for n, d, s in spec]),
                            version=1)
            staged = member.wait_for_version(1, timeout=60)
            _check(staged, _expected(1, specs))
            assert staged.data_path == "nixl"
            with pytest.raises(WeightPubTimeout):
                stranger.wait_for_version(1, timeout=3)
            nixl = stranger.status()["nixl"]
            assert nixl["available"] is None and nixl["bytes_read"] == 0  # never saw one
            for pub in (rank0, rank1):
                assert pub.shard.data_stats()["bytes_sent_full"] == 0
    finally:
        rank0.close()
