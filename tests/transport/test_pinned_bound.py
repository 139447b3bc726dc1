"""Page-locked staging is bounded: a peer's ``total_bytes`` never decides how much RAM is pinned."""

from __future__ import annotations

import os

import pytest

from subscriber_ext import SubscriberConfig, WeightSubscriber
from weightpub_wire.buffers import BufferPool
from weightpub_wire.protocol import Limits

pytestmark = pytest.mark.timeout(30)


def test_pool_pins_only_buffers_within_the_bound() -> None:
    pool = BufferPool(pinned=True, max_pinned_bytes=1 << 20)
    assert pool.will_pin(1 << 20) and not pool.will_pin((1 << 20) + 1)
    big = pool.take(4 << 20)  # over the bound: pageable, even though pinning is on
    assert not big.is_pinned() and big.numel() == 4 << 20
    assert not BufferPool(pinned=False, max_pinned_bytes=1 << 30).will_pin(1)


def test_subscriber_limits_reach_its_staging_pool_and_defaults_follow_memory() -> None:
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    defaults = Limits()
    assert defaults.max_total_bytes == memory and defaults.max_pinned_bytes == memory // 4
    with WeightSubscriber("tcp://127.0.0.1:1", limits=Limits(max_pinned_bytes=123 << 20),
                          max_version_bytes=1 << 30) as sub:
        assert sub._client.pool.max_pinned_bytes == 123 << 20
        assert sub._client.options.limits.max_total_bytes == 1 << 30
        assert sub._client.options.limits.max_pinned_bytes == 123 << 20  # kept
    # the YAML default no longer allows 1 TiB: without max_version_gib the limit is RAM
    kwargs = SubscriberConfig(endpoint="tcp://h:1").subscriber_kwargs()
    assert "max_version_bytes" not in kwargs
    assert SubscriberConfig(endpoint="tcp://h:1", max_version_gib=2).subscriber_kwargs()[
        "max_version_bytes"] == 2 << 30
