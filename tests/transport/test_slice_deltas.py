"""Slices of a delta (issue 30): a sliced subscriber rebuilds its planned bytes from deltas.

A publisher serving deltas (``delta_anchor_every``) and weights that drift like RL
steps (``procs.drift_weights``: about 2 % of the elements change a low bit per
version); a subscriber with a half-row plan (``test_slice_fetch.half_plan``) behind a
byte-counting relay. What is checked: each staged version equals the published one
on its planned bytes and reads zeros elsewhere (a decoded chunk's bytes outside the
plan are never written), the bytes on the wire per delta version against the raw
slices of the first version, and the fallbacks to raw slices (a delta that does not
verify or decode, a base the version's chain does not name), each counted by cause.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.byte_relay import ByteRelay
from tests.transport.procs import Child, as_bytes, drift_weights, spec_bytes, wait_until
from tests.transport.test_slice_fetch import assert_planned, half_plan
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.slice_layout import SliceLayout

pytestmark = pytest.mark.timeout(120)

SEED = 31
CHUNK = 64 << 10
SPEC: list[Any] = [["layers.0.qkv.weight", "bfloat16", [256, 1024]],
                   ["layers.0.down.weight", "bfloat16", [512, 256]],
                   ["layers.0.norm.weight", "float32", [1024]]]


def test_a_sliced_subscriber_follows_deltas_with_few_bytes_on_the_wire(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber],
        relays: list[ByteRelay]) -> None:
    pub = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=SEED, chunk_size=CHUNK,
                delta_anchor_every=8)
    endpoint = pub.event("ready", timeout=60)["endpoint"]
    relays.append(ByteRelay.in_front_of(endpoint))
    plan = half_plan(0, SPEC)
    sub = make_sub(relays[0].endpoint, slice_plan=plan)
    wire_bytes = []
    for version in (1, 2, 3, 4):
        before = relays[0].bytes_down
        chain = pub.request("publish", version=version, spec=SPEC, drift=True)["delta_chain"]
        assert chain == (None if version == 1 else list(range(1, version)))
        staged = sub.wait_for_version(version, timeout=60)
        assert_planned(staged, drift_weights(SEED, version, SPEC), 0)
        assert sub.status()["versions_delta"] == version - 1  # 1 raw slices, then deltas
        staged.release()
        wire_bytes.append(relays[0].bytes_down - before)
    status = sub.status()
    share = status["slice_plan"]
    base = sub._client.deltas.base  # version 4's planned pages, counted in the budget
    assert base is not None and base.version == 4 and base.plan == plan.digest()
    resident = SliceLayout.build(plan, base.manifest).resident_bytes
    assert sub._client.pool.held_bytes >= resident
    assert (status["versions_full"], status["versions_delta"]) == (1, 3)
    assert status["delta_base_version"] == 4 and status["checksum_failures"] == 0
    assert share["delta_fallbacks"] == {} and share["fallbacks"] == {}
    assert share["slice_bytes"] == plan.needed_bytes  # version 1 only, as raw slices
    assert 0 < share["delta_bytes"] == status["bytes_received_delta"]
    stats = pub.request("stats")["stats"]
    assert stats["bytes_sent_delta"] == share["delta_bytes"]  # the publisher's count agrees
    raw = wire_bytes[0]
    assert raw >= plan.needed_bytes
    ratio = max(wire_bytes[1:]) / raw
    print(f"wire bytes per version: raw slices {raw}, delta slices {wire_bytes[1:]} "
          f"(max {ratio:.4f}x raw; plan {plan.needed_bytes} of {spec_bytes(SPEC)})")
    assert ratio < 0.2, wire_bytes


def test_a_delta_that_fails_falls_back_to_raw_slices_and_stays_exact(
        make_pub: Callable[..., WeightPublisher],
        make_sub: Callable[..., WeightSubscriber]) -> None:
    """Version 2's first delta chunk is replaced by a chunk of the right size and wrong
    bytes (decodes, fails the slice sums), version 3's by a payload that does not decode,
    version 5's delta is not served: each is fetched again as raw slices; version 4 comes
    as a delta again."""
    pub = make_pub(chunk_size=CHUNK, delta_anchor_every=8)
    sub = make_sub(pub.endpoint, slice_plan=half_plan(1, SPEC))
    client = sub._client
    receive = client.on_chunk
    spoiled: dict[int, str] = {}
    forms = {2: "checksum", 3: "decode"}

    def spoil(header: chunk_frame.ChunkHeader, frame: zmq.Frame, *rest: Any) -> None:
        target = client.target
        form = forms.get(header.version)
        if form and header.version not in spoiled and target is not None and target.fetch_base:
            span = target.manifest.chunk_span(header.chunk)[1]
            data = bytes(span) if form == "checksum" else b"XX" + bytes(14)  # RAW zeros; junk
            spoiled[header.version] = form
            frame = zmq.Frame(data)
            header = chunk_frame.ChunkHeader(req=header.req, version=header.version,
                                             chunk=header.chunk, size=len(data), follows=True)
        receive(header, frame, *rest)

    client.on_chunk = spoil  # type: ignore[method-assign]
    for version in (1, 2, 3, 4, 5):
        if version == 5:  # the publisher no longer holds the delta: ``version_unavailable``
            pub._deltas.lookup = lambda version, base: None  # type: ignore[method-assign]
        weights = drift_weights(SEED, version, SPEC)
        pub.publish(weights, version=version)
        staged = sub.wait_for_version(version, timeout=60)
        assert_planned(staged, weights, 1)
        staged.release()
    assert spoiled == forms
    status = sub.status()
    share = status["slice_plan"]
    assert share["delta_fallbacks"] == {"checksum": 1, "decode": 1, "unserved": 1}
    assert (status["versions_full"], status["versions_delta"]) == (4, 1)
    assert status["delta_fallbacks"] == 3 and status["delta_base_version"] == 5
    assert "fetching version 5 as raw slices" in str(status["last_error"])
    sub.mark_applied(4)  # a delta rebuild: its report says "slices" (a Report allows no other)
    wait_until(lambda: any(r.applied_version == 4 and r.data_path == "slices"
                           for r in pub.fleet()), 10, "the report of version 4")


def test_a_base_the_chain_does_not_name_fetches_raw_slices(
        make_pub: Callable[..., WeightPublisher],
        make_sub: Callable[..., WeightSubscriber]) -> None:
    """Anchors every 3 versions: a subscriber holding 2 that never hears of 3 and 4 (as
    conflation would skip them) sees 5, a delta against 4 only: raw slices, counted
    ``no_base``; 6 comes as a delta from 5 again."""
    pub = make_pub(chunk_size=CHUNK, delta_anchor_every=3)
    sub = make_sub(pub.endpoint, slice_plan=half_plan(0, SPEC))
    client = sub._client
    consider = client.consider
    skip = {3, 4}

    def deaf(manifest: wire.Manifest, *, confirmed: bool = False) -> None:
        if manifest.version not in skip:
            consider(manifest, confirmed=confirmed)

    client.consider = deaf  # type: ignore[method-assign]
    for version in (1, 2):
        pub.publish(drift_weights(SEED, version, SPEC), version=version)
        sub.wait_for_version(version, timeout=60).release()
    for version in (3, 4, 5):
        weights = drift_weights(SEED, version, SPEC)
        pub.publish(weights, version=version)
        pub.wait_announced(version, timeout=30)
    staged = sub.wait_for_version(5, timeout=60)
    assert [b.version for b in pub.manifest(5).delta.chain] == [4]  # type: ignore[union-attr]
    assert_planned(staged, weights, 0)
    staged.release()
    weights = drift_weights(SEED, 6, SPEC)
    pub.publish(weights, version=6)
    staged = sub.wait_for_version(6, timeout=60)
    assert_planned(staged, weights, 0)
    status = sub.status()
    assert status["slice_plan"]["delta_fallbacks"] == {"no_base": 1}
    assert (status["versions_full"], status["versions_delta"]) == (2, 2)


def test_sharded_ranks_serve_the_deltas_of_their_part_of_the_plan() -> None:
    """Two in-process trainer ranks with deltas (``test_sharded_deltas.Ranks``, each
    behind its own relay): the plan reads half of each row of rank 0's ``layers.0.w``
    and rank 1's ``head`` whole; versions 2 and 3 come from each rank as the deltas of
    its touched chunks, bit-exact on the planned bytes, at a fraction of the raw slices."""
    from tests.transport.test_sharded_deltas import SEED as SHARD_SEED
    from tests.transport.test_sharded_deltas import SPECS as SHARD_SPECS
    from tests.transport.test_sharded_deltas import ranks
    from weightpub_wire.slice_plan import from_ranges

    row = 256 * 2
    plan = from_ranges("tp2/rank0", {"layers.0.w": [(i * row, i * row + row // 2)
                                                    for i in range(128)],
                                     "head": [(0, 77 * 100 * 2)]})
    with ranks() as group, WeightSubscriber(group.coordinator.endpoint, request_timeout=2.0,
                                            slice_plan=plan) as sub:
        sent = []
        for version in (1, 2, 3):
            before = group.bytes_down
            group.publish(version)
            staged = sub.wait_for_version(version, timeout=30)
            want: dict[str, torch.Tensor] = {}
            for spec in SHARD_SPECS:
                want.update(drift_weights(SHARD_SEED, version, spec))
            assert staged.data_path == "slices"
            got = staged.tensors["layers.0.w"]
            assert torch.equal(as_bytes(got[:, :128]), as_bytes(want["layers.0.w"][:, :128]))
            assert not as_bytes(got[:, 128:]).any()
            assert torch.equal(as_bytes(staged.tensors["head"]), as_bytes(want["head"]))
            assert not as_bytes(staged.tensors["layers.1.w"]).any()  # never asked
            staged.release()
            sent.append(group.bytes_down - before)
        status = sub.status()
        assert (status["versions_full"], status["versions_delta"]) == (1, 2)
        assert status["slice_plan"]["delta_fallbacks"] == {}
        assert status["slice_plan"]["fallbacks"] == {}
        print(f"sharded wire bytes per version: raw slices {sent[0]}, delta slices {sent[1:]}")
        assert max(sent[1:]) < 0.5 * sent[0], sent


def test_a_chunk_whose_delta_is_no_smaller_comes_as_its_slice(
        make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
        relays: list[ByteRelay]) -> None:
    """Versions that share no byte (the encoder sends every chunk raw: a whole chunk for
    half of it planned). The fetch names the plan, so the publisher sends each such
    chunk as its slice: version 2 costs what raw slices cost. A publisher that does not
    know the plan (one before this) sends the raw chunks: version 3's delta is given up
    once it cost two chunks more than the slices would (``too_big``), fetched as raw
    slices, and version 4's delta is not tried (``paused``)."""
    from tests.transport.procs import det_weights

    pub = make_pub(chunk_size=CHUNK, delta_anchor_every=8)
    relays.append(ByteRelay.in_front_of(pub.endpoint))
    plan = half_plan(0, SPEC)
    sub = make_sub(relays[0].endpoint, slice_plan=plan, window_bytes=2 * CHUNK)
    serving = pub._server.delta_serving
    sent = []
    touched = 0
    for version in (1, 2, 3, 4):
        if version == 3:
            assert serving.slice_chunks == touched  # every chunk of version 2, as a slice
            serving._slice_layouts = None  # as a publisher before plan-aware deltas
        weights = det_weights(SEED, version, SPEC)  # every byte new
        before = relays[0].bytes_down
        pub.publish(weights, version=version)
        pub.wait_announced(version, timeout=30)
        manifest = pub.manifest(version)
        assert (manifest.delta is None) == (version == 1)
        touched = len(SliceLayout.build(plan, manifest).chunks)
        staged = sub.wait_for_version(version, timeout=60)
        assert_planned(staged, weights, 0)
        staged.release()
        sent.append(relays[0].bytes_down - before)
    assert sub.status()["versions_delta"] == 1  # version 2: every chunk as its slice
    share = sub.status()["slice_plan"]
    assert share["delta_fallbacks"] == {"too_big": 1, "paused": 1}
    print(f"raw slices {sent[0]}, a raw delta as slices {sent[1]}, a raw delta given up "
          f"then slices {sent[2]}")
    assert sent[1] < 1.02 * sent[0], sent
    # the raw slices, plus what the delta cost: its slack and the window in flight
    assert sent[2] < sent[0] + plan.needed_bytes // 2 + 6 * CHUNK, sent
    assert sent[3] < 1.05 * sent[0], sent


