"""No sharded version stalls a subscriber or locks the ranks out (issue 28 items 1 and 2).

A plaintext stranger on the coordinator's collect socket submits shards (what the
audit did): one naming a real rank's address for another rank's range (links are
per address: the other range was never asked, nothing timed out, and every later
version queued behind it for good), ranks at addresses nobody serves, and both ranks
of version 2**62 (every honest version after it was refused). The ranks are real
processes (forked from the zygote, ``shard_procs.py``), the subscriber is real.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from publisher.sharding.shard_coordinator import ShardCoordinator
from subscriber_ext import WeightSubscriber
from tests.transport.procs import Child, wait_until
from tests.transport.test_sharded import CHUNK, SPECS, _check, _expected, _publish, _start_ranks
from tests.transport.test_sharded import _submit as honest_submit
from weightpub_wire import protocol as wire
from weightpub_wire.shard_submit import ShardSubmit, encode_submit

pytestmark = pytest.mark.timeout(90)

TIMEOUT = 1.0  # the subscribers' request_timeout


@pytest.fixture
def stranger() -> Iterator[Callable[[str, ShardSubmit], None]]:
    """A plaintext DEALER that submits shards to a collect endpoint."""
    ctx: zmq.Context = zmq.Context()
    socks: dict[str, zmq.Socket] = {}

    def submit(collect: str, shard: ShardSubmit) -> None:
        if collect not in socks:
            socks[collect] = ctx.socket(zmq.DEALER)
            socks[collect].connect(collect)
        socks[collect].send(encode_submit(shard))

    yield submit
    for sock in socks.values():
        sock.close(linger=0)
    ctx.term()


def _forged(rank: int, version: int, endpoint: str, publisher_id: str,
            chunks: int = 1) -> ShardSubmit:
    """A shard of ``chunks`` chunks said to be served by ``publisher_id`` at ``endpoint``."""
    entry = wire.TensorEntry(name=f"forged{rank}", dtype="uint8", shape=(chunks * CHUNK,),
                             offset=0, nbytes=chunks * CHUNK)
    return ShardSubmit(rank=rank, world_size=2, version=version, publisher_id=publisher_id,
                       endpoint=endpoint, chunk_size=CHUNK, total_bytes=chunks * CHUNK,
                       tensors=(entry,), checksums=tuple(range(chunks)))


def _closed_port() -> str:
    """An address nobody listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _status(ranks: list[Child]) -> dict[str, Any]:
    return ranks[0].request("status")


def _error(sub: WeightSubscriber) -> str:
    return str(sub.status()["last_error"])


def test_a_rank_named_at_another_ranks_address_is_refused_and_later_versions_follow(
    spawn: Callable[..., Child], stranger: Callable[[str, ShardSubmit], None],
) -> None:
    """Rank 1 has published version 2 (its shard is in); a stranger submits rank 0's shard
    of version 2 at rank 1's address. Before: version 2 was announced, the subscriber's
    one link to that address fetched rank 1's range only and waited for good at 90 %
    (no error), and versions 3 and 4 queued behind it. Now the coordinator drops version 2
    naming the address, and versions 3, 4 arrive bit-exact."""
    ranks, ready0 = _start_ranks(spawn, SPECS)
    staged: list[int] = []
    with WeightSubscriber(ready0["announce"], request_timeout=TIMEOUT,
                          on_version=lambda s: staged.append(s.version)) as sub:
        _publish(ranks, 1)
        first = sub.wait_for_version(1, timeout=30).manifest
        assert first.shards is not None
        rank1 = first.shards[1]
        ranks[1].send(cmd="publish", version=2)
        ranks[1].event("published", timeout=30, version=2)
        stranger(ready0["collect"], _forged(0, 2, rank1.endpoint, rank1.publisher_id))
        wait_until(lambda: _status(ranks)["announced"] == 2
                   or "both say they serve at" in _status(ranks)["last_error"], 10,
                   "version 2 announced or dropped")
        time.sleep(2 * TIMEOUT)  # the subscriber fetches what was announced (it stalled here)
        for version in (3, 4):
            _publish(ranks, version)
            _check(sub.wait_for_version(version, timeout=20), _expected(version, SPECS))
        assert staged == [1, 3, 4]
        status = _status(ranks)
        assert "version 2 dropped" in status["last_error"]
        assert f"both say they serve at '{rank1.endpoint}'" in status["last_error"]


