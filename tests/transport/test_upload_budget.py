"""The upload budget: a byte rate that holds over any stretch, and a CPU share it learns.

The rate is checked with explicit timestamps (the bucket takes ``now`` as an
argument); the CPU share with real work (copies measured by ``thread_time``),
against the same loop without the bound.
"""

from __future__ import annotations

import math
import threading
import time

import zmq

from subscriber_ext.transport.peers.upload_budget import ThreadCpu, UploadBudget, find_thread

CHUNK = 1 << 20


def test_rate_bound_holds_over_any_stretch() -> None:
    rate = 10 * CHUNK  # bytes/s
    budget = UploadBudget(rate, None)
    now, sent, log = 0.0, 0, []
    while now < 5.0:
        wait = budget.delay(CHUNK, now)
        if wait:
            now += wait
            continue
        sent += CHUNK
        log.append((now, sent))
    for start_t, start_sent in log:
        for end_t, end_sent in log:
            if end_t - start_t >= 0.5:  # any half second or longer: within one chunk
                assert end_sent - start_sent <= rate * (end_t - start_t) + 2 * CHUNK
    assert sent >= rate * 5.0 - CHUNK  # and it does not undershoot either
    budget.refund(CHUNK)
    assert budget.bytes_sent == sent - CHUNK


def _serve(budget: UploadBudget, seconds: float) -> float:
    """Copy 1 MiB per "chunk" the budget lets out; the serving CPU share of the last half."""
    src, dst = bytes(CHUNK), bytearray(CHUNK)
    start = time.monotonic()
    half_cpu = half_wall = 0.0
    while (now := time.monotonic()) - start < seconds:
        wait = budget.delay(CHUNK, now)
        if wait:
            time.sleep(min(wait, 0.02))
            continue
        cpu = time.thread_time()
        for _ in range(8):
            dst[:] = src
        used = time.thread_time() - cpu
        budget.charge(used)
        if now - start >= seconds / 2:
            half_cpu += used
            half_wall = now - start - seconds / 2
    return half_cpu / max(half_wall, 1e-3)


def test_cpu_share_bound_slows_serving_to_what_fits() -> None:
    free = _serve(UploadBudget(None, None), 1.0)
    bounded_budget = UploadBudget(None, 0.05, window=0.1)
    bounded = _serve(bounded_budget, 2.0)
    assert math.isfinite(bounded_budget.effective_rate)
    assert bounded <= 0.1, (bounded, free)
    if free >= 0.2:  # on a saturated box the unbounded loop itself gets little more than that
        assert bounded <= 0.5 * free, (bounded, free)
    assert bounded_budget.stats()["upload_cpu_share_limit"] == 0.05


def test_thread_cpu_reads_another_threads_time() -> None:
    done = threading.Event()

    def spin() -> None:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        done.wait(5)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        clock = ThreadCpu(thread.native_id)
        deadline = time.monotonic() + 10
        while clock.seconds() < 0.15 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert clock.seconds() >= 0.15
    finally:
        done.set()
        thread.join()


def test_the_peer_contexts_io_thread_is_found_by_name() -> None:
    ctx = zmq.Context(io_threads=1)
    ctx.set(zmq.THREAD_NAME_PREFIX, 7099)
    sock = ctx.socket(zmq.ROUTER)  # the I/O thread starts with the first socket
    try:
        clock = ThreadCpu(name_prefix="7099/ZMQbg/IO")
        deadline = time.monotonic() + 5
        while clock.tid is None and time.monotonic() < deadline:
            clock.seconds()  # the thread names itself once it runs
        assert clock.tid is not None and clock.tid == find_thread("7099/ZMQbg/IO")
        assert find_thread("no-such-thread/") is None
    finally:
        sock.close(linger=0)
        ctx.term()
