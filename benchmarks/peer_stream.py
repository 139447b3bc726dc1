"""Peers over the stream vs peers' ZeroMQ frames: what forwarding costs, in one run.

Two chains of two ``peer_share`` members (``weightpub.bench.transport_bench._PeerPath``:
a forwarder fed by the publisher, a receiver fed by the forwarder, cut-through), one
forwarding as frames and one over its stream port (``stream=True``, docs/peer-stream.md),
both alive for the whole run and timed round by round in turn (frames, stream, frames,
...) so both see the same machine. Per round: the forwarding CPU (the serving work and
its threads, ``UploadBudget.cpu_seconds``, per GB served), the forwarder's whole
process and the receiver's, per GB; the same-run ratio stream/frames is taken per
round, the median of those reported. ``--curve``: CURVE keys on every hop of both
chains (the stream's bytes then skip ZeroMQ's encryption; its token still passes CURVE).
``--sliced cols|rows``: both members sliced with one plan of the version (a TP rank's:
the first half of every 8 KiB row, 4 KiB pieces the forwarder gathers and the receiver
lands and scatters; or the first half of the rows, one run), forwarding its slices as
``slice_fetch`` frames or as ``slices`` over the stream; per GB of planned bytes.

    python benchmarks/peer_stream.py --mib 256 --rounds 7
    python benchmarks/peer_stream.py --mib 256 --rounds 7 --curve
    python benchmarks/peer_stream.py --mib 256 --rounds 7 --sliced cols
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightpub.bench.transport_bench import _PeerPath
from weightpub_wire.slice_plan import SlicePlan, from_ranges

ARMS = ("frames", "stream")
ROW = 8 << 10  # bytes of one row of the sliced runs' "w" (a bf16 [n, 4096] matrix)


def plan(kind: str, nbytes: int) -> SlicePlan:
    """Half of ``w``: the first half of every row (``cols``) or of the rows (``rows``)."""
    rows = nbytes // ROW
    ranges = [(r * ROW, r * ROW + ROW // 2) for r in range(rows)] if kind == "cols" \
        else [(0, rows // 2 * ROW)]
    return from_ranges(f"bench-{kind}", {"w": ranges})


def per_gb(seconds: float, nbytes: float) -> float:
    return seconds / (nbytes / 1e9) if nbytes else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--curve", action="store_true")
    parser.add_argument("--sliced", choices=("cols", "rows"))
    args = parser.parse_args()
    source = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8)
    sliced = None if args.sliced is None else plan(args.sliced, source.numel())
    nbytes = source.numel() // 2 if sliced is not None else source.numel()
    rows: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as keys:
        paths = {arm: _PeerPath(source.clone(), "tcp://127.0.0.1:0", stream=arm == "stream",
                                curve_dir=os.path.join(keys, arm) if args.curve else None,
                                slice_plan=sliced)
                 for arm in ARMS}
        try:
            for _ in range(args.rounds):
                for arm in ARMS:
                    result = paths[arm].round()
                    rows[arm].append({
                        "gb_per_s": nbytes / 1e9 / result["seconds"],
                        "forwarding": per_gb(result["serving_cpu"], result["served_bytes"]),
                        "forwarder": per_gb(result["forwarder_cpu"], nbytes),
                        "receiver": per_gb(result["subscriber_cpu"], nbytes),
                        "from_peers": result["from_peers_fraction"] * source.numel() / nbytes})
        finally:
            profiles = {arm: path.close() for arm, path in paths.items()}
    steady = slice(1, None)  # the first round pays first touches and the connections
    out: dict[str, Any] = {"mib": args.mib, "rounds": args.rounds, "curve": args.curve,
                           "sliced": args.sliced, "planned_bytes": nbytes,
                           "load_avg": os.getloadavg()}
    for arm in ARMS:
        out[arm] = {key: round(statistics.median(r[key] for r in rows[arm][steady]), 3)
                    for key in rows[arm][0]}
    for key in ("forwarding", "forwarder", "receiver"):
        ratios = [s[key] / f[key] for f, s in zip(rows["frames"][steady], rows["stream"][steady],
                                                  strict=True) if f[key]]
        out[f"stream_vs_frames_{key}"] = round(statistics.median(ratios), 3)
        out[f"stream_vs_frames_{key}_rounds"] = [round(r, 3) for r in ratios]
    out["stream_fallbacks"] = profiles["stream"]["receiver"].get("peers", {}).get(
        "stream_fallback_causes")
    for arm in ARMS:  # where the forwarder's CPU went over the run, by thread
        out[f"{arm}_forwarder_threads"] = profiles[arm]["forwarder"].get("threads")
    served = profiles["stream"]["forwarder"].get("peers", {}).get("stream_served") or {}
    out["stream_forwarder_cpu_s"] = served.get("stream_cpu_s")  # sends vs the pump
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
