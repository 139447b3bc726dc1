"""Per-rank memory while two FSDP2 gloo ranks publish a >= 1 GiB model, group by group.

Rank 0 publishes the ``fully_shard`` model, rank 1 runs ``gather_full_tensors``;
a subscriber in this process checks every byte. Prints each rank's peak resident
set beyond its own just before the publish (rank 0: beyond its snapshot, the
version itself) as MiB, as multiples of the largest layer group and of the model
(``weightpub/bench/fsdp_streaming.py``). A whole-model gather would show >= 1x
the model on every rank.

    flock /tmp/wp-heavy.lock python benchmarks/fsdp_streaming.py            # 16 x 64 MiB
    python benchmarks/fsdp_streaming.py --layers 4 --hidden 1024 --glibc-default
"""

from __future__ import annotations

import argparse
import json

from weightpub.bench.fsdp_streaming import ModelShape, run_streaming


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave MALLOC_MMAP_THRESHOLD_ unset (freed heap memory stays "
                             "resident and is counted)")
    args = parser.parse_args()
    shape = ModelShape(layers=args.layers, hidden=args.hidden, dtype=args.dtype)
    run = run_streaming(shape, timeout=args.timeout,
                        malloc_mmap_threshold=None if args.glibc_default else 128 << 10)
    print(json.dumps({"glibc_default": args.glibc_default, **run.row()}))


if __name__ == "__main__":
    main()
