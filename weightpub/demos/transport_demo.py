"""Transport-only demo: publish a few versions of a small model to a subscriber process.

No vLLM needed. Prints, per version, how long ``publish()`` blocked the
trainer, the publish -> staged latency seen by the other process, and the
effective throughput.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import torch

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber

__all__ = ["run_transport_demo"]


def _small_model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = [torch.nn.Embedding(4096, hidden)]
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)]
    return torch.nn.Sequential(*blocks).to(torch.bfloat16)


def _subscriber_process(endpoint: str, versions: int, conn: Connection) -> None:
    with WeightSubscriber(endpoint) as sub:
        conn.send(("ready", 0, 0.0, 0.0))
        seen = 0
        while seen < versions:
            staged = sub.wait_for_version(seen + 1, timeout=120)
            staged_at = time.time()
            checksum = float(sum(t.float().sum().item() for t in staged.tensors.values()))
            conn.send(("staged", staged.version, staged_at, checksum))
            seen = staged.version
            staged.release()


def run_transport_demo(versions: int = 5, hidden: int = 1024, layers: int = 4) -> None:
    model = _small_model(hidden, layers)
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    print(f"model: {nbytes / 1e6:.1f} MB bf16, {versions} versions, subscriber in another process")
    parent, child = mp.Pipe()
    with WeightPublisher("tcp://127.0.0.1:0", model_id="demo-mlp") as pub:
        proc = mp.get_context("spawn").Process(target=_subscriber_process,
                                               args=(pub.endpoint, versions, child))
        proc.start()
        if not parent.poll(60):
            raise TimeoutError("subscriber process did not start")
        parent.recv()
        print(f"{'version':>7} {'publish() ms':>13} {'-> staged ms':>13} {'GB/s':>6}  checksum ok")
        for _ in range(versions):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-3)  # a "training step"
            expected = float(sum(t.float().sum().item() for t in model.state_dict().values()))
            start = time.time()
            version = pub.publish(model)
            blocked = time.time() - start
            if not parent.poll(120):
                raise TimeoutError(f"version {version} not staged within 120 s")
            _, got, staged_at, checksum = parent.recv()
            latency = staged_at - start
            print(f"{got:>7} {blocked * 1e3:>13.1f} {latency * 1e3:>13.1f} "
                  f"{nbytes / latency / 1e9:>6.2f}  {checksum == expected}")
        proc.join(30)
    print("done: every version arrived complete and verified (xxh3 per 4 MiB chunk)")
