"""A trainer rank publishing its share of a checkpoint with ``ShardedPublisher``, in its
own process (``test_tp2_qwen2.py``): every rank holds only the tensors it publishes.

Rank ``rank`` of ``world`` publishes the sorted names ``[rank::world]`` of each file
it is told (``("publish", path, version)`` on ``commands``); rank 0 also runs the
coordinator and puts ``("ready", announce, collect, publisher_id)`` on ``out``.
"""

from __future__ import annotations

from typing import Any


def shard_trainer_main(rank: int, world: int, coordinator: str, commands: Any,
                       out: Any) -> None:
    from safetensors.torch import load_file

    from publisher.sharded_publisher import ShardedPublisher

    pub = ShardedPublisher("tcp://127.0.0.1:0", rank=rank, world_size=world,
                           coordinator=coordinator,
                           announce_endpoint="tcp://127.0.0.1:0" if rank == 0 else None,
                           chunk_size=64 << 10, heartbeat_interval=0.2)
    try:
        coord = pub.coordinator
        out.put(("ready", rank, None if coord is None else coord.endpoint,
                 None if coord is None else coord.collect_endpoint,
                 None if coord is None else coord.publisher_id))
        while True:
            command = commands.get(timeout=300)
            if command[0] == "exit":
                break
            _, path, version = command
            weights = load_file(path)
            mine = {name: weights[name] for name in sorted(weights)[rank::world]}
            del weights  # this rank holds its share only
            pub.publish(mine, version=version)
            pub.wait_submitted(version, timeout=60)
            out.put(("published", rank, version))
    finally:
        pub.close()
