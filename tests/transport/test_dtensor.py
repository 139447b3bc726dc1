"""FSDP/TP-sharded DTensors are published whole: rank 0 publishes, the others gather.

The two gloo ranks are forked from the tests' torch-preloaded forkserver
(``tests/transport/zygote.py``): a spawned rank spends seconds importing torch.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import pytest
import torch

from subscriber_ext import WeightSubscriber
from tests.transport.zygote import PRELOAD
from weightpub.bench.forked import forkserver


def _rank(rank: int, store: str, conn) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from publisher import WeightPublisher, gather_full_tensors

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=90))
    code = 0
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)  # same full tensor on both ranks; each keeps half
        full = torch.randn(16, 8).to(torch.bfloat16)
        weights = {"layer.weight": distribute_tensor(full, mesh, [Shard(0)]),
                   "bias": distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])}
        assert weights["layer.weight"].to_local().shape == (8, 8)
        if rank == 0:
            with WeightPublisher("tcp://127.0.0.1:0") as pub:
                conn.send(pub.endpoint)
                version = pub.publish(weights)
                pub.wait_for_subscribers(version, 1, applied=False, timeout=30)
                conn.send(version)
        else:
            gather_full_tensors(weights)
        dist.barrier()  # tear the group down together: gloo aborts a rank that leaves early
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        dist.destroy_process_group()
    # skip interpreter teardown: torch's static thread pools may abort a clean exit
    # ("terminate called without an active exception" once under full CI)
    sys.stderr.flush()
    os._exit(code)


@pytest.mark.timeout(120)
def test_sharded_dtensors_arrive_whole(tmp_path):
    ctx = forkserver(PRELOAD)
    parent, child = ctx.Pipe()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_rank, args=(r, store, child), daemon=True) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        assert parent.poll(60), "rank 0 did not start publishing"
        with WeightSubscriber(parent.recv(), report_interval=0.2) as sub:
            staged = sub.wait_for_version(1, timeout=60)
            torch.manual_seed(0)
            assert torch.equal(staged.tensors["layer.weight"],
                               torch.randn(16, 8).to(torch.bfloat16))
            assert torch.equal(staged.tensors["bias"], torch.arange(6.0))
            assert parent.poll(60) and parent.recv() == staged.version
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                os.kill(proc.pid, 9)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
