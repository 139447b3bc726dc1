"""The same-host data path (``ipc://``) and the staging memory a subscriber keeps.

Why: a replica on the trainer's host may use a Unix socket instead of loopback TCP
(``docs/benchmarks.md`` has the speeds); and a subscriber keeps its newest version
as a delta base only when its publisher serves deltas, else every version would
cost two staging buffers (and their first-touch page faults).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.procs import Child, as_bytes, digests, roundtrip_case, scribble

pytestmark = pytest.mark.timeout(90)


def test_ipc_endpoint_carries_versions_bit_exact_to_another_process(
    make_pub: Callable[..., WeightPublisher], spawn: Callable[..., Child], tmp_path: Path,
) -> None:
    pub = make_pub(f"ipc://{tmp_path}/weights", chunk_size=4096)
    assert pub.endpoint == f"ipc://{tmp_path}/weights"
    sub = spawn("subscriber", endpoint=pub.endpoint, verify="roundtrip")
    sub.event("ready", timeout=60)
    sent = 0
    for version in (1, 2):
        source, expected, originals = roundtrip_case(version)
        sent += sum(t.numel() * t.element_size() for t in expected.values())
        assert pub.publish(source) == version
        scribble(originals)  # the snapshot, not the caller's tensors, is what travels
        got = sub.event("staged", timeout=30, version=version)
        assert got["mismatches"] == [], got["mismatches"]
        assert got["digests"] == digests(expected.items())
    status = sub.request("status")["status"]
    assert status["state"] == "ACTIVE"
    assert status["last_error"] is None
    assert status["received_bytes"] >= sent  # tensors plus their alignment padding


def _staging_after_three_versions(make_pub: Callable[..., WeightPublisher],
                                  make_sub: Callable[..., WeightSubscriber],
                                  anchor_every: int) -> tuple[dict, int]:
    pub = make_pub(chunk_size=1 << 16, delta_anchor_every=anchor_every)
    sub = make_sub(pub.endpoint)
    weights = {"w": torch.arange(1 << 18, dtype=torch.int32)}  # 1 MiB
    for version in (1, 2, 3):
        weights["w"][version] += 1
        pub.publish(weights)
        staged = sub.wait_for_version(version, timeout=30)
        assert torch.equal(as_bytes(staged.tensors["w"]), as_bytes(weights["w"]))
        staged.release()
    return sub.status(), pub.manifest(3).total_bytes


def test_no_delta_base_is_kept_when_the_publisher_sends_no_deltas(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    status, nbytes = _staging_after_three_versions(make_pub, make_sub, anchor_every=1)
    assert status["delta_base_version"] is None
    # every version reused the one buffer released before it: one version of staging
    assert status["staging_bytes"] == nbytes


def test_a_delta_base_is_kept_when_the_publisher_announces_deltas(
    make_pub: Callable[..., WeightPublisher], make_sub: Callable[..., WeightSubscriber],
) -> None:
    status, nbytes = _staging_after_three_versions(make_pub, make_sub, anchor_every=8)
    assert status["delta_base_version"] == 3
    assert status["versions_delta"] == 2  # versions 2 and 3 came as deltas
    assert status["staging_bytes"] == 2 * nbytes  # the base and the buffer reused next
