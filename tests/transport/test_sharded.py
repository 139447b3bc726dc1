"""Sharded trainers: every rank publishes its own shard, one version is the union.

Ranks run as separate processes (``shard_procs.py``, forked from the zygote that has
torch imported: ``zygote.py``) serving their shards; rank 0 also runs the coordinator
that announces a version once every shard is in. The subscriber fetches each chunk
from the rank holding it, bit-exact, and a rank killed mid-version costs that version
only: nothing partial is ever staged.
FSDP2 ranks (gloo, CPU) pass the whole sharded model and each keeps about 1/world.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq

from publisher.sharded_publisher import ShardedPublisher
from publisher.sharding.shard_coordinator import SHARD_PAD, ShardCoordinator
from subscriber_ext import StagedVersion, WeightSubscriber
from tests.transport.procs import Child, as_bytes, det_weights, wait_until
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ConfigError
from weightpub_wire.shard_submit import ShardSubmit

pytestmark = pytest.mark.timeout(120)

CHUNK = 4096
SPECS = [
    [("layers.0.w", "float32", (300, 17)), ("layers.0.b", "bfloat16", (17,)),
     ("embed", "float16", (1000, 3))],
    [("layers.1.w", "float32", (200, 33)), ("layers.1.b", "int32", (5,)),
     ("head", "bfloat16", (77, 40))],
]
SEED = 20


def _start_ranks(spawn: Callable[..., Child], specs: list[Any], *, chunk_size: int = CHUNK,
                 forked: bool = True, **extra: Any) -> tuple[list[Child], dict[str, Any]]:
    """The ranks (rank 0 with the coordinator); ``forked``: from the zygote (milliseconds)
    rather than fresh interpreters (whose memory figures carry nothing inherited)."""
    world = len(specs)
    rank0 = spawn("shard_rank", forked=forked, rank=0, world_size=world, spec=specs[0], seed=SEED,
                  chunk_size=chunk_size, announce_endpoint="tcp://127.0.0.1:0", **extra)
    ready0 = rank0.event("ready", timeout=60)
    ranks = [rank0]
    for rank in range(1, world):
        ranks.append(spawn("shard_rank", forked=forked, rank=rank, world_size=world,
                           spec=specs[rank], seed=SEED, chunk_size=chunk_size,
                           coordinator=ready0["collect"], **extra))
    for child in ranks[1:]:
        child.event("ready", timeout=60)
    return ranks, ready0


def _expected(version: int, specs: list[Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        out.update(det_weights(SEED, version, [(n, d, tuple(s)) for n, d, s in spec]))
    return out


def _check(staged: StagedVersion, expected: dict[str, torch.Tensor]) -> None:
    assert set(staged.tensors) == set(expected)  # the ranks' pads are not tensors
    for name, want in expected.items():
        got = staged.tensors[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(as_bytes(got), as_bytes(want)), name


def _publish(ranks: list[Child], version: int) -> None:
    for child in ranks:
        child.send(cmd="publish", version=version)
    for child in ranks:
        child.event("published", timeout=30, version=version)


@pytest.fixture
def subscribers() -> Iterator[Callable[..., WeightSubscriber]]:
    made: list[WeightSubscriber] = []

    def make(endpoint: str, **kwargs: Any) -> WeightSubscriber:
        made.append(WeightSubscriber(endpoint, **kwargs))
        return made[-1]

    yield make
    for sub in made:
        sub.close()


SPECS4 = SPECS + [[("layers.2.w", "float32", (64, 64)), ("norm", "float32", (3,))],
                  [("layers.3.w", "bfloat16", (999,))]]


@pytest.mark.parametrize("specs", [SPECS, SPECS4], ids=["2-ranks", "4-ranks"])
def test_rank_processes_publish_one_version_bit_exact(
    spawn: Callable[..., Child], subscribers: Callable[..., WeightSubscriber],
    specs: list[Any],
) -> None:
    ranks, ready0 = _start_ranks(spawn, specs)
    sub = subscribers(ready0["announce"], request_timeout=2.0)
    for version in (1, 2, 3):
        _publish(ranks, version)
        staged = sub.wait_for_version(version, timeout=30)
        assert staged.version == version
        _check(staged, _expected(version, specs))
    manifest = staged.manifest
    assert manifest.shards is not None
    assert [s.rank for s in manifest.shards] == list(range(len(specs)))
    assert manifest.shards[0].endpoint == ready0["endpoint"]
    assert len({s.endpoint for s in manifest.shards}) == len(specs)  # a ROUTER per rank
    assert manifest.shards[1].first_chunk == manifest.shards[0].num_chunks > 0
    assert SHARD_PAD not in {t.name for t in manifest.tensors}
    status = ranks[0].request("status")
    assert status["announced"] == 3 and status["dropped"] == 0


def test_a_rank_killed_mid_version_costs_that_version_only(
    spawn: Callable[..., Child], subscribers: Callable[..., WeightSubscriber],
) -> None:
    big = [SPECS[0], [("layers.1.w", "float32", (512, 256))]]  # rank 1: 128 chunks
    ranks, ready0 = _start_ranks(spawn, big, shard_timeout=1.0)
    staged: list[int] = []
    # two chunks in flight per rank: the rank sends no more than that ahead of the kill
    sub = subscribers(ready0["announce"], request_timeout=0.5, max_chunk_retries=2,
                      window_bytes=2 * CHUNK, on_version=lambda s: staged.append(s.version))
    _publish(ranks, 1)
    _check(sub.wait_for_version(1, timeout=30), _expected(1, big))

    client = sub._client  # slow every chunk so the kill lands mid-transfer
    receive = client.on_chunk

    def paced(*args: Any) -> None:
        time.sleep(0.02)
        receive(*args)

    client.on_chunk = paced  # type: ignore[method-assign, assignment]
    _publish(ranks, 2)
    wait_until(lambda: client.target is not None and client.target.manifest.version == 2
               and len(client.target.missing) < client.target.manifest.num_chunks - 8,
               20, "version 2 half fetched")
    ranks[1].kill9()
    client.on_chunk = receive  # type: ignore[method-assign]
    wait_until(lambda: "timed out" in str(sub.status()["last_error"]), 30,
               "version 2 given up")
    # rank 1 is dead: rank 0's shard of version 3 alone is never announced
    ranks[0].send(cmd="publish", version=3)
    ranks[0].event("published", timeout=30, version=3)
    wait_until(lambda: ranks[0].request("status")["dropped"] >= 1, 20, "version 3 dropped")
    assert staged == [1]  # never a partial version
    assert sub.latest() is not None and sub.latest().version == 1  # type: ignore[union-attr]

    # the rank comes back (a new process, a new port): the next complete version follows
    ranks[1] = spawn("shard_rank", forked=True, rank=1, world_size=2, spec=big[1], seed=SEED,
                     chunk_size=CHUNK, coordinator=ready0["collect"])
    ranks[1].event("ready", timeout=60)
    _publish(ranks, 4)
    _check(sub.wait_for_version(4, timeout=30), _expected(4, big))
    assert staged == [1, 4]


def test_a_rank_that_stalls_mid_version_costs_that_version_only(
    spawn: Callable[..., Child], subscribers: Callable[..., WeightSubscriber],
) -> None:
    """A rank stopped (SIGSTOP: a long GC pause, a swapping or hung host) while the others
    submit their shards: the coordinator drops that version after ``shard_timeout`` and
    replicas keep the last complete one. Resumed, the rank finishes its stale shard late
    (dropped too, a newer version is announced first) and the next version is followed."""
    ranks, ready0 = _start_ranks(spawn, SPECS, shard_timeout=1.0)
    staged: list[int] = []
    sub = subscribers(ready0["announce"], request_timeout=2.0,
                      on_version=lambda s: staged.append(s.version))
    _publish(ranks, 1)
    _check(sub.wait_for_version(1, timeout=30), _expected(1, SPECS))
    os.kill(ranks[1].pid, signal.SIGSTOP)
    try:
        for child in ranks:  # rank 1 reads its command only once resumed
            child.send(cmd="publish", version=2)
        ranks[0].event("published", timeout=30, version=2)
        wait_until(lambda: ranks[0].request("status")["dropped"] == 1, 20, "version 2 dropped")
        assert "ranks [1]" in ranks[0].request("status")["last_error"]
        assert staged == [1]
    finally:
        os.kill(ranks[1].pid, signal.SIGCONT)
    ranks[1].event("published", timeout=30, version=2)  # its stale shard, late
    _publish(ranks, 3)
    _check(sub.wait_for_version(3, timeout=30), _expected(3, SPECS))
    assert staged == [1, 3]  # never version 2, never a partial one
    status = ranks[0].request("status")
    assert status["announced"] == 3 and status["dropped"] == 2, status


def test_per_rank_memory_is_its_shard(spawn: Callable[..., Child]) -> None:
    """Each rank's snapshot is its shard (plus the pad to a chunk), never the model.

    1 MiB chunks: with 4 KiB ones the publisher's per-chunk bookkeeping (any publisher's,
    sharded or not) adds about half a shard on the first publish."""
    mib = 1 << 20
    specs = [[("a", "float32", (8 * mib,))], [("b", "float32", (4 * mib,))]]  # 32, 16 MiB
    # fresh interpreters: a forked rank's RSS moves with pages it shares with the zygote
    ranks, _ = _start_ranks(spawn, specs, chunk_size=mib, forked=False)
    _publish(ranks, 1)
    for child, spec in zip(ranks, specs, strict=True):
        status = child.request("status")
        shard = status["shard_bytes"]
        assert shard == 4 * spec[0][2][0]
        assert shard <= status["held_bytes"] <= shard + mib  # one snapshot: its shard
        growth = status["publish_growth"]  # publish()'s peak beyond the source it copies
        total = status["peak_rss"] - status["start_rss"]
        print(f"rank shard {shard / mib:.0f} MiB: publish peak RSS beyond the source "
              f"{growth / mib:.1f} MiB ({growth / shard:.2f}x); peak over start "
              f"{total / mib:.1f} MiB ({total / shard:.2f}x, source included)")
        assert growth <= 1.25 * shard


def test_four_fsdp2_ranks_publish_a_quarter_each_and_a_rank_killed_costs_its_version(
    subscribers: Callable[..., WeightSubscriber],
) -> None:
    """Four FSDP2 gloo ranks pass the whole (DTensor) model to their ``ShardedPublisher``,
    with DTensors of uneven rows (7 and 3 over 4 ranks), a replicated one and a Shard(1)
    one: each Shard(0)/Replicate tensor goes to its owner only (no ``full_tensor()``: a
    rank receives about its own shard, not the model), the Shard(1) one through
    ``full_tensor()`` on every rank; the union is bit for bit (after a training step
    too), each rank's snapshot about a quarter.
    Then rank 3 is killed (SIGKILL) between two gathers of version 3: the others' gathers
    fail within gloo's timeout (their ``publish()`` raises, never hangs), the coordinator
    drops version 3 and the subscriber keeps version 2; nothing partial is staged."""
    from tests.transport.shard_procs import fsdp_extra_tensors, run_fsdp_shard_rank
    from weightpub.bench.fsdp_ranks import FsdpRanks, ModelShape, expected_tensors

    # gloo's timeout (init_process_group) bounds every collective with a dead peer
    shape, chunk, world, timeout = ModelShape(layers=6, hidden=128), 1 << 14, 4, 20.0
    expected = dict(expected_tensors(shape))
    extras = fsdp_extra_tensors()  # not parameters: no training step
    model = sum(t.numel() * t.element_size() for t in expected.values())
    staged_versions: list[int] = []
    with FsdpRanks(run_fsdp_shard_rank, world, shape, chunk, timeout, timeout=timeout,
                   start_method="forkserver") as ranks:
        (announce,) = ranks.expect(0, "announce", timeout=120)
        sub = subscribers(announce, request_timeout=2.0,
                          on_version=lambda s: staged_versions.append(s.version))
        for version in (1, 2):
            ranks.send_all(("publish", version, None))
            shards = [ranks.expect(rank, "shard")[1:] for rank in range(world)]
            staged = sub.wait_for_version(version, timeout=timeout)
            assert set(staged.tensors) == set(expected) | set(extras)
            for name, want in expected.items():
                if version > 1:  # each rank added 1 to its own shards
                    want = want + 1
                assert torch.equal(as_bytes(staged.tensors[name]), as_bytes(want)), \
                    (version, name)
            for name, want in extras.items():
                got = staged.tensors[name]
                assert got.dtype == want.dtype and torch.equal(got, want), (version, name)
            assert staged.manifest.shards is not None
            assert [s.rank for s in staged.manifest.shards] == list(range(world))
            received = 0
            for held, total, counts in shards:  # held: the rank's snapshot, shard and pad
                print(f"rank shard: {total / model:.2f}x the model ({held} bytes held), "
                      f"gathers {counts}")
                assert total <= held <= total + chunk
                assert 0.15 * model < total < 0.35 * model
                assert counts["full"] == 1  # the Shard(1) tensor only
                # an all-gather of every tensor would bring every rank 0.75x the model
                assert 0 < counts["received_bytes"] < total
                received += counts["received_bytes"]
            # every Shard(0) row not on its owner crosses once: 3/4 of the model, here
            # (plus the two uneven extras' rows)
            assert 0.75 * model <= received < 0.75 * model + 256
        assert staged_versions == [1, 2]

        for rank in range(world):  # rank 3 dies after its 5th gather of version 3
            ranks.send(rank, ("publish", 3, 5 if rank == world - 1 else None))
        for rank in range(world - 1):
            _, error, seconds, announced = ranks.expect(rank, "raised", timeout=2 * timeout)
            print(f"rank {rank}: publish() raised after {seconds:.1f}s: {error[:120]}")
            assert seconds < timeout + 10
            assert announced == (2 if rank == 0 else None)  # the coordinator: not version 3
        ranks.procs[world - 1].join(timeout)
        assert ranks.procs[world - 1].exitcode == -9
        codes = ranks.close(timeout)
    assert codes == [1, 1, 1, -9], (codes, ranks.errors)
    assert staged_versions == [1, 2]  # never version 3, never a partial one
    latest = sub.latest()
    assert latest is not None and latest.version == 2
    for name, want in expected.items():
        assert torch.equal(as_bytes(latest.tensors[name]), as_bytes(want + 1)), name


# -- the coordinator and the wire, in process ------------------------------------------------
def _submit(rank: int, version: int, *, world: int = 2, chunk: int = CHUNK,
            name: str = "t") -> ShardSubmit:
    entry = wire.TensorEntry(name=f"{name}{rank}", dtype="uint8", shape=(chunk,), offset=0,
                             nbytes=chunk)
    return ShardSubmit(rank=rank, world_size=world, version=version, publisher_id=f"r{rank}",
                       endpoint=f"tcp://127.0.0.1:{9000 + rank}", chunk_size=chunk,
                       total_bytes=chunk, tensors=(entry,), checksums=(rank,))


def test_the_coordinator_announces_only_complete_newer_versions() -> None:
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 2,
                          shard_timeout=0.3) as coord:
        now = time.monotonic()
        coord.submitted(_submit(0, 2), now)
        assert coord.latest_version == 0  # one shard of two
        coord.submitted(_submit(1, 2), now)
        assert coord.latest_version == 2
        manifest = coord.manifest()
        assert manifest is not None and manifest.checksums == (0, 1)
        assert [(t.name, t.offset) for t in manifest.tensors] == [("t0", 0), ("t1", CHUNK)]
        assert manifest.shard_of(1).endpoint == "tcp://127.0.0.1:9001"
        coord.submitted(_submit(0, 2), now)  # the announced one again
        assert coord.refused_submits == 1 and "already announced" in coord.last_error
        coord.submitted(_submit(0, 3), now)
        coord.submitted(_submit(1, 3, chunk=2 * CHUNK), now)  # chunk sizes differ
        assert coord.latest_version == 2 and coord.dropped_versions == 1
        assert "chunk_size" in coord.last_error
        coord.submitted(_submit(0, 4, world=3), now)
        assert "world_size" in coord.last_error
        coord.submitted(_submit(0, 5), now)  # rank 1 never comes
        wait_until(lambda: coord.dropped_versions == 2, 10, "version 5 timed out")
        assert "ranks [1]" in coord.last_error and coord.latest_version == 2


def test_a_sharded_manifest_must_cover_its_chunks_in_order() -> None:
    def manifest(firsts: list[tuple[int, int]]) -> wire.Manifest:
        return wire.Manifest(
            publisher_id="c", started_at=1.0, version=1, created_at=1.0, chunk_size=CHUNK,
            total_bytes=3 * CHUNK, tensors=(), checksums=(1, 2, 3),
            shards=tuple(wire.ShardSource(rank=i, endpoint=f"tcp://h:{i + 1}", publisher_id="r",
                                          first_chunk=f, num_chunks=n)
                         for i, (f, n) in enumerate(firsts)))

    good = manifest([(0, 2), (2, 0), (2, 1)])
    assert [good.shard_of(c).rank for c in range(3)] == [0, 0, 2]
    assert wire.decode(wire.encode(good)) == good
    for bad in ([(0, 2), (3, 1)], [(0, 2)], [(0, 2), (2, 2)]):
        with pytest.raises(Exception, match="shards"):
            wire.decode(wire.encode(manifest(bad)))


def test_an_old_subscriber_asking_the_coordinator_for_chunks_is_told_why() -> None:
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 1) as coord:
        coord.submitted(_submit(0, 1, world=1), time.monotonic())
        ctx: zmq.Context = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(coord.endpoint)
            dealer.send(wire.encode(wire.FetchRequest(req=7, publisher_id=coord.publisher_id,
                                                      version=1, chunks=(0,))))
            assert dealer.poll(10_000)
            reply = wire.decode(dealer.recv())
        finally:
            dealer.close(linger=0)
            ctx.term()
        assert isinstance(reply, wire.ErrorReply) and reply.code == "bad_request"
        assert "predates sharded publishing" in reply.message


def test_refused_combinations_say_so() -> None:
    with pytest.raises(ConfigError, match="collective"):  # deltas: test_sharded_deltas.py
        ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2,
                         coordinator="tcp://127.0.0.1:1", collective="tcp://127.0.0.1:2")
    with pytest.raises(ConfigError, match="announce_endpoint"):
        ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=2,
                         coordinator="tcp://127.0.0.1:0")


def test_peer_share_without_a_tracker_fetches_a_sharded_version_from_the_ranks() -> None:
    """Rank 0's ``peer_fanout`` is the coordinator's: 0 turns the tracker off there, and
    a ``peer_share=True`` subscriber says so and takes every chunk from the ranks
    (peers sharing a sharded version: ``test_sharded_peers.py``)."""
    with ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=1,
                          coordinator="tcp://127.0.0.1:0", announce_endpoint="tcp://127.0.0.1:0",
                          chunk_size=CHUNK, peer_fanout=0, heartbeat_interval=0.5) as pub:
        assert pub.coordinator is not None
        # the coordinator beats as often as the rank's publisher (subscribers' silence limit)
        assert pub.coordinator._server.options.heartbeat_interval == 0.5
        with pytest.raises(ConfigError, match="peer_fanout"):
            ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 1, peer_fanout=99)
        sub = WeightSubscriber(pub.coordinator.endpoint, peer_share=True)
        try:
            weights = {"w": torch.arange(3000, dtype=torch.float32)}
            pub.publish(weights, version=1)
            staged = sub.wait_for_version(1, timeout=20)
            assert torch.equal(staged.tensors["w"], weights["w"])
            peers = sub.status()["peers"]
            assert "peer_fanout 0" in str(peers["disabled"]) and peers["bytes_from_peers"] == 0
            assert pub.shard.data_stats()["bytes_sent_full"] == staged.manifest.total_bytes
        finally:
            sub.close()


@pytest.mark.parametrize("cut_through", [True, False], ids=["cut-through", "store-forward"])
def test_a_relay_re_serves_a_sharded_version_whole(
    subscribers: Callable[..., WeightSubscriber], cut_through: bool,
) -> None:
    """A relay subscribes to the coordinator like any subscriber, fetching from the ranks,
    and announces the version as its own (no ``shards``): its downstream gets it whole."""
    from weightpub.deployment_config import RelayConfig
    from weightpub.relay import Relay

    specs = [[(n, d, tuple(s)) for n, d, s in spec] for spec in SPECS]
    with ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=2,
                          coordinator="tcp://127.0.0.1:0",
                          announce_endpoint="tcp://127.0.0.1:0", chunk_size=CHUNK) as rank0:
        assert rank0.coordinator is not None
        with ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2,
                              coordinator=rank0.coordinator.collect_endpoint,
                              chunk_size=CHUNK) as rank1, \
                Relay(RelayConfig.model_validate({
                    "upstream": {"endpoint": rank0.coordinator.endpoint},
                    "downstream": {"endpoint": "tcp://127.0.0.1:0"},
                    "cut_through": cut_through})) as relay:
            sub = subscribers(relay.endpoint)
            for version in (1, 2):
                for pub, spec in ((rank0, specs[0]), (rank1, specs[1])):
                    pub.publish(det_weights(SEED, version, spec), version=version)
                staged = sub.wait_for_version(version, timeout=30)
                assert staged.manifest.shards is None  # the relay serves every chunk
                _check(staged, _expected(version, SPECS))
