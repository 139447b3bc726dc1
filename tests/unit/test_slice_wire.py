"""Slice plans on the wire (issue 30): compression, digest, bounded decoding, layouts,
registration in parts, and what the publisher's slice serving holds."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import pytest

from publisher.serving.slice_serving import SliceLimits, SliceServing
from subscriber_ext.transport.client.slice_source import register_parts
from weightpub_wire import protocol as wire
from weightpub_wire.errors import ProtocolError
from weightpub_wire.slice_layout import SliceLayout
from weightpub_wire.slice_messages import MAX_PART_BYTES, SliceAck
from weightpub_wire.slice_plan import (
    SlicePlan,
    SliceRuns,
    decode_plan,
    encode_plan,
    from_ranges,
    needed_bytes,
)


def half_rows(rows: int, row: int, rank: int) -> list[tuple[int, int]]:
    half = row // 2
    return [(i * row + rank * half, i * row + (rank + 1) * half) for i in range(rows)]


def test_a_row_parallel_slice_is_one_run_per_matrix() -> None:
    plan = from_ranges("tp2/rank1", {"w": half_rows(4096, 8192, 1), "b": [(0, 64)]})
    assert [t.tensor for t in plan.tensors] == ["b", "w"]  # by name: a stable digest
    assert plan.tensors[1].runs == [(4096, 4096, 8192, 4096)]
    assert plan.tensors[0].runs == [(0, 64, 0, 1)]
    assert needed_bytes(plan) == plan.needed_bytes == 4096 * 4096 + 64
    # adjacent and overlapping ranges merge; the digest does not depend on dict order
    again = from_ranges("tp2/rank1", {"b": [(0, 32), (16, 64)], "w": half_rows(4096, 8192, 1)})
    assert again.digest() == plan.digest() and len(plan.digest()) == 32
    assert from_ranges("tp2/rank0", {"b": [(0, 64)]}).digest() != \
        from_ranges("tp2/rank1", {"b": [(0, 64)]}).digest()


@pytest.mark.parametrize(("runs", "what"), [
    ([(0, 10, 0, 1), (5, 10, 0, 1)], "runs[1]: starts at byte 5, inside the previous run"),
    ([(0, 0, 0, 1)], "runs[0]: empty run"),
    ([(0, 10, 4, 3)], "runs[0]: stride 4 below length 10"),
])
def test_bad_runs_are_refused_naming_the_run(runs: list[Any], what: str) -> None:
    raw = msgspec.msgpack.encode({"layout": "x", "tensors": [["t", runs]]})
    with pytest.raises(ProtocolError, match=r"tensors\[0\]\." + what.replace("[", r"\[")
                       .replace("]", r"\]")):
        decode_plan(raw)


def test_decoding_is_bounded_and_names_what_is_wrong() -> None:
    twice = msgspec.msgpack.encode({"layout": "x", "tensors": [["t", []], ["t", []]]})
    with pytest.raises(ProtocolError, match="'t' is listed twice"):
        decode_plan(twice)
    with pytest.raises(ProtocolError, match="exceeds 16"):
        decode_plan(b"\x00" * 17, max_bytes=16)
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        decode_plan(b"\xc1")
    negative = msgspec.msgpack.encode({"layout": "x", "tensors": [["t", [[-1, 1, 0, 1]]]]})
    with pytest.raises(ProtocolError, match="slice_plan"):
        decode_plan(negative)
    plan = from_ranges("x", {"t": [(0, 8)]})
    assert decode_plan(encode_plan(plan)) == plan


def _manifest(tensors: list[tuple[str, int]], chunk: int) -> wire.Manifest:
    entries, offset = [], 0
    for name, nbytes in tensors:
        entries.append(wire.TensorEntry(name, "uint8", (nbytes,), offset, nbytes))
        offset = -(-(offset + nbytes) // 64) * 64
    return wire.Manifest(publisher_id="p", started_at=1.0, version=1, created_at=1.0,
                         chunk_size=chunk, total_bytes=offset, tensors=tuple(entries),
                         checksums=(0,) * -(-offset // chunk))


def test_layouts_gather_and_scatter_exactly_the_planned_bytes() -> None:
    """Against a byte mask, over random tensors, chunk sizes and plans (rows that straddle
    chunks, rows longer than a chunk, whole tensors, scattered ranges)."""
    rng = random.Random(30)
    for _ in range(60):
        chunk = 4096
        sizes = [(f"t{i}", rng.choice([8, 100, 512, 3000, 9000]) * rng.randint(1, 40))
                 for i in range(rng.randint(1, 4))]
        manifest = _manifest(sizes, chunk)
        ranges: dict[str, list[tuple[int, int]]] = {}
        for (name, nbytes), entry in zip(sizes, manifest.tensors, strict=True):
            kind = rng.randint(0, 2)
            if kind == 0:
                row = next(r for r in (9000, 3000, 512, 100, 8) if nbytes % r == 0)
                ranges[name] = half_rows(nbytes // row, row, rng.randint(0, 1))
            elif kind == 1:
                ranges[name] = [(0, entry.nbytes)]
            else:
                ranges[name] = [(a, min(nbytes, a + rng.randint(1, 50)))
                                for a in sorted(rng.sample(range(nbytes), min(nbytes, 5)))]
        plan = from_ranges("x", ranges)
        layout = SliceLayout.build(plan, manifest)
        source = np.frombuffer(rng.randbytes(manifest.total_bytes), dtype=np.uint8)
        mask = np.zeros(manifest.total_bytes, dtype=bool)
        for entry in manifest.tensors:
            for start, end in ranges[entry.name]:
                mask[entry.offset + start: entry.offset + end] = True
        sliced = np.zeros_like(source)
        whole = np.zeros_like(source)
        for index in layout.chunks:
            layout.scatter(index, layout.gather(index, source), sliced)
            start = index * chunk
            layout.scatter(index, source[start: start + chunk], whole, chunk_start=start)
        expected = np.where(mask, source, 0)
        assert (sliced == expected).all() and (whole == expected).all()
        assert layout.needed_bytes == int(mask.sum()) == plan.needed_bytes
        touched = {i // chunk for i in np.flatnonzero(mask)}
        assert set(layout.chunks) == touched  # a chunk the plan misses is never asked
        assert layout.resident_bytes <= -(-manifest.total_bytes // 4096) * 4096


def test_a_plan_for_another_model_is_refused_by_the_layout() -> None:
    manifest = _manifest([("a", 1000)], 4096)
    with pytest.raises(ProtocolError, match="'b' is not a tensor of version 1"):
        SliceLayout.build(from_ranges("x", {"b": [(0, 4)]}), manifest)
    with pytest.raises(ProtocolError, match="ends at byte 1004, past the 1000 bytes"):
        SliceLayout.build(from_ranges("x", {"a": [(1000, 1004)]}), manifest)


class _Replies:
    def __init__(self) -> None:
        self.messages: list[Any] = []

    def __call__(self, identity: bytes, body: bytes) -> bool:
        self.messages.append(wire.decode(body, expect=(wire.ErrorReply, SliceAck)))
        return True


def _serving(**limits: int) -> tuple[SliceServing, _Replies]:
    replies = _Replies()
    serving = SliceServing(None, "p", lambda *a: True, replies,  # type: ignore[arg-type]
                           limits=SliceLimits(**limits))
    return serving, replies


def test_a_large_plan_registers_in_parts_and_a_tensor_may_span_them() -> None:
    rng = random.Random(3)
    ranges = {f"layer.{i}": sorted({(a, a + 1 + a % 5) for a in
                                    rng.sample(range(0, 10**7, 8), 3000)})
              for i in range(4)}
    plan = from_ranges("big", ranges)
    parts = register_parts(plan, plan.digest(), 7)
    assert len(parts) > 4  # more parts than tensors: tensors continue across parts
    assert all(len(wire.encode(p)) <= MAX_PART_BYTES for p in parts)
    serving, replies = _serving()
    for part in reversed(parts):  # any order
        serving.handle(b"id", part, len(wire.encode(part)))
    assert [type(m) for m in replies.messages] == [SliceAck]
    assert replies.messages[0].needed_bytes == plan.needed_bytes
    assert serving.plans == 1 and serving.held > 0
    serving.handle(b"id", parts[-1], 1)  # registered already: acked again, held once
    assert len(replies.messages) == 2 and serving.plans == 1


def test_plans_held_are_bounded_least_recently_used_first() -> None:
    serving, replies = _serving(max_plans=2)
    plans = [from_ranges(f"p{i}", {"t": [(0, 8 + i)]}) for i in range(3)]
    for plan in plans:
        for part in register_parts(plan, plan.digest(), 1):
            serving.handle(b"id", part, 100)
    assert serving.plans == 2
    assert plans[0].digest() not in serving._plans  # the oldest went
    assert all(isinstance(m, SliceAck) for m in replies.messages)
    whole = SlicePlan("w", [SliceRuns("t", [(0, 8, 0, 1)])])
    assert whole.digest() != plans[0].digest()


def test_sparse_staging_counts_its_share_and_is_reused_only_for_the_same_plan() -> None:
    from weightpub_wire.buffers import BufferPool
    from weightpub_wire.errors import StagingBudgetError

    pool = BufferPool(max_buffers=2, budget_bytes=1 << 20, pinned=False)
    buffer = pool.take_sparse(64 << 20, 256 << 10, "plan-a")  # a 64 MiB view, 256 KiB counted
    assert buffer.numel() == 64 << 20 and pool.held_bytes == 256 << 10
    buffer[-1] = 7
    address = buffer.data_ptr()
    pool.give(buffer)
    assert pool.held_bytes == 256 << 10  # idle, kept for the same plan
    again = pool.take_sparse(64 << 20, 256 << 10, "plan-a")
    assert again.data_ptr() == address and again[-1] == 7  # the plan rewrites its bytes
    other = pool.take_sparse(64 << 20, 256 << 10, "plan-b")
    assert other.data_ptr() != address and not other[-1]  # another plan: fresh zeros
    with pytest.raises(StagingBudgetError, match="sparse staging"):
        pool.take_sparse(64 << 20, 600 << 10, "plan-c")
    pool.give(again)
    pool.give(other)
    assert pool.room_for(900 << 10)  # idle sparse buffers are dropped for room
    assert pool.held_bytes <= 256 << 10
