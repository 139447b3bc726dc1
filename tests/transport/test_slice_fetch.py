"""Slice fetches (issue 30), without vLLM: each subscriber pulls only its plan's bytes.

Two subscribers with complementary plans (rank 0: the first half of every row of each
matrix, rank 1: the second half; both need the 1-D tensors and the embedding whole)
follow a publisher in another process, each through its own byte-counting TCP relay
(``byte_relay.py``: counted per connection, outside both ends). What is checked: each
staged view equals the published tensor on its planned bytes (and reads zeros
elsewhere), what each one received against its plan, a corrupted slice refused and
fetched again, conflation, a publisher killed mid-version, a publisher that does not
serve slices (whole chunks, the touched ones), and plans the publisher refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from publisher import WeightPublisher
from publisher.serving.server import ServerLimits, SliceLimits
from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.client.slice_source import register_parts
from subscriber_ext.transport.staging.assembly import StagedVersion
from tests.transport.byte_relay import ByteRelay
from tests.transport.procs import Child, as_bytes, det_weights, spec_bytes, wait_until
from tests.unit.scrape import worker_view
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire
from weightpub_wire.dtypes import DTYPE_BY_NAME, itemsize
from weightpub_wire.slice_messages import SliceAck, SliceRegister, SliceSums, SliceSumsReply
from weightpub_wire.slice_plan import SlicePlan, SliceRuns, from_ranges

pytestmark = pytest.mark.timeout(120)

SEED = 30
CHUNK = 256 << 10
SPEC = [["layers.0.qkv.weight", "float32", [512, 1024]],
        ["layers.0.down.weight", "bfloat16", [1024, 512]],
        ["layers.0.norm.weight", "float32", [1024]],
        ["embed.weight", "float16", [256, 512]]]
WHOLE = {"embed.weight"}  # needed whole by both ranks (as a tied embedding would be)


def half_plan(rank: int, spec: list[Any] = SPEC) -> SlicePlan:
    """Rank 0: the first half of every row of each matrix; rank 1: the second half."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name, dtype, shape in spec:
        size = itemsize(DTYPE_BY_NAME[dtype])
        nbytes = size
        for dim in shape:
            nbytes *= dim
        if len(shape) != 2 or name in WHOLE:
            ranges[name] = [(0, nbytes)]
            continue
        row = shape[1] * size
        half = row // 2
        ranges[name] = [(i * row + rank * half, i * row + (rank + 1) * half)
                        for i in range(shape[0])]
    return from_ranges(f"tp2/rank{rank}", ranges)


def check_staged(staged: Any, version: int, rank: int) -> None:
    """Planned bytes equal the published ones; the rest reads zeros (never written)."""
    assert_planned(staged, det_weights(SEED, version, SPEC), rank)


def assert_planned(staged: Any, want: dict[str, torch.Tensor], rank: int) -> None:
    """``staged`` holds ``want``'s bytes where ``half_plan(rank)`` plans them and zeros
    elsewhere (never written). A delta rebuild's ``data_path`` is "slices" too."""
    assert staged.data_path == "slices", (staged.version, staged.data_path)
    assert list(staged.tensors) == list(want)
    for name, tensor in want.items():
        got = staged.tensors[name]
        assert got.shape == tensor.shape and got.dtype == tensor.dtype, name
        if tensor.dim() != 2 or name in WHOLE:
            assert torch.equal(as_bytes(got), as_bytes(tensor)), name
            continue
        half = tensor.shape[1] // 2
        mine, other = slice(rank * half, (rank + 1) * half), slice((1 - rank) * half,
                                                                   (2 - rank) * half)
        where = (name, rank, staged.version)
        assert torch.equal(as_bytes(got[:, mine]), as_bytes(tensor[:, mine])), where
        assert not as_bytes(got[:, other]).any(), where


def publish(pub: Child, version: int) -> None:
    pub.send(cmd="publish", version=version, spec=SPEC, id=version)
    pub.event("published", timeout=60, version=version)


