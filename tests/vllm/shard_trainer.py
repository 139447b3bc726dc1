"""A trainer rank publishing its share of a checkpoint with ``ShardedPublisher``, in its
own process (``test_tp2_qwen2.py``): every rank holds only the tensors it publishes.

Rank ``rank`` of ``world`` publishes the tensors ``owner_ranks`` gives it (the
project's split: about 1/world of the bytes each) of each file it is told
(``("publish", path, version)`` on ``commands``) and answers ``("published", rank,
version, shard bytes)``; rank 0 also runs the coordinator. On start and after
``("restart", rank, world, coordinator, announce)`` (the job restarted with another
world size: a new publisher instance, rank 0 announcing at ``announce``) it puts
``("ready", rank, announce, collect, publisher_id)`` on ``out`` (None but on rank 0).
"""

from __future__ import annotations

from typing import Any


def shard_trainer_main(rank: int, world: int, coordinator: str, commands: Any,
                       out: Any, announce: str = "tcp://127.0.0.1:0") -> None:
    from safetensors.torch import load_file

    from publisher.sharded_publisher import ShardedPublisher
    from publisher.sources.shard_owners import owner_ranks

    def start() -> ShardedPublisher:
        pub = ShardedPublisher("tcp://127.0.0.1:0", rank=rank, world_size=world,
                               coordinator=coordinator,
                               announce_endpoint=announce if rank == 0 else None,
                               chunk_size=64 << 10, heartbeat_interval=0.2)
        coord = pub.coordinator
        out.put(("ready", rank, None if coord is None else coord.endpoint,
                 None if coord is None else coord.collect_endpoint,
                 None if coord is None else coord.publisher_id))
        return pub

    pub = start()
    try:
        while True:
            command = commands.get(timeout=300)
            if command[0] == "exit":
                break
            if command[0] == "restart":
                pub.close()
                _, rank, world, coordinator, announce = command
                pub = start()
                continue
            _, path, version = command
            weights = load_file(path)
            owners = owner_ranks(sorted(weights.items()), world)
            mine = {name: t for name, t in weights.items() if owners[name] == rank}
            del weights  # this rank holds its share only
            pub.publish(mine, version=version)
            pub.wait_submitted(version, timeout=60)
            out.put(("published", rank, version, pub.shard.manifest(version).total_bytes))
    finally:
        pub.close()
