"""One node of the fleet simulator, run inside a host namespace: publisher, relay or subscriber.

Speaks JSON lines: commands on stdin, events on stdout (every event carries
``time.time()``; all namespaces share the machine's clock, so times from
different hosts compare). Weights are pseudo-random bytes derived from the
version number, so every node can check what it received.

    python -m benchmarks.fleet_node publisher|relay|subscriber '<json args>'
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

import torch
import xxhash

from weightpub_wire.buffers import byte_view, flat_bytes


def emit(**event: Any) -> None:
    event.setdefault("t", time.time())
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def weights(version: int, mib: int, tensors: int = 8,
            dtype: str = "uint8") -> dict[str, torch.Tensor]:
    """``mib`` MiB in ``tensors`` tensors (uint8 or bf16) whose bytes depend only on
    ``version``."""
    gen = torch.Generator().manual_seed(version)
    each = (mib << 20) // tensors
    if dtype == "bf16":
        return {f"layer{i}.weight": torch.randn(each // 2, generator=gen).to(torch.bfloat16)
                for i in range(tensors)}
    return {f"layer{i}.weight": torch.randint(0, 255, (each,), dtype=torch.uint8, generator=gen)
            for i in range(tensors)}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    state = xxhash.xxh3_64()
    for name in sorted(tensors):
        state.update(name.encode())
        state.update(byte_view(flat_bytes(tensors[name].contiguous())))
    return state.hexdigest()


def commands() -> Any:
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def run_publisher(args: dict[str, Any]) -> None:
    from publisher import WeightPublisher

    # simulated hosts bind namespace addresses of a network only this benchmark can reach
    options = {"insecure": True, **args.get("publisher_options", {})}
    if args.get("chunk_mib"):  # else the publisher's default chunk size
        options["chunk_size"] = args["chunk_mib"] << 20
    pub = WeightPublisher(args["bind"], **options)
    emit(event="ready", endpoint=pub.endpoint)
    for command in commands():
        if command["cmd"] == "publish":
            version, mib = command["version"], command["mib"]
            data = weights(version, mib, dtype=command.get("dtype", "uint8"))
            emit(event="digest", version=version, digest=digest(data))
            start = time.time()
            pub.publish(data, version=version)
            emit(event="published", version=version, start=start)
        elif command["cmd"] == "stats":
            emit(event="stats", stats=pub.data_stats())
        elif command["cmd"] == "exit":
            break
    pub.close()


def run_shard_rank(args: dict[str, Any]) -> None:
    """A trainer rank of a ``ShardedPublisher`` (``--trainer-ranks``): it publishes the
    tensors ``[rank::world]`` of ``weights(version)``; rank 0 also announces the union
    (its digest is the full version's, as the publisher's)."""
    from publisher.sharded_publisher import ShardedPublisher

    rank, world = args["rank"], args["world"]
    options: dict[str, Any] = {"insecure": True}
    if args.get("chunk_mib"):
        options["chunk_size"] = args["chunk_mib"] << 20
    if args.get("peer_fanout") is not None:  # rank 0's: the coordinator's tracker
        options["peer_fanout"] = args["peer_fanout"]
    pub = ShardedPublisher(args["bind"], rank=rank, world_size=world,
                           coordinator=args["coordinator"],
                           announce_endpoint=args.get("announce"), **options)
    coord = pub.coordinator
    emit(event="ready", endpoint=pub.endpoint,
         announce=None if coord is None else coord.endpoint)
    for command in commands():
        if command["cmd"] == "publish":
            version, mib = command["version"], command["mib"]
            data = weights(version, mib, dtype=command.get("dtype", "uint8"))
            if rank == 0:
                emit(event="digest", version=version, digest=digest(data))
            mine = {name: data[name] for name in sorted(data)[rank::world]}
            del data
            start = time.time()
            pub.publish(mine, version=version)
            emit(event="published", version=version, start=start)
        elif command["cmd"] == "stats":
            emit(event="stats", stats=pub.shard.data_stats())
        elif command["cmd"] == "exit":
            break
    pub.close()


def run_subscriber(args: dict[str, Any]) -> None:
    """``consumer``: "callback" (``on_version``, on the subscriber's thread) or "wait"
    (a thread of the application's own: ``wait_for_version``, then ``release()``)."""
    from subscriber_ext import WeightSubscriber
    from weightpub_wire.errors import ClosedError

    def staged(version: Any) -> None:
        emit(event="staged", version=version.version, digest=digest(dict(version.tensors)))
        version.release()

    def consume() -> None:
        want = 1
        while True:
            try:
                version = sub.wait_for_version(want, timeout=3600.0)
            except ClosedError:  # the node is exiting
                return
            at = time.time()  # staged; the digest is the benchmark's check, not the delivery
            emit(event="staged", version=version.version, t=at,
                 digest=digest(dict(version.tensors)))
            version.release()
            want = version.version + 1

    waiting = args.get("consumer", "callback") == "wait"
    sub = WeightSubscriber(args["connect"], on_version=None if waiting else staged,
                           **args.get("subscriber_options", {}))
    if waiting:
        threading.Thread(target=consume, name="fleet-consumer", daemon=True).start()
    emit(event="ready", subscriber_id=sub.subscriber_id)
    for command in commands():
        if command["cmd"] == "status":
            emit(event="status", status=sub.status())
        elif command["cmd"] == "exit":
            break
    sub.close()


def run_relay(args: dict[str, Any]) -> None:
    from publisher.publisher_config import PublisherConfig
    from subscriber_ext.transport.subscriber_config import SubscriberConfig
    from weightpub.deployment_config import RelayConfig
    from weightpub.relay import Relay

    config = RelayConfig(upstream=SubscriberConfig(endpoint=args["connect"]),
                         downstream=PublisherConfig(endpoint=args["bind"], **{
                             "insecure": True, **args.get("publisher_options", {})}),
                         cut_through=args.get("cut_through", True))
    with Relay(config) as relay:
        emit(event="ready", endpoint=relay.endpoint)
        for command in commands():
            if command["cmd"] == "exit":
                break


def main() -> None:
    threads = int(os.environ.get("FLEET_TORCH_THREADS", "1"))  # 0: torch's default
    if threads:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,  # FLEET_LOG_DIR keeps it
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    role, raw = sys.argv[1], sys.argv[2]
    {"publisher": run_publisher, "subscriber": run_subscriber, "relay": run_relay,
     "shard_rank": run_shard_rank}[role](
        json.loads(raw))
    sys.stdout.flush()
    os._exit(0)  # do not wait for daemon threads of a node that is done


#: what a zygote preloads for forked nodes (``Node.start(forked=True)``)
PRELOAD = ["torch", "xxhash", "zmq", "msgspec", "publisher", "publisher.sharded_publisher",
           "subscriber_ext", "weightpub.relay", "benchmarks.fleet_node"]


def forked_main(role: str, raw: str, env: dict[str, str]) -> None:
    """``main`` in a node forked from a zygote (``Host.fork``): the environment
    ``python -m benchmarks.fleet_node`` would have been given, then the same run."""
    os.environ.update(env)
    sys.argv = ["benchmarks.fleet_node", role, raw]
    threading.current_thread().name = "fleet-node"
    main()


if __name__ == "__main__":
    threading.current_thread().name = "fleet-node"
    main()
