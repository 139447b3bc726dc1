"""``weightpub bench --schemes slices``: a sliced subscriber over the stream beside slice
frames and raw TCP of the planned bytes, in one interleaved run (real processes, 2 MiB).

Not in ``--quick`` (``test_bench_cli.py``'s smoke run stays as long as it was), so its own
test: every round's plan came over the stream, the figures are per planned byte, and the
summary has its rows. The sizes say nothing about speed.
"""

from __future__ import annotations

import pytest

from weightpub.bench.report import summary
from weightpub.bench.transport_bench import SLICE_ROW, cols_plan, run_transport

pytestmark = pytest.mark.timeout(120)


def test_the_sliced_row_runs_stream_frames_and_raw_and_reports_per_planned_byte() -> None:
    ticks: list[int] = []
    result = run_transport([2], 2, ["slices"], lambda: ticks.append(1))
    (pair,) = result["pairs"]
    assert len(ticks) == 2 * 3  # raw, stream and frames each round
    planned = cols_plan(2 << 20).needed_bytes
    assert planned == 1 << 20  # half of every row
    assert (pair["scheme"], pair["bytes"], pair["version_bytes"]) == ("slices", planned, 2 << 20)
    assert (pair["row_bytes"], pair["piece_bytes"]) == (SLICE_ROW, SLICE_ROW // 2)
    assert pair["data_paths"] == ["stream", "stream"]  # nothing fell back to frames
    assert pair["weightpub_GBps"] > 0 and pair["frames_GBps"] > 0 and pair["raw_GBps"] > 0
    assert pair["stream_vs_frames"] > 0
    assert {"publisher", "subscriber"} <= set(pair["cpu_s_per_GB"])
    assert {"publisher", "subscriber"} <= set(pair["frames_cpu_s_per_GB"])
    rows = [r["figure"] for r in summary({"transport": result})]
    assert len(rows) == 3 and all(r.startswith("2 MiB sliced (1 MiB planned, 2048 B of "
                                               "every 4096 B row)") for r in rows), rows
