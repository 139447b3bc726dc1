"""``PublishCallback`` under FSDP2 (two gloo ranks, DTensor parameters): rank 0 publishes,
rank 1 takes part in gathering, and the subscriber gets the full, trained weights.

The CPU ``Trainer`` runs DDP, not FSDP (accelerate enables FSDP on GPUs only), so
the ranks drive the callback's events themselves, with real ``TrainerState`` objects,
the way ``Trainer`` does after each optimizer step.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta

import pytest
import torch

from tests.transport.procs import REPO, Child, digests

pytestmark = pytest.mark.timeout(180)


def _rank(rank: int, store: str, conn) -> None:
    import sys

    sys.path.insert(0, str(REPO))
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import TrainerControl, TrainerState

    from publisher import PublishCallback, WeightPublisher
    from tests.trainer.test_publish_callback import tiny_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=90))
    pub = None
    try:
        model = tiny_model()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) if rank == 0 else None
        if pub is not None:
            conn.send(pub.endpoint)
            assert conn.recv() == "subscribed"
        callback = PublishCallback(pub, every_n_steps=2)
        state = TrainerState(is_world_process_zero=rank == 0, is_local_process_zero=rank == 0)
        control = TrainerControl()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.arange(16).reshape(2, 8) * (rank + 1) % 64  # each rank its own batch
        callback.on_train_begin(None, state, control, model=model)
        for step in range(1, 4):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            state.global_step = step
            callback.on_step_end(None, state, control, model=model)
        callback.on_train_end(None, state, control, model=model)
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v
                for k, v in model.state_dict().items()}  # a collective, on both ranks
        if rank == 0:
            conn.send((callback.published, digests(full.items())))
        dist.barrier()  # tear the group down together
    finally:
        if pub is not None:
            pub.close()
        dist.destroy_process_group()


def test_fsdp2_rank0_publishes_the_others_gather(tmp_path):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), child), daemon=True)
             for r in (0, 1)]
    for proc in procs:
        proc.start()
    sub = None
    try:
        assert parent.poll(90), "rank 0 did not start its publisher"
        sub = Child("subscriber", {"endpoint": parent.recv()})
        sub.event("ready", 60)
        parent.send("subscribed")
        assert parent.poll(90), "the ranks did not finish training"
        published, trained = parent.recv()
        assert published == [(2, 1), (3, 2)]  # step 2, then the end of training
        last = sub.event("staged", 60, version=2)
        assert last["digests"] == trained  # whole tensors, bit for bit
        assert last["shapes"]["lm_head.weight"] == [64, 64]
    finally:
        if sub is not None:
            sub.close()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                os.kill(proc.pid, 9)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
