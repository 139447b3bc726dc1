"""``BudgetGate`` alone: start, wait or refuse a version before its buffer is allocated.

The pool is a real ``BufferPool`` with a small budget (a few KiB of host memory);
the buffers a consumer still holds are taken from it and given back by the test,
and a delta base is a ``HeldBase`` whose ``let_go`` counts its releases.
"""

from __future__ import annotations

import pytest

from subscriber_ext.transport.staging.budget_gate import BudgetGate
from subscriber_ext.transport.staging.delta_assembly import DeltaState, HeldBase
from tests.unit.transport_fakes import CHUNK, NEW, OLD, manifest
from weightpub_wire.buffers import BufferPool, byte_view
from weightpub_wire.errors import StagingBudgetError

pytestmark = pytest.mark.timeout(10)


def gate(budget_chunks: int) -> tuple[BudgetGate, BufferPool, DeltaState]:
    pool = BufferPool(pinned=False, budget_bytes=budget_chunks * CHUNK)
    deltas = DeltaState()
    return BudgetGate(pool, deltas), pool, deltas


def test_a_version_that_fits_starts() -> None:
    g, pool, _ = gate(8)
    assert g.admit(manifest(1, chunks=8))
    assert g.waiting is None and g.refused is None
    assert pool.held_bytes == 0  # the gate decides; it allocates nothing


def test_a_version_larger_than_the_budget_is_refused_before_allocation() -> None:
    g, pool, _ = gate(4)
    too_big = manifest(3, chunks=5)
    assert not g.admit(too_big)
    assert isinstance(g.refused, StagingBudgetError)
    assert "version 3 refused before allocating" in str(g.refused)
    assert str(5 * CHUNK) in str(g.refused)  # it names the size needed
    assert g.is_refused(too_big) and g.waiting is None
    assert pool.held_bytes == 0
    assert not g.is_refused(manifest(3, NEW, chunks=5))  # refusals are per instance
    assert g.held_back(OLD) == 3 and g.held_back(NEW) == 0


def test_a_version_that_fits_once_held_buffers_return_waits_then_starts() -> None:
    g, pool, _ = gate(8)
    held = pool.take(6 * CHUNK)  # a staged version the consumer has not released
    version = manifest(2, chunks=4)
    assert not g.admit(version)
    assert g.waiting is version and g.refused is None
    assert g.held_back(OLD) == 2
    taken = g.take_waiting()  # the client tries it again on each tick
    assert taken is version and g.waiting is None
    assert not g.admit(version)  # still held: it waits again
    pool.give(held)  # the consumer releases it
    assert g.admit(version)
    assert g.waiting is None and g.take_waiting() is None
    assert pool.held_bytes <= 6 * CHUNK  # an idle buffer may be kept for reuse, no more


def test_the_delta_base_is_given_up_when_only_it_stands_in_the_way() -> None:
    g, pool, deltas = gate(8)
    buffer = pool.take(6 * CHUNK)
    released: list[int] = []

    def let_go() -> None:
        released.append(1)
        pool.give(buffer)

    base_manifest = manifest(1, chunks=6)
    deltas.base = HeldBase(manifest=base_manifest, digest=0, buffer=buffer,
                           view=byte_view(buffer, 6 * CHUNK), let_go=let_go)
    assert g.admit(manifest(2, chunks=4))
    assert released == [1] and deltas.base is None


def test_the_delta_base_is_kept_when_the_version_fits_beside_it() -> None:
    g, pool, deltas = gate(8)
    buffer = pool.take(2 * CHUNK)
    released: list[int] = []
    deltas.base = HeldBase(manifest=manifest(1, chunks=2), digest=0, buffer=buffer,
                           view=byte_view(buffer, 2 * CHUNK), let_go=lambda: released.append(1))
    assert g.admit(manifest(2, chunks=4))
    assert released == [] and deltas.base is not None


def test_a_staged_version_makes_the_refusal_history_but_not_the_refused_version() -> None:
    g, _, _ = gate(4)
    too_big = manifest(3, chunks=5)
    assert not g.admit(too_big)
    refusal = g.refused
    assert g.staged() is refusal and g.refused is None
    assert g.staged() is None
    assert g.is_refused(too_big)  # that version still never fits: not tried again
