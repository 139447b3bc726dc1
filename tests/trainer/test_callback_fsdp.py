"""``PublishCallback`` under FSDP2 (two gloo ranks, DTensor parameters): rank 0 publishes,
rank 1 takes part in gathering, and the subscriber gets the full, trained weights. In the
same run a second callback gives each rank its ``ShardedPublisher``: each rank publishes
its half, and a subscriber of the union gets the same trained weights, versioned by step.

The CPU ``Trainer`` runs DDP, not FSDP (accelerate enables FSDP on GPUs only), so
the ranks drive the callback's events themselves, with real ``TrainerState`` objects,
the way ``Trainer`` does after each optimizer step. The ranks and the subscriber are
forked from the tests' torch-preloaded forkserver (``tests/transport/zygote.py``): a
spawned rank spends seconds importing torch.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from subscriber_ext import WeightSubscriber
from tests.transport.procs import REPO, Child, digests
from tests.transport.zygote import PRELOAD
from weightpub.bench.forked import forkserver

pytestmark = pytest.mark.timeout(180)


def _rank(rank: int, store: str, conn) -> None:
    import sys

    sys.path.insert(0, str(REPO))
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import TrainerControl, TrainerState

    from publisher import PublishCallback, ShardedPublisher, WeightPublisher
    from tests.trainer.test_publish_callback import tiny_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=90))
    pub = shard = None
    try:
        model = tiny_model()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) if rank == 0 else None
        where: list[str | None] = [None]  # rank 0's coordinator binds, then says where
        if rank == 0:
            shard = ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=2,
                                     coordinator="tcp://127.0.0.1:0",
                                     announce_endpoint="tcp://127.0.0.1:0",
                                     heartbeat_interval=0.2)
            assert shard.coordinator is not None
            where = [shard.coordinator.collect_endpoint]
        dist.broadcast_object_list(where, src=0)
        if rank != 0:
            shard = ShardedPublisher("tcp://127.0.0.1:0", rank=rank, world_size=2,
                                     coordinator=str(where[0]), heartbeat_interval=0.2)
        if pub is not None:
            assert shard is not None and shard.coordinator is not None
            conn.send((pub.endpoint, shard.coordinator.endpoint))
            assert conn.recv() == "subscribed"
        callbacks = [PublishCallback(pub, every_n_steps=2), PublishCallback(shard, every_n_steps=2)]
        callback = callbacks[0]
        state = TrainerState(is_world_process_zero=rank == 0, is_local_process_zero=rank == 0)
        control = TrainerControl()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.arange(16).reshape(2, 8) * (rank + 1) % 64  # each rank its own batch
        for each in callbacks:
            each.on_train_begin(None, state, control, model=model)
        for step in range(1, 4):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            state.global_step = step
            for each in callbacks:
                each.on_step_end(None, state, control, model=model)
        for each in callbacks:
            each.on_train_end(None, state, control, model=model)
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v
                for k, v in model.state_dict().items()}  # a collective, on both ranks
        if rank == 0:
            conn.send((callback.published, callbacks[1].published, digests(full.items())))
            assert conn.recv() == "staged"  # the ranks serve their shards until then
        dist.barrier()  # tear the group down together
    finally:
        if pub is not None:
            pub.close()
        if shard is not None:
            shard.close()
        dist.destroy_process_group()


def test_fsdp2_rank0_publishes_the_others_gather_or_every_rank_publishes_its_shard(tmp_path):
    ctx = forkserver(PRELOAD)
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), child), daemon=True)
             for r in (0, 1)]
    for proc in procs:
        proc.start()
    sub = union = None
    try:
        assert parent.poll(90), "rank 0 did not start its publisher"
        endpoint, announce = parent.recv()
        sub = Child("subscriber", {"endpoint": endpoint}, forked=True)
        union = WeightSubscriber(announce)  # the sharded ranks' union, in this process
        sub.event("ready", 60)
        parent.send("subscribed")
        assert parent.poll(90), "the ranks did not finish training"
        published, sharded, trained = parent.recv()
        assert published == [(2, 1), (3, 2)]  # step 2, then the end of training
        assert sharded == [(2, 2), (3, 3)]  # sharded: the version is the step
        last = sub.event("staged", 60, version=2)
        assert last["digests"] == trained  # whole tensors, bit for bit
        assert last["shapes"]["lm_head.weight"] == [64, 64]
        staged = union.wait_for_version(3, timeout=60)
        assert digests(staged.tensors.items()) == trained  # the union of two halves
        staged.release()
        parent.send("staged")
    finally:
        if union is not None:
            union.close()
        if sub is not None:
            sub.close()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                os.kill(proc.pid, 9)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
