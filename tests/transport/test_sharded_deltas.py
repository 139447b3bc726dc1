"""Deltas over sharded versions: every rank serves its own shard's deltas, the union offers
only bases every rank can start from.

Ranks are in-process ``ShardedPublisher``s (real sockets), each behind a byte-counting
relay (``byte_relay.py``) it advertises, so the bytes the ranks send are measured from
outside both ends. Weights drift like RL steps (few scattered bits per version).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch

from publisher.sharded_publisher import ShardedPublisher
from publisher.sharding.shard_coordinator import ShardCoordinator
from subscriber_ext import StagedVersion, WeightSubscriber
from subscriber_ext.transport.staging.delta_assembly import DeltaAssembly
from tests.transport.byte_relay import ByteRelay
from tests.transport.procs import as_bytes, drift_weights, spec_bytes, wait_until
from weightpub_wire import protocol as wire
from weightpub_wire.delta_codec import version_digest
from weightpub_wire.shard_submit import ShardSubmit

pytestmark = pytest.mark.timeout(90)

CHUNK = 4096
SEED = 33
SPECS = [
    [("layers.0.w", "bfloat16", (128, 256)), ("layers.0.b", "float32", (999,))],  # ~68 KiB
    [("layers.1.w", "float32", (64, 200)), ("head", "bfloat16", (77, 100))],  # ~65 KiB
]
FULL = sum(spec_bytes(spec) for spec in SPECS)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Ranks:
    """Two ranks with deltas, each serving behind its own ``ByteRelay``."""

    def __init__(self, stack: ExitStack, **keywords: Any) -> None:
        self.stack = stack
        self.keywords = {"chunk_size": CHUNK, "delta_anchor_every": 3,
                         "heartbeat_interval": 0.2, **keywords}
        self.relays: list[ByteRelay] = []
        self.pubs: list[ShardedPublisher] = []
        self.pubs.append(self._start(0))
        coordinator = self.pubs[0].coordinator
        assert coordinator is not None
        self.coordinator = coordinator
        self.pubs.append(self._start(1))

    def _start(self, rank: int) -> ShardedPublisher:
        port = _free_port()
        relay = ByteRelay(("127.0.0.1", port))
        self.stack.callback(relay.close)
        extra: dict[str, Any] = {"announce_endpoint": "tcp://127.0.0.1:0",
                                 "coordinator": "tcp://127.0.0.1:0"} if rank == 0 else \
            {"coordinator": self.coordinator.collect_endpoint}
        pub = ShardedPublisher(f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                               advertise=relay.endpoint, **extra, **self.keywords)
        self.stack.callback(pub.close)
        if rank < len(self.relays):
            self.relays[rank] = relay
        else:
            self.relays.append(relay)
        return pub

    def restart(self, rank: int) -> None:
        """A new process for ``rank``: a new instance, a new port, no deltas held."""
        self.pubs[rank].close()
        self.pubs[rank] = self._start(rank)

    def publish(self, version: int) -> wire.Manifest:
        for pub, spec in zip(self.pubs, SPECS, strict=True):
            pub.publish(drift_weights(SEED, version, spec), version=version)
        self.coordinator.wait_announced(version, timeout=30)
        manifest = self.coordinator.manifest()
        assert manifest is not None and manifest.version == version
        return manifest

    @property
    def bytes_down(self) -> int:
        return sum(relay.bytes_down for relay in self.relays)


@contextmanager
def ranks(**keywords: Any) -> Iterator[Ranks]:
    with ExitStack() as stack:
        yield Ranks(stack, **keywords)


def _check(staged: StagedVersion, version: int) -> None:
    expected: dict[str, torch.Tensor] = {}
    for spec in SPECS:
        expected.update(drift_weights(SEED, version, spec))
    assert set(staged.tensors) == set(expected)
    for name, want in expected.items():
        assert torch.equal(as_bytes(staged.tensors[name]), as_bytes(want)), (version, name)


def _chain(manifest: wire.Manifest) -> list[int] | None:
    return None if manifest.delta is None else [link.version for link in manifest.delta.chain]


def test_two_ranks_serve_their_shards_deltas_bit_exact() -> None:
    """Anchor every 3: versions 2 and 3 come as deltas from both ranks (a fraction of the
    bytes, counted between the ranks and the subscriber), 1 and 4 in full; a subscriber
    that missed version 5 rebuilds 6 from 4 through two delta steps."""
    with ranks() as group, \
            WeightSubscriber(group.coordinator.endpoint, request_timeout=2.0,
                             window_bytes=2 * CHUNK) as sub:
        sent: list[int] = []
        chains = []
        for version in (1, 2, 3, 4):
            before = group.bytes_down
            manifest = group.publish(version)
            staged = sub.wait_for_version(version, timeout=30)
            _check(staged, version)
            staged.release()
            sent.append(group.bytes_down - before)
            chains.append(_chain(manifest))
            assert manifest.deltas_follow
        assert chains == [None, [1], [1, 2], None]
        assert staged.manifest.shards is not None
        print("bytes the ranks sent per version: "
              + ", ".join(f"{n / FULL:.3f}x" for n in sent) + f" of {FULL} B")
        assert sent[0] >= FULL and sent[3] >= FULL  # anchors: in full
        assert sent[1] < 0.25 * FULL and sent[2] < 0.25 * FULL
        stats = sub.status()
        assert stats["versions_delta"] == 2 and stats["versions_full"] == 2
        assert stats["delta_fallbacks"] == 0
        assert stats["bytes_received_delta"] < 0.25 * FULL

        # version 5 is published while no chunk reaches the subscriber; 6 overtakes it
        client = sub._client
        made: list[Any] = []  # every delta rebuild the subscriber starts
        assembly_for = client.deltas.assembly_for

        def spy(manifest: wire.Manifest, pool: Any) -> DeltaAssembly | None:
            made.append(assembly_for(manifest, pool))
            return made[-1]

        client.deltas.assembly_for = spy  # type: ignore[method-assign]
        receive = client.on_chunk

        def hold_back_five(*args: Any) -> None:
            if client.target is None or client.target.manifest.version != 5:
                receive(*args)

        client.on_chunk = hold_back_five  # type: ignore[method-assign]
        group.publish(5)
        wait_until(lambda: client.target is not None and client.target.manifest.version == 5,
                   20, "version 5 started")
        manifest = group.publish(6)
        assert _chain(manifest) == [4, 5]
        _check(sub.wait_for_version(6, timeout=30), 6)
        sixth = [a for a in made if a is not None and a.manifest.version == 6]
        assert [a.steps for a in sixth] == [[(5, 4), (6, 5)]]
        assert sub.status()["versions_delta"] == 3


def test_a_restarted_rank_costs_one_full_version_and_a_lost_delta_falls_back() -> None:
    """Rank 1 restarted (its deltas and base gone): the union of the next version offers
    no delta, it comes in full, bit-exact, and deltas resume after it. A rank that offered
    a delta but cannot serve it answers ``version_unavailable``: that version is fetched
    in full from every rank, still bit-exact."""
    with ranks(delta_anchor_every=8) as group, \
            WeightSubscriber(group.coordinator.endpoint, request_timeout=2.0) as sub:
        for version in (1, 2):
            group.publish(version)
            _check(sub.wait_for_version(version, timeout=30), version)
        group.restart(1)
        manifest = group.publish(3)
        assert _chain(manifest) is None and manifest.shards is not None
        assert manifest.shards[1].endpoint == group.relays[1].endpoint
        _check(sub.wait_for_version(3, timeout=30), 3)
        manifest = group.publish(4)
        assert _chain(manifest) == [3]
        _check(sub.wait_for_version(4, timeout=30), 4)
        stats = sub.status()
        assert (stats["versions_full"], stats["versions_delta"]) == (2, 2)

        deltas = group.pubs[1].shard._deltas  # rank 1 loses the delta it offers for 5
        deltas.lookup = lambda version, base: None  # type: ignore[method-assign]
        manifest = group.publish(5)
        assert _chain(manifest) == [3, 4]
        _check(sub.wait_for_version(5, timeout=30), 5)
        stats = sub.status()
        assert stats["delta_fallbacks"] == 1 and stats["versions_full"] == 3


# -- the coordinator's chain, in process ------------------------------------------------------
def _submit(rank: int, version: int, chunks: int, chain: list[tuple[int, int]] | None,
            *, salt: int = 0) -> ShardSubmit:
    """Rank ``rank``'s shard of ``version``: ``chunks`` chunks, checksums from the version
    (``salt``: other bytes), offering deltas from ``chain`` ((version, chunks) per base)."""
    def checksums(v: int, n: int) -> tuple[int, ...]:
        return tuple(1000 * v + 10 * rank + i + salt for i in range(n))

    delta = None if chain is None else wire.DeltaInfo(chain=tuple(
        wire.DeltaBase(version=v, digest=version_digest(n * CHUNK, CHUNK, checksums(v, n)))
        for v, n in chain))
    entry = wire.TensorEntry(name=f"t{rank}", dtype="uint8", shape=(chunks * CHUNK,),
                             offset=0, nbytes=chunks * CHUNK)
    return ShardSubmit(rank=rank, world_size=2, version=version, publisher_id=f"r{rank}",
                       endpoint=f"tcp://127.0.0.1:{9000 + rank}", chunk_size=CHUNK,
                       total_bytes=chunks * CHUNK, tensors=(entry,),
                       checksums=checksums(version, chunks), delta=delta, deltas_follow=True)


def test_the_union_offers_only_bases_every_rank_serves_with_the_same_layout() -> None:
    with ShardCoordinator("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 2) as coord:
        def announce(*submits: ShardSubmit) -> wire.Manifest:
            for submit in submits:
                coord.submitted(submit, time.monotonic())
            manifest = coord.manifest()
            assert manifest is not None and manifest.version == submits[0].version
            return manifest

        first = announce(_submit(0, 1, 2, None), _submit(1, 1, 1, None))
        assert first.delta is None and first.deltas_follow
        second = announce(_submit(0, 2, 2, [(1, 2)]), _submit(1, 2, 1, [(1, 1)]))
        assert second.delta is not None
        assert second.delta.chain == (wire.DeltaBase(version=1, digest=version_digest(
            first.total_bytes, CHUNK, first.checksums)),)  # the union's digest
        third = announce(_submit(0, 3, 2, [(1, 2), (2, 2)]), _submit(1, 3, 1, [(2, 1)]))
        assert _chain(third) == [2]  # rank 1's chain starts at 2: the common tail
        # rank 0 grew: every rank's range moves, no base fits
        fourth = announce(_submit(0, 4, 3, [(3, 3)]), _submit(1, 4, 1, [(3, 1)]))
        assert fourth.delta is None
        # rank 1 claims a version 4 of other bytes (e.g. a restart that re-published it)
        fifth = announce(_submit(0, 5, 3, [(4, 3)]), _submit(1, 5, 1, [(4, 1)], salt=7))
        assert fifth.delta is None
        # a version the coordinator never announced is no base
        coord.submitted(_submit(0, 6, 3, [(5, 3)]), time.monotonic())  # rank 1's never comes
        seventh = announce(_submit(0, 7, 3, [(5, 3), (6, 3)]),
                           _submit(1, 7, 1, [(5, 1), (6, 1)]))
        assert seventh.delta is None
        # ranks without deltas: none offered, none follow
        eighth = announce(_submit(0, 8, 3, None), ShardSubmit(
            **{**{f: getattr(_submit(1, 8, 1, None), f) for f in ShardSubmit.__struct_fields__},
               "deltas_follow": False}))
        assert eighth.delta is None and not eighth.deltas_follow


def test_a_submit_without_delta_fields_still_decodes() -> None:
    """Ranks that predate sharded deltas send no ``delta``: the coordinator reads it as
    None, and a sharded manifest may now carry a delta chain."""
    import msgspec

    from weightpub_wire.shard_submit import decode_submit, encode_submit

    old = _submit(0, 2, 1, None)
    raw = msgspec.msgpack.decode(encode_submit(old))
    for field in ("delta", "deltas_follow"):
        raw.pop(field, None)
    decoded = decode_submit(msgspec.msgpack.encode(raw), 1 << 20)
    assert decoded.delta is None and not decoded.deltas_follow
    with pytest.raises(Exception, match="base version"):
        ShardSubmit(**{**{f: getattr(old, f) for f in ShardSubmit.__struct_fields__},
                       "delta": wire.DeltaInfo(chain=(wire.DeltaBase(version=2, digest=1),))})
