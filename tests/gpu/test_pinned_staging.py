"""On CUDA, staging buffers are pinned up to ``Limits.max_pinned_bytes`` and pageable above."""

from __future__ import annotations

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from weightpub_wire.protocol import Limits

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staging_is_pinned_only_within_the_bound() -> None:
    small = {"w": torch.randn(1 << 16)}  # 256 KiB
    large = {"w": torch.randn(1 << 20)}  # 4 MiB
    with WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) as pub, \
            WeightSubscriber(pub.endpoint, limits=Limits(max_pinned_bytes=1 << 20)) as sub:
        first = sub.wait_for_version(pub.publish(small), timeout=30)
        assert first.buffer.is_pinned() and torch.equal(first.tensors["w"], small["w"])
        second = sub.wait_for_version(pub.publish(large), timeout=30)
        assert not second.buffer.is_pinned() and torch.equal(second.tensors["w"], large["w"])
        assert torch.equal(second.tensors["w"].cuda().cpu(), large["w"])