def test_a_version_at_addresses_nobody_serves_is_given_up_within_the_request_timeout(
    spawn: Callable[..., Child], stranger: Callable[[str, ShardSubmit], None],
) -> None:
    """Both ranks of version 2 said to be served at closed ports: the version is announced
    (it is well formed), and the subscriber gives it up at its first request timeout with
    ``last_error`` naming the rank that is not connected (before: after
    ``max_chunk_retries`` + 1 timeouts, as for a rank that answers late), then follows
    version 3."""
    ranks, ready0 = _start_ranks(spawn, SPECS)
    staged: list[int] = []
    with WeightSubscriber(ready0["announce"], request_timeout=TIMEOUT,
                          on_version=lambda s: staged.append(s.version)) as sub:
        _publish(ranks, 1)
        sub.wait_for_version(1, timeout=30)
        for rank in (0, 1):
            stranger(ready0["collect"], _forged(rank, 2, _closed_port(), f"ghost{rank}"))
        wait_until(lambda: _status(ranks)["announced"] == 2, 10, "version 2 announced")
        announced = time.monotonic()
        wait_until(lambda: "not connected" in _error(sub), 10 * TIMEOUT, "version 2 given up")
        took = time.monotonic() - announced
        print(f"version 2 at closed ports given up after {took:.2f}s "
              f"(request_timeout {TIMEOUT}s)")
        assert took < 2.5 * TIMEOUT, took
        assert "version 2" in _error(sub) and "trainer rank" in _error(sub)
        _publish(ranks, 3)
        _check(sub.wait_for_version(3, timeout=20), _expected(3, SPECS))
        assert staged == [1, 3]


def test_a_forged_version_2_62_does_not_lock_the_ranks_out(
    spawn: Callable[..., Child], stranger: Callable[[str, ShardSubmit], None],
) -> None:
    """A stranger submits both ranks of version 2**62 naming the real ranks (their
    addresses and instances, read from a manifest): it is announced (plaintext: nothing
    tells it from the ranks), the ranks do not hold it, so the subscriber gives it up with
    a named error; the ranks' next versions are announced in its place and arrive
    bit-exact (before: refused as "not newer" until the coordinator restarted)."""
    ranks, ready0 = _start_ranks(spawn, SPECS)
    staged: list[int] = []
    with WeightSubscriber(ready0["announce"], request_timeout=TIMEOUT,
                          on_version=lambda s: staged.append(s.version)) as sub:
        _publish(ranks, 1)
        shards = sub.wait_for_version(1, timeout=30).manifest.shards
        assert shards is not None
        for shard in shards:
            stranger(ready0["collect"], _forged(shard.rank, 2**62, shard.endpoint,
                                                shard.publisher_id, shard.num_chunks))
        wait_until(lambda: _status(ranks)["announced"] == 2**62, 10, "2**62 announced")
        wait_until(lambda: "version_unavailable" in _error(sub).lower()
                   or "not held" in _error(sub) or "unavailable" in _error(sub), 10,
                   "2**62 given up by the subscriber")
        for version in (2, 3):
            _publish(ranks, version)
            _check(sub.wait_for_version(version, timeout=20), _expected(version, SPECS))
        assert _status(ranks)["announced"] == 3
        assert staged == [1, 2, 3]