def test_a_subscriber_that_missed_a_version_rebuilds_through_the_chain(
        make_pub: Callable[..., WeightPublisher],
        make_sub: Callable[..., WeightSubscriber]) -> None:
    """Holding 2 and never hearing of 3, it rebuilds 4 in two delta steps (2 -> 3 -> 4),
    the second over the planned bytes the first wrote: exact, nothing raw."""
    pub = make_pub(chunk_size=CHUNK, delta_anchor_every=8)
    sub = make_sub(pub.endpoint, slice_plan=half_plan(1, SPEC))
    client = sub._client
    consider = client.consider

    def deaf(manifest: wire.Manifest, *, confirmed: bool = False) -> None:
        if manifest.version != 3:
            consider(manifest, confirmed=confirmed)

    client.consider = deaf  # type: ignore[method-assign]
    fetcher = sub._slices
    assert fetcher is not None
    make = fetcher.assembly
    steps: list[tuple[tuple[int, int], ...]] = []

    def spy(manifest: wire.Manifest, pool: Any, start: Any) -> Any:
        steps.append(start.steps)
        return make(manifest, pool, start)

    fetcher.assembly = spy  # type: ignore[method-assign]
    for version in (1, 2, 3, 4):
        weights = drift_weights(SEED, version, SPEC)
        pub.publish(weights, version=version)
        pub.wait_announced(version, timeout=30)
        if version != 3:
            staged = sub.wait_for_version(version, timeout=60)
            assert_planned(staged, weights, 1)
            staged.release()
    assert steps == [(), ((2, 1),), ((3, 2), (4, 3))]
    status = sub.status()
    assert (status["versions_full"], status["versions_delta"]) == (1, 2)
    assert status["slice_plan"]["delta_fallbacks"] == {}
    assert status["slice_plan"]["slice_bytes"] == half_plan(1, SPEC).needed_bytes