def test_complementary_plans_receive_only_their_bytes(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber],
        relays: list[ByteRelay]) -> None:
    pub = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=SEED, chunk_size=CHUNK)
    endpoint = pub.event("ready", timeout=60)["endpoint"]
    plans = [half_plan(0), half_plan(1)]
    subs = []
    for plan in plans:
        relays.append(ByteRelay.in_front_of(endpoint))
        subs.append(make_sub(relays[-1].endpoint, slice_plan=plan))
    for version in (1, 2, 3):
        publish(pub, version)
        for rank, sub in enumerate(subs):
            staged = sub.wait_for_version(version, timeout=60)
            check_staged(staged, version, rank)
            staged.release()
    version_bytes = spec_bytes(SPEC)
    for rank, (sub, relay, plan) in enumerate(zip(subs, relays, plans, strict=True)):
        status = sub.status()
        share = status["slice_plan"]
        assert share["digest"] == plan.digest() and share["layout"] == f"tp2/rank{rank}"
        assert share["needed_bytes"] == plan.needed_bytes
        assert share["fallbacks"] == {} and share["whole_chunk_bytes"] == 0
        assert share["slice_bytes"] == 3 * plan.needed_bytes  # each planned byte once
        assert status["checksum_failures"] == 0 and status["last_error"] is None
        per_version = relay.bytes_down / 3
        # its plan per version plus the replies' framing and the sums: small
        assert per_version <= plan.needed_bytes * 1.02 + 16_384, (rank, per_version)
        assert per_version < 0.7 * version_bytes, (rank, per_version / version_bytes)
        # what the applied version cost it, by source kind: exactly its plan, from the
        # publisher (in its status and, as a share, in its report)
        sub.mark_applied(3)
        wait_until(lambda s=sub: s.status()["applied_received"] is not None, 30,
                   "applied")
        cost = sub.status()["applied_received"]
        assert cost["version"] == 3 and cost["by_source"] == {"publisher": plan.needed_bytes}
        assert cost["fraction"] == round(plan.needed_bytes / cost["version_bytes"], 4) < 0.7
    together = sum(relay.bytes_down for relay in relays) / 3
    assert together <= 1.15 * version_bytes, together / version_bytes


def test_a_late_joiner_slices_the_newest_version_and_the_status_table_says_so(
        make_pub: Callable[..., WeightPublisher],
        make_sub: Callable[..., WeightSubscriber]) -> None:
    from weightpub.fleet_view import fleet_table

    pub = make_pub(chunk_size=CHUNK)
    for version in (1, 2):
        pub.publish(det_weights(SEED, version, SPEC), version=version)
    pub.wait_announced(2, timeout=30)
    sub = make_sub(pub.endpoint, slice_plan=half_plan(1))
    check_staged(sub.wait_for_version(2, timeout=60), 2, 1)
    wait_until(lambda: pub.data_stats()["bytes_sent_slices"] >= half_plan(1).needed_bytes, 10,
               "the slices counted")
    assert sub.latest() is not None and sub.latest().version == 2  # type: ignore[union-attr]
    reply = wire.StatusReply(req=1, publisher_id=pub.publisher_id, started_at=1.0,
                             latest_version=2, versions=(2,), subscribers=(),
                             bytes_sent_slices=123, slice_plans=1)
    assert "123 as slices of 1 plans" in str(fleet_table(reply).renderables[0])


