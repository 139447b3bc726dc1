"""Optional section: bytes on the wire for RL-like steps, delta versions vs full versions.

A bf16 model (square matrices, N(0, 0.02)) trained with fp32 master weights and
``torch.optim.AdamW`` on random gradients; every step publishes the bf16 cast to
two publishers, ``full`` (``delta_anchor_every=1``) and ``delta`` (64), each
followed by its own subscriber in this process. Bytes are the publishers' own
chunk payload counters (``data_stats()``, the ``weightpub_publisher_served_*``
metrics); every staged version is compared bit for bit with what was published.
``benchmarks/delta.py`` measures the same from outside, through a byte-counting
relay and in other processes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["run_delta"]


def run_delta(mib: int, steps: int, lr: float, tick: Callable[[], None]) -> dict[str, Any]:
    from publisher import WeightPublisher
    from subscriber_ext import WeightSubscriber

    side = 1024
    n = max(1, (mib << 20) // (side * side * 2))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(side, side, generator=gen) * 0.02)
              for _ in range(n)]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    modes = {"full": 1, "delta": 64}
    pubs = {m: WeightPublisher("tcp://127.0.0.1:0", delta_anchor_every=a)
            for m, a in modes.items()}
    subs = {m: WeightSubscriber(p.endpoint) for m, p in pubs.items()}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    exact = True
    try:
        for step in range(steps + 1):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            weights = {f"w{i}": p.detach().to(torch.bfloat16) for i, p in enumerate(params)}
            order = list(modes) if step % 2 == 0 else list(reversed(modes))
            for mode in order:
                t0 = time.perf_counter()
                version = pubs[mode].publish(weights)
                staged = subs[mode].wait_for_version(version, timeout=300)
                took = time.perf_counter() - t0
                exact &= all(torch.equal(staged.tensors[k], v) for k, v in weights.items())
                staged.release()
                if step:  # step 0 is the anchor both ways
                    seconds[mode].append(took)
            tick()
        stats = {m: pubs[m].data_stats() for m in modes}
    finally:
        for sub in subs.values():
            sub.close()
        for pub in pubs.values():
            pub.close()
    total = n * side * side * 2
    full_bytes = stats["full"]["bytes_sent_full"] - total  # minus the first version
    delta_bytes = stats["delta"]["bytes_sent_delta"] + stats["delta"]["bytes_sent_full"] - total
    return {
        "mib": mib, "steps": steps, "lr": lr, "bit_exact": exact,
        "bytes_ratio": delta_bytes / max(full_bytes, 1),
        "time_ratio": statistics.median(seconds["delta"]) / statistics.median(seconds["full"]),
        "seconds": seconds, "target": {"bytes_ratio": 0.1},
    }