# -- the coordinator, the subscriber's links and the wire, in process -----------------------
def test_a_sharded_target_nobody_is_asked_for_is_given_up_after_the_request_timeout() -> None:
    """The subscriber's backstop (``fetch_credit.IdleWatch``, armed by the trainer ranks'
    ``idle_limit``): chunks missing and nothing in flight to anyone for ``request_timeout``
    (a range no link serves, whatever the cause) is an error naming the ranks whose chunks
    are missing; anything in flight resets it."""
    from subscriber_ext.transport.client.fetch_credit import IdleWatch
    from subscriber_ext.transport.staging.assembly import Assembly
    from subscriber_ext.transport.staging.request_table import RequestTable
    from weightpub_wire.buffers import BufferPool

    manifest = wire.Manifest(
        publisher_id="c", started_at=1.0, version=7, created_at=1.0, chunk_size=CHUNK,
        total_bytes=3 * CHUNK, tensors=(), checksums=(1, 2, 3),
        shards=(wire.ShardSource(rank=0, endpoint="tcp://h:1", publisher_id="a",
                                 first_chunk=0, num_chunks=1),
                wire.ShardSource(rank=1, endpoint="tcp://h:2", publisher_id="b",
                                 first_chunk=1, num_chunks=2)))
    requests = RequestTable()
    watch = IdleWatch()
    target = Assembly(manifest, BufferPool(max_buffers=1, pinned=False))
    try:
        assert watch.check(target, requests, 100.0, TIMEOUT) is None  # idle from now
        requests.track(requests.next_id(), [1], 100.5)  # something asked: not idle
        assert watch.check(target, requests, 100.9, TIMEOUT) is None
        requests.clear()
        assert watch.check(target, requests, 101.0, TIMEOUT) is None  # idle again from 101
        assert watch.check(target, requests, 101.0 + 0.9 * TIMEOUT, TIMEOUT) is None
        error = watch.check(target, requests, 101.0 + TIMEOUT, TIMEOUT)
        assert error is not None
        assert "version 7: 3 chunks of ranks [0, 1] missing and none asked" in str(error)
    finally:
        target.abandon()


def test_the_coordinator_drops_a_version_whose_ranks_share_an_address() -> None:
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 2) as coord:
        now = time.monotonic()
        coord.submitted(honest_submit(0, 1), now)
        coord.submitted(msgspec.structs.replace(honest_submit(1, 1),
                                                endpoint=honest_submit(0, 1).endpoint), now)
        assert coord.latest_version == 0 and coord.dropped_versions == 1
        assert "ranks 0 and 1 both say they serve at 'tcp://127.0.0.1:9000'" in coord.last_error
        coord.submitted(honest_submit(0, 2), now)
        coord.submitted(honest_submit(1, 2), now)
        assert coord.latest_version == 2


def test_a_complete_version_below_the_announced_one_is_announced_in_its_place() -> None:
    """Versions collect below the announced one; a complete one replaces it (a forged
    future version, or a trainer that went back); the announced version itself is not
    accepted twice."""
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 2) as coord:
        now = time.monotonic()
        for rank in (0, 1):
            coord.submitted(honest_submit(rank, 2**62), now)
        assert coord.latest_version == 2**62
        coord.submitted(honest_submit(0, 2**62), now)
        assert "already announced" in coord.last_error
        coord.submitted(honest_submit(0, 5), now)
        assert coord.latest_version == 2**62  # one shard of two
        coord.submitted(honest_submit(1, 5), now)
        assert coord.latest_version == 5
        manifest = coord.manifest()
        assert manifest is not None and manifest.version == 5
        assert coord._store.versions() == (5,)  # 2**62 is no longer served
        coord.submitted(honest_submit(0, 6), now)
        coord.submitted(honest_submit(1, 6), now)
        assert coord.latest_version == 6


def test_a_manifest_naming_one_address_or_rank_twice_is_refused() -> None:
    def manifest(shards: list[tuple[int, str]]) -> bytes:
        return wire.encode(wire.Manifest(
            publisher_id="c", started_at=1.0, version=1, created_at=1.0, chunk_size=CHUNK,
            total_bytes=2 * CHUNK, tensors=(), checksums=(1, 2),
            shards=tuple(wire.ShardSource(rank=rank, endpoint=endpoint, publisher_id="r",
                                          first_chunk=i, num_chunks=1)
                         for i, (rank, endpoint) in enumerate(shards))))

    good = manifest([(0, "tcp://h:1"), (1, "tcp://h:2")])
    assert wire.decode(good).shards is not None
    raw = msgspec.msgpack.decode(good)
    for shards, error in (([(0, "tcp://h:1"), (1, "tcp://h:1")], r"shards\[1\].endpoint"),
                          ([(0, "tcp://h:1"), (0, "tcp://h:2")], r"shards\[1\].rank")):
        forged = {**raw, "shards": [{**raw["shards"][i], "rank": rank, "endpoint": endpoint}
                                    for i, (rank, endpoint) in enumerate(shards)]}
        with pytest.raises(Exception, match=error):
            wire.decode(msgspec.msgpack.encode(forged))
