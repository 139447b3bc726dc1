"""Slices over NIXL (issues 30 and 31): a sliced subscriber READs only its plan's byte
ranges one-sided when the manifest offers NIXL.

A publisher process with ``nixl=True`` and two subscribers here with complementary
plans (``test_slice_fetch.half_plan``), real NIXL agents (UCX on loopback). What must
hold: each staged version equals the published one on the plan's bytes and reads
zeros elsewhere, the publisher sends no chunk or slice frame (every planned byte
READ one-sided, verified against the slice sums it serves), each subscriber READs
its plan's bytes and not the version; a corrupted region costs that chunk as a
ZeroMQ slice, counted as ``checksum``, never a wrong byte staged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from subscriber_ext import WeightSubscriber
from tests.transport.procs import Child, as_bytes, det_weights, spec_bytes, wait_until
from tests.transport.test_slice_fetch import SEED, SPEC, WHOLE, half_plan
from weightpub_wire.nixl_link import nixl_error

pytestmark = [pytest.mark.timeout(180)]

CHUNK = 256 << 10


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    assert nixl_error() is None, nixl_error()  # a test dependency: installed in CI
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # children inherit it


def _publisher(spawn: Callable[..., Child], **args: Any) -> tuple[Child, str]:
    child = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=SEED, chunk_size=CHUNK,
                  nixl=True, **args)
    return child, child.event("ready", timeout=60)["endpoint"]


def _publish(pub: Child, version: int) -> None:
    pub.request("publish", timeout=60, version=version, spec=SPEC)


def _check(staged: Any, version: int, rank: int) -> None:
    """Planned bytes equal the published ones; the rest reads zeros (never written)."""
    want = det_weights(SEED, version, SPEC)
    for name, tensor in want.items():
        got = staged.tensors[name]
        if tensor.dim() != 2 or name in WHOLE:
            assert as_bytes(got).equal(as_bytes(tensor)), name
            continue
        half = tensor.shape[1] // 2
        mine = slice(rank * half, (rank + 1) * half)
        other = slice((1 - rank) * half, (2 - rank) * half)
        assert as_bytes(got[:, mine]).equal(as_bytes(tensor[:, mine])), (name, rank)
        assert not as_bytes(got[:, other]).any(), (name, rank)


def test_each_plan_reads_only_its_slices_over_nixl(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    pub, endpoint = _publisher(spawn)
    subs = [make_sub(endpoint, slice_plan=half_plan(rank), request_timeout=5.0)
            for rank in (0, 1)]
    for version in (1, 2):
        _publish(pub, version)
        for rank, sub in enumerate(subs):
            staged = sub.wait_for_version(version, timeout=60)
            assert staged.data_path == "nixl"
            _check(staged, version, rank)
            staged.release()
    stats = pub.request("stats")["stats"]
    assert stats["bytes_sent_full"] == 0 and stats["bytes_sent_slices"] == 0, stats
    total = spec_bytes(SPEC)
    for sub in subs:
        status = sub.status()
        nixl, plan = status["nixl"], status["slice_plan"]
        assert nixl["fallbacks"] == 0, nixl
        # its own bytes, twice, and not the version's
        assert nixl["bytes_read"] == 2 * plan["needed_bytes"] < 2 * 0.7 * total
        assert plan["slice_bytes"] == 2 * plan["needed_bytes"] and plan["fallbacks"] == {}
        sub.mark_applied(2)  # what version 2 cost: its plan, read one-sided
        wait_until(lambda s=sub: s.status()["applied_received"] is not None, 30,
                   "applied")
        assert sub.status()["applied_received"]["by_source"] == {"nixl": plan["needed_bytes"]}


def test_a_corrupted_slice_is_refetched_as_a_zeromq_slice(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    pub, endpoint = _publisher(spawn, nixl_fault="corrupt:1")  # in rank 0's half rows
    sub = make_sub(endpoint, slice_plan=half_plan(0), request_timeout=5.0)
    _publish(pub, 1)
    staged = sub.wait_for_version(1, timeout=60)
    _check(staged, 1, 0)  # the torn chunk never staged
    assert staged.data_path == "nixl+zmq"
    status = sub.status()
    assert status["checksum_failures"] == 1
    assert status["nixl"]["fallback_causes"] == {"checksum": 1}
    stats = pub.request("stats")["stats"]
    plan = status["slice_plan"]
    assert stats["bytes_sent_full"] == 0  # the one chunk came as a ZeroMQ slice
    assert 0 < stats["bytes_sent_slices"] <= CHUNK // 2 < plan["needed_bytes"]