def test_a_corrupted_slice_is_refused_and_fetched_again(
        make_pub: Callable[..., WeightPublisher],
        make_sub: Callable[..., WeightSubscriber]) -> None:
    """A slice whose bytes changed on the way fails its per-plan checksum: it counts a
    try, is asked again, and the version staged holds the right bytes."""
    pub = make_pub(chunk_size=CHUNK)
    sub = make_sub(pub.endpoint, slice_plan=half_plan(1))
    client = sub._client
    receive = client.on_chunk
    flipped: list[int] = []

    def flip_once(header: chunk_frame.ChunkHeader, frame: zmq.Frame, *rest: Any) -> None:
        if not flipped and header.size > 1024:  # the first slice that comes: one bit off
            data = bytearray(chunk_frame.payload(frame.buffer, header))
            data[len(data) // 2] ^= 0x10
            flipped.append(header.chunk)
            frame = zmq.Frame(bytes(data))
            header = chunk_frame.ChunkHeader(req=header.req, version=header.version,
                                             chunk=header.chunk, size=header.size,
                                             follows=True)
        receive(header, frame, *rest)

    client.on_chunk = flip_once  # type: ignore[method-assign]
    version = pub.publish(det_weights(SEED, 1, SPEC))
    staged = sub.wait_for_version(version, timeout=60)
    check_staged(staged, version, 1)
    assert flipped and sub.status()["checksum_failures"] == 1
    assert "checksum mismatch" in str(sub.status()["last_error"])


def test_conflation_moves_a_slow_slice_fetch_to_the_newest_version(
        make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
        relays: list[ByteRelay]) -> None:
    pub = make_pub(chunk_size=CHUNK, keep_versions=2)
    relays.append(ByteRelay.in_front_of(pub.endpoint, down_rate=2e6))  # ~1 s per slice set
    staged_versions: list[int] = []
    sub = make_sub(relays[0].endpoint, slice_plan=half_plan(0),
                   on_version=lambda s: staged_versions.append(s.version))
    pub.publish(det_weights(SEED, 1, SPEC))
    wait_until(lambda: sub.status()["fetching_version"] == 1, 30, "fetching version 1")
    for version in (2, 3):
        pub.publish(det_weights(SEED, version, SPEC))
    staged = sub.wait_for_version(3, timeout=90)
    check_staged(staged, 3, 0)
    assert staged_versions[-1] == 3
    assert sorted(staged_versions) == staged_versions  # never an older one after a newer


def test_kill9_of_the_publisher_mid_version_stages_nothing_partial(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber],
        relays: list[ByteRelay], tmp_path: Path) -> None:
    pub = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=SEED, chunk_size=CHUNK)
    endpoint = pub.event("ready", timeout=60)["endpoint"]
    relays.append(ByteRelay.in_front_of(endpoint, down_rate=1e6))
    staged_versions: list[int] = []
    # one chunk in flight: at the kill, most of version 2 is still unasked (nothing buffered)
    # two tries per chunk: the subscriber gives version 2 up soon after the kill
    sub = make_sub(relays[0].endpoint, slice_plan=half_plan(0), request_timeout=1.0,
                   window_bytes=CHUNK, max_chunk_retries=2,
                   on_version=lambda s: staged_versions.append(s.version))
    publish(pub, 1)
    check_staged(sub.wait_for_version(1, timeout=60), 1, 0)
    publish(pub, 2)
    wait_until(lambda: (sub.status()["fetching_fraction"] or 0) > 0, 30, "version 2 arriving")
    pub.kill9()
    # ``abandoned``, not ``last_error``: a reconnect's handshake may replace the latter
    wait_until(lambda: (sub.status()["abandoned"] or {}).get("version") == 2, 30,
               "version 2 given up against the dead publisher")
    assert "version 2" in sub.status()["abandoned"]["why"]
    worker, text = worker_view(sub, tmp_path)  # what the operator reads of it
    assert worker["abandoned"]["version"] == 2 and sub.status()["abandoned_versions"] == 1
    assert 'weightpub_versions_abandoned_total{rank="0"} 1.0' in text
    assert staged_versions == [1]  # version 2 never staged in part
    latest = sub.latest()
    assert latest is not None and latest.version == 1
    check_staged(latest, 1, 0)


