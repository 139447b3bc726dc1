"""Per-rank memory while two FSDP2 gloo ranks publish a >= 1 GiB model, group by group.

Rank 0 publishes the ``fully_shard`` model, rank 1 runs ``gather_full_tensors``;
a subscriber in this process checks every byte. Prints each rank's peak resident
set beyond its own just before the publish (rank 0: beyond its snapshot, the
version itself) as MiB, as multiples of the largest layer group and of the model
(``weightpub/bench/fsdp_streaming.py``). A whole-model gather would show >= 1x
the model on every rank.

``--sharded N``: N ranks each publish their own shard (``ShardedPublisher``),
the subscriber receives the union; prints each rank's peak resident set over its
start beyond its FSDP source, as a multiple of its shard (issue 20: <= 1.25x).

    flock /tmp/wp-heavy.lock python benchmarks/fsdp_streaming.py            # 16 x 64 MiB
    python benchmarks/fsdp_streaming.py --layers 4 --hidden 1024 --glibc-default
    flock /tmp/wp-heavy.lock python benchmarks/fsdp_streaming.py --sharded 4 --hidden 2048
"""

from __future__ import annotations

import argparse
import json

from weightpub.bench.fsdp_streaming import ModelShape, run_sharded, run_streaming


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave MALLOC_MMAP_THRESHOLD_ unset (freed heap memory stays "
                             "resident and is counted)")
    parser.add_argument("--sharded", type=int, default=0, metavar="N",
                        help="N ranks, each publishing its shard (ShardedPublisher)")
    parser.add_argument("--chunk-mib", type=float, default=1.0, help="--sharded: chunk size")
    parser.add_argument("--window-mib", type=float, default=None,
                        help="--sharded: the subscriber's window_bytes (default: its own)")
    args = parser.parse_args()
    shape = ModelShape(layers=args.layers, hidden=args.hidden, dtype=args.dtype)
    threshold = None if args.glibc_default else 128 << 10
    if args.sharded:
        sharded = run_sharded(shape, args.sharded, chunk_size=int(args.chunk_mib * 2**20),
                              timeout=args.timeout, malloc_mmap_threshold=threshold,
                              window_bytes=None if args.window_mib is None
                              else int(args.window_mib * 2**20))
        print(json.dumps({"glibc_default": args.glibc_default, "chunk_mib": args.chunk_mib,
                          "window_mib": args.window_mib, **sharded.row()}))
        return
    run = run_streaming(shape, timeout=args.timeout,
                        malloc_mmap_threshold=threshold)
    print(json.dumps({"glibc_default": args.glibc_default, **run.row()}))


if __name__ == "__main__":
    main()
