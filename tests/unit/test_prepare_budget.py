"""The prepare budget (issue 18.3): shadows charged before they are built, given back
when the prepared version holding them goes; no vLLM needed."""

from __future__ import annotations

import gc

from subscriber_ext.vllm_ext.apply.prepare import PreparedVersion
from subscriber_ext.vllm_ext.apply.prepare_budget import Charge, PrepareBudget


def test_a_layer_past_the_limit_is_refused_and_counted() -> None:
    budget = PrepareBudget(100)
    charge = Charge(budget)
    assert charge.take(60) and not charge.take(50) and charge.take(40)
    assert budget.status() == {"limit_bytes": 100, "held_bytes": 100, "peak_bytes": 100,
                               "layers_deferred": 1}
    charge.release()
    assert budget.held == 0 and budget.peak == 100


def test_bytes_come_back_when_the_last_holder_goes() -> None:
    """A version's charge passes from its ``VersionPrep`` to its ``PreparedVersion``; the
    bytes return when the last of them is dropped (committed and retired, superseded)."""
    budget = PrepareBudget(1000)
    charge = Charge(budget)
    assert charge.take(700)
    prepared = PreparedVersion(1, "p", charge=charge)
    del charge
    gc.collect()
    assert budget.held == 700  # still held by the prepared version
    assert not Charge(budget).take(400)  # a second version does not fit meanwhile
    del prepared
    gc.collect()
    assert budget.held == 0 and Charge(budget).take(400) is True


def test_zero_prepares_nothing_and_none_is_unbounded() -> None:
    assert not PrepareBudget(0).enabled and not Charge(PrepareBudget(0)).take(1)
    unbounded = PrepareBudget(None)
    assert unbounded.enabled and Charge(unbounded).take(1 << 50)
    assert Charge(None).take(1 << 50)  # no budget at all: nothing counted


def test_the_heap_trimmer_runs_off_the_calling_thread_and_counts() -> None:
    """After a commit the coordinator asks for a trim; the trim runs on its own thread
    (glibc's ``malloc_trim``) and is counted; a disabled trimmer starts nothing."""
    import time

    from weightpub_wire.heap_trim import HeapTrimmer

    trimmer = HeapTrimmer()
    try:
        assert trimmer.enabled  # glibc here
        blocks = [bytearray(1 << 20) for _ in range(64)]
        del blocks
        trimmer.request()
        deadline = time.monotonic() + 10
        while trimmer.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert trimmer.status()["trims"] >= 1, trimmer.status()
    finally:
        trimmer.close()
    off = HeapTrimmer(enabled=False)
    off.request()
    assert off.status() == {"enabled": False, "trims": 0, "released_bytes": 0}


def test_a_fixed_mmap_threshold_gives_large_blocks_back_at_once() -> None:
    """In a fresh process (the setting is process-wide): with the threshold fixed at
    1 MiB, a freed 64 MiB block leaves the resident set at once."""
    import subprocess
    import sys

    code = (
        "from weightpub_wire.heap_trim import set_mmap_threshold, resident_bytes as _rss\n"
        "assert set_mmap_threshold(1 << 20)\n"
        "before = _rss()\n"
        "blocks = [bytearray(8 << 20) for _ in range(8)]\n"
        "held = _rss() - before\n"
        "del blocks\n"
        "left = _rss() - before\n"
        "assert held >= 60 << 20 and left < 8 << 20, (held, left)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