def test_a_publisher_without_slices_serves_the_touched_chunks_whole(
        make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
        relays: list[ByteRelay]) -> None:
    """A publisher that drops slice requests (as one before issue 30 does): after the
    registration's tries the subscriber fetches whole chunks, only those its plan touches,
    keeps only the planned bytes, and says why in status."""
    pub = make_pub(chunk_size=CHUNK)
    pub._server.slice_serving.handle = lambda *args: None  # type: ignore[method-assign]
    relays.append(ByteRelay.in_front_of(pub.endpoint))
    plan = from_ranges("one-tensor", {"layers.0.norm.weight": [(0, 4096)]})
    sub = make_sub(relays[0].endpoint, slice_plan=plan, request_timeout=0.5)
    weights = det_weights(SEED, 1, SPEC)
    version = pub.publish(weights)
    staged = sub.wait_for_version(version, timeout=60)
    got = as_bytes(staged.tensors["layers.0.norm.weight"])
    assert torch.equal(got, as_bytes(weights["layers.0.norm.weight"]))
    share = sub.status()["slice_plan"]
    assert share["fallbacks"] == {"no_answer": 1}
    assert 0 < share["whole_chunk_bytes"] <= CHUNK  # the one chunk the plan touches
    assert relays[0].bytes_down < 2 * CHUNK
    assert not as_bytes(staged.tensors["layers.0.qkv.weight"]).any()  # never asked


def _dealer(endpoint: str) -> Iterator[zmq.Socket]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()


def _ask(sock: zmq.Socket, *messages: Any) -> Any:
    """The reply to ``messages`` (all of one request: the same ``req``)."""
    for message in messages:
        sock.send(wire.encode(message))
    while True:
        reply = wire.decode(sock.recv(), expect=(wire.ErrorReply, SliceAck, SliceSumsReply))
        if reply.req == messages[0].req:
            return reply


def test_bad_plans_are_refused_by_name_and_the_publisher_stays_up(
        make_pub: Callable[..., WeightPublisher],
        make_sub: Callable[..., WeightSubscriber]) -> None:
    pub = make_pub(chunk_size=CHUNK, limits=ServerLimits(
        slices=SliceLimits(max_plan_bytes=256 << 10)))
    version = pub.publish(det_weights(SEED, 1, SPEC))
    pub.wait_announced(version, timeout=30)  # held (publish() returns before the hashes end)
    for sock in _dealer(pub.endpoint):
        overlapping = SliceRegister(req=1, digest="a" * 32, layout="bad", part=0, parts=1,
                                    tensors=(SliceRuns("layers.0.norm.weight",
                                                       [(0, 100, 0, 1), (50, 10, 0, 1)]),))
        reply = _ask(sock, overlapping)
        assert isinstance(reply, wire.ErrorReply) and reply.code == "bad_request"
        assert "tensors[0].runs[1]" in reply.message and "inside the previous run" \
            in reply.message, reply.message
        past = SlicePlan("past", [SliceRuns("layers.0.norm.weight", [(4000, 200, 0, 1)])])
        reply = _ask(sock, *register_parts(past, past.digest(), 2))
        assert isinstance(reply, SliceAck)  # a plan is layout-free: fine until a version
        reply = _ask(sock, SliceSums(req=3, publisher_id=pub.publisher_id, version=version,
                                     digest=past.digest()))
        assert isinstance(reply, wire.ErrorReply) and reply.code == "bad_request"
        assert "ends at byte 4200, past the 4096 bytes" in reply.message, reply.message
        oversize = from_ranges("huge", {"layers.0.qkv.weight": [
            (i * 16, i * 16 + 1 + i % 3) for i in range(100_000)]})
        reply = _ask(sock, *register_parts(oversize, oversize.digest(), 4))
        assert isinstance(reply, wire.ErrorReply)
        assert "larger than this publisher holds" in reply.message, reply.message
        forged = register_parts(half_plan(0), "0" * 32, 5)
        reply = _ask(sock, *forged)
        assert isinstance(reply, wire.ErrorReply) and "slice_reg.digest" in reply.message
        reply = _ask(sock, SliceSums(req=6, publisher_id=pub.publisher_id, version=version,
                                     digest="1" * 32))
        assert isinstance(reply, wire.ErrorReply) and reply.code == "unknown_plan"
    # still serving: a good plan stages
    sub = make_sub(pub.endpoint, slice_plan=half_plan(0))
    check_staged(sub.wait_for_version(version, timeout=60), version, 0)
    # a plan for another model: the subscriber says so and stages nothing
    other = make_sub(pub.endpoint, slice_plan=from_ranges("x", {"missing.weight": [(0, 4)]}))
    wait_until(lambda: other.status()["last_error"], 30, "the plan refused")
    assert "'missing.weight' is not a tensor of version 1" in other.status()["last_error"]
    assert other.latest() is None


