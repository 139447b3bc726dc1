"""A >= 512 MiB version moves between two processes bit-exact."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.transport.procs import Child, det_weights, digests, spec_bytes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SEED = 512
SPEC = [
    ("big", "bfloat16", [16384, 16384]),  # 512 MiB on its own
    ("tail.odd", "float32", [1000, 3]),
    ("tail.scalar", "int64", []),
]


def test_half_gigabyte_version_across_processes(spawn: Callable[..., Child]) -> None:
    assert spec_bytes(SPEC) >= 512 << 20
    pub = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=SEED, chunk_size=4 << 20)
    endpoint = pub.event("ready", timeout=60)["endpoint"]
    sub = spawn("subscriber", endpoint=endpoint)
    sub.event("ready", timeout=60)
    published = pub.request("publish", timeout=120, version=1, spec=SPEC)
    assert published["version"] == 1

    # computed here, independently of both children, from (seed, version, name) alone
    weights = det_weights(SEED, 1, SPEC)
    expected = digests(weights.items())
    del weights

    got = sub.event("staged", timeout=120, version=1)
    assert got["publisher_id"] == published["publisher_id"]
    assert got["total_bytes"] >= spec_bytes(SPEC)
    assert got["shapes"] == {name: shape for name, _, shape in SPEC}
    assert got["digests"] == expected