def _sharded_plan() -> SlicePlan:
    """Half of every row of rank 0's ``layers.0.w`` and rank 1's ``head`` whole
    (``test_sharded.SPECS``): about a quarter of the union."""
    row = 17 * 4
    return from_ranges("tp2/rank0", {"layers.0.w": [(i * row, i * row + row // 2)
                                                    for i in range(300)],
                                     "head": [(0, 77 * 40 * 2)]})


def _check_sharded(staged: StagedVersion, version: int, specs: list[Any]) -> None:
    from tests.transport.test_sharded import SEED as SHARD_SEED

    want: dict[str, torch.Tensor] = {}
    for spec in specs:
        want.update(det_weights(SHARD_SEED, version, [(n, d, tuple(s)) for n, d, s in spec]))
    got = staged.tensors["layers.0.w"]
    assert torch.equal(as_bytes(got[:, :8]), as_bytes(want["layers.0.w"][:, :8]))
    assert not as_bytes(got[:, 9:]).any()  # the other half of each row: never asked
    assert torch.equal(as_bytes(staged.tensors["head"]), as_bytes(want["head"]))
    assert not as_bytes(staged.tensors["layers.1.w"]).any()  # untouched: never asked


def test_sharded_trainer_ranks_serve_only_their_part_of_the_plan_as_slices(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    """Four real rank processes; the plan reads tensors of ranks 0 and 1 only. Each of
    those is asked its own part (computed from the union's ranges), sends exactly those
    bytes as slices verified against its own sums; ranks 2 and 3 are never dialled."""
    from tests.transport.test_sharded import SPECS4, _publish, _start_ranks

    ranks, ready0 = _start_ranks(spawn, SPECS4)
    plan = _sharded_plan()
    sub = make_sub(ready0["announce"], slice_plan=plan, request_timeout=2.0)
    for version in (1, 2):
        _publish(ranks, version)
        staged = sub.wait_for_version(version, timeout=60)
        _check_sharded(staged, version, SPECS4)
        staged.release()
    share = sub.status()["slice_plan"]
    assert share["fallbacks"] == {} and share["whole_chunk_bytes"] == 0, share
    assert 2 * plan.needed_bytes <= share["slice_bytes"] < share["version_bytes"] // 2, share
    sub.mark_applied(2)  # its bytes came from the trainer ranks, counted as theirs
    wait_until(lambda s=sub: s.status()["applied_received"] is not None, 30,
                   "applied")
    assert set(sub.status()["applied_received"]["by_source"]) == {"shard_ranks"}
    sent = [rank.request("status") for rank in ranks]
    parts = [300 * 34, 77 * 40 * 2, 0, 0]  # each rank's part of the plan, per version
    for rank, status in enumerate(sent):
        assert 2 * parts[rank] <= status["slice_bytes_sent"] < 3 * parts[rank] + 1, (rank, status)
        assert status["bytes_sent"] <= status["slice_bytes_sent"], (rank, status)  # no whole
    assert sum(s["slice_bytes_sent"] for s in sent) < 0.5 * 2 * share["version_bytes"]


def test_a_sharded_rank_without_slices_serves_its_touched_chunks_whole(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    """Rank 1 drops slice requests (as a rank before issue 30 does): it serves its touched
    chunks whole (cause ``sharded``, the rank named), rank 0 still serves slices, and the
    planned bytes are right."""
    from tests.transport.test_sharded import CHUNK as SHARD_CHUNK
    from tests.transport.test_sharded import SEED as SHARD_SEED
    from tests.transport.test_sharded import SPECS, _publish

    ranks = [spawn("shard_rank", forked=True, rank=0, world_size=2, spec=SPECS[0],
                   seed=SHARD_SEED, chunk_size=SHARD_CHUNK,
                   announce_endpoint="tcp://127.0.0.1:0")]
    ready0 = ranks[0].event("ready", timeout=60)
    ranks.append(spawn("shard_rank", forked=True, rank=1, world_size=2, spec=SPECS[1],
                       seed=SHARD_SEED, chunk_size=SHARD_CHUNK, coordinator=ready0["collect"],
                       no_slices=True))
    ranks[1].event("ready", timeout=60)
    sub = make_sub(ready0["announce"], slice_plan=_sharded_plan(), request_timeout=0.5)
    _publish(ranks, 1)
    _check_sharded(sub.wait_for_version(1, timeout=60), 1, SPECS)
    share = sub.status()["slice_plan"]
    assert share["fallbacks"] == {"sharded": 1}, share
    assert "trainer rank 1" in share["last_refusal"] and "no_answer" in share["last_refusal"]
    assert 77 * 40 * 2 <= share["whole_chunk_bytes"] <= 3 * SHARD_CHUNK, share  # head's
    assert 300 * 34 <= share["slice_bytes"] < 2 * 300 * 34, share
    sent = [rank.request("status") for rank in ranks]
    assert sent[1]["slice_bytes_sent"] == 0 and sent[1]["bytes_sent"] > 0


def test_kill9_of_a_sharded_rank_mid_slices_stages_nothing_partial(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    """Rank 1 is killed (-9) as it sends its first slice of version 2: the version is
    given up naming the rank, and the subscriber keeps version 1 (nothing partial)."""
    from tests.transport.test_sharded import CHUNK as SHARD_CHUNK
    from tests.transport.test_sharded import SEED as SHARD_SEED
    from tests.transport.test_sharded import SPECS, _publish

    ranks = [spawn("shard_rank", forked=True, rank=0, world_size=2, spec=SPECS[0],
                   seed=SHARD_SEED, chunk_size=SHARD_CHUNK,
                   announce_endpoint="tcp://127.0.0.1:0")]
    ready0 = ranks[0].event("ready", timeout=60)
    ranks.append(spawn("shard_rank", forked=True, rank=1, world_size=2, spec=SPECS[1],
                       seed=SHARD_SEED, chunk_size=SHARD_CHUNK, coordinator=ready0["collect"],
                       die_serving=2))
    ranks[1].event("ready", timeout=60)
    sub = make_sub(ready0["announce"], slice_plan=_sharded_plan(), request_timeout=0.5)
    _publish(ranks, 1)
    _check_sharded(sub.wait_for_version(1, timeout=60), 1, SPECS)
    _publish(ranks, 2)
    wait_until(lambda: "trainer rank 1" in (sub.status()["last_error"] or ""), 30,
               "version 2 given up, naming rank 1")
    latest = sub.latest()
    assert latest is not None and latest.version == 1
    _check_sharded(latest, 1, SPECS)
    assert sub.status()["slice_plan"]["fallbacks"] == {}


def test_more_plans_than_the_publisher_holds_still_stage_right(
        make_pub: Callable[..., WeightPublisher],
        make_sub: Callable[..., WeightSubscriber]) -> None:
    """Two plans, room for one: each eviction is answered ``unknown_plan``, the subscriber
    registers again, and one that keeps being evicted fetches whole chunks (``evicted``)."""
    pub = make_pub(chunk_size=CHUNK, limits=ServerLimits(slices=SliceLimits(max_plans=1)))
    subs = [make_sub(pub.endpoint, slice_plan=half_plan(rank), request_timeout=1.0)
            for rank in (0, 1)]
    for version in (1, 2):
        pub.publish(det_weights(SEED, version, SPEC), version=version)
        for rank, sub in enumerate(subs):
            staged = sub.wait_for_version(version, timeout=60)
            check_staged(staged, version, rank)
            staged.release()
    for sub in subs:
        assert set(sub.status()["slice_plan"]["fallbacks"]) <= {"evicted"}
