"""kill -9 of the publisher (or a relay) at 27 points; a restarted one is always followed.

Every case: a subscriber stages v1; the publisher dies by SIGKILL at its point
while v2 is on its way (or while serving, or during the replica's commit); a
new publisher instance starts on the same endpoint (some with a clock far
behind) and publishes v3. Each case asserts:

- every version offered to the subscriber is bit-exact (``Recorder``), and v2
  is never offered when it cannot have been complete;
- v3 of the new instance arrives bit-exact (nothing hangs: every wait is bounded);
- the subscriber's thread lives on and closes promptly.

The matrix runs its cases in parallel threads (each with its own processes and
ports); memory is measured before and after (RSS from /proc) and printed.

The stream cells (``stream=True`` on both sides, issue 29) run the same checks with
every chunk on the plain TCP port: killed before a stream chunk's ``sendmsg`` at a few
points, with ``announce_early`` while the copy (and the sums that follow the manifest)
is under way, and for a sliced subscriber while its slices stream.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from subscriber_ext import StagedVersion, WeightSubscriber
from tests.transport.faults.harness import Proc, Recorder, close_all
from tests.transport.faults.tools import rss_mib
from tests.transport.procs import det_weights, digests, free_port, pace_replies, wait_until
from weightpub.status import fetch_status
from weightpub_wire.errors import WeightPubTimeout
from weightpub_wire.slice_plan import from_ranges

pytestmark = pytest.mark.timeout(240)

SMALL = [("w", "float32", [128, 128]), ("s", "int64", [])]  # 64 KiB: one chunk
BIG = [("big", "float32", [2048, 1024]), ("b", "bfloat16", [999])]  # 8 MiB: 65 chunks
SMALL3 = [("w", "float32", [128, 128]), ("s", "int64", []), ("new", "int8", [77])]
SPECS = {1: SMALL, 2: BIG, 3: SMALL3}
A, B = 11, 22  # seeds of the first and the restarted instance


@dataclass(frozen=True)
class Case:
    name: str
    kind: str = "pub"  # pub | late_joiner | status | commit | external | relay_up | relay_down
    kill_at: str | None = None
    v2_impossible: bool = True  # v2 cannot have been complete when the publisher died
    fraction: float = 0.0  # external kills: when this much of v2 has arrived
    clock_offset: float = 0.0  # the restarted instance's wall clock
    stream: bool = False  # publishers and subscriber on the plain-TCP stream (issue 29)
    early: bool = False  # the publishers announce_early (sums follow the manifest)
    sliced: bool = False  # the subscriber has a slice plan (its slices over the stream)


CASES = [
    Case("before_announce", kill_at="announce"),
    Case("announce_before_pub_send", kill_at="announce_cmd"),
    Case("snapshot_copy_10pct", kill_at="copy:0.1"),
    Case("snapshot_copy_50pct", kill_at="copy:0.5"),
    Case("snapshot_copy_90pct", kill_at="copy:0.9"),
    Case("transfer_first_chunk", kill_at="chunk:2"),
    Case("transfer_10pct", kill_at="chunk:8"),
    Case("transfer_25pct", kill_at="chunk:17"),
    Case("transfer_50pct", kill_at="chunk:33"),
    Case("transfer_75pct", kill_at="chunk:49"),
    Case("transfer_90pct", kill_at="chunk:59"),
    Case("transfer_last_chunk", kill_at="chunk:66"),
    Case("after_last_chunk", kill_at="chunk_after:66", v2_impossible=False),
    Case("serving_a_late_joiner", kind="late_joiner", kill_at="latest:1", v2_impossible=False),
    Case("handling_a_report", kill_at="report:4", v2_impossible=False),
    Case("handling_a_status_request", kind="status", kill_at="status:1",
         v2_impossible=False),
    Case("external_30pct", kind="external", fraction=0.3),
    Case("external_70pct", kind="external", fraction=0.7),
    Case("during_replica_commit", kind="commit", v2_impossible=False),
    Case("restart_clock_30s_behind", kill_at="chunk:33", clock_offset=-30.0),
    Case("restart_clock_1h_behind", kill_at="chunk:20", clock_offset=-3600.0),
    Case("restart_clock_1day_ahead", kill_at="chunk:40", clock_offset=86400.0),
    Case("relay_hop_upstream_50pct", kind="relay_up", kill_at="chunk:33"),
    Case("relay_hop_upstream_before_announce", kind="relay_up", kill_at="announce"),
    Case("relay_hop_relay_mid_downstream", kind="relay_down", kill_at="chunk:5"),
    Case("relay_hop_relay_before_republish", kind="relay_down", kill_at="forward"),
    Case("relay_hop_relay_copy_50pct", kind="relay_down", kill_at="copy:0.5"),
    # the stream path: chunk n of the stream (v1 is chunk 1, v2 chunks 2..66)
    Case("stream_first_chunk", kill_at="stream_chunk:2", stream=True),
    Case("stream_50pct", kill_at="stream_chunk:33", stream=True),
    Case("stream_last_chunk", kill_at="stream_chunk:66", stream=True),
    Case("stream_early_copy_50pct_sums_following", kill_at="copy:0.5", stream=True,
         early=True),
    Case("stream_early_50pct", kill_at="stream_chunk:33", stream=True, early=True),
    Case("stream_early_answering_chunk_sums", kill_at="sums:1", stream=True, early=True),
    # both hops of a relay on the stream: the upstream killed before its stream chunk 33 of
    # v2 (to the relay), the relay before its downstream stream chunk 5 of v2 (1 MiB chunks)
    Case("stream_relay_hop_upstream_50pct", kind="relay_up", kill_at="stream_chunk:33",
         stream=True),
    Case("stream_relay_hop_relay_mid_downstream", kind="relay_down", kill_at="stream_chunk:5",
         stream=True),
    # sliced: every version is BIG (v1 is stream chunks 1..65, v2 66..130)
    Case("stream_slices_50pct", kill_at="stream_chunk:98", stream=True, sliced=True),
    Case("stream_early_slices_25pct", kill_at="stream_chunk:82", stream=True, early=True,
         sliced=True),
]

ROW = 1024 * 4  # bytes of a row of BIG's "big"
#: a sliced subscriber's plan: half of every row of "big" (every chunk touched but the
#: last, which holds "b" alone); the rest of every version is staged as zeros
RANGES = {"big": [(r * ROW, r * ROW + ROW // 2) for r in range(2048)]}
SLICED_SPECS = {1: BIG, 2: BIG, 3: BIG}  # a plan names tensors every version has


def _subscriber(endpoint: str, recorder: Recorder, *, slow: bool = False,
                case: Case | None = None) -> WeightSubscriber:
    stream = case is not None and case.stream
    plan = from_ranges("kill-matrix", RANGES) if case is not None and case.sliced else None
    sub = WeightSubscriber(endpoint, on_version=recorder, request_timeout=1.0,
                           window_bytes=1 << 20, chunks_per_request=2, report_interval=0.3,
                           stream=stream, slice_plan=plan)
    if slow:  # so an outside kill lands at a known fraction
        pace_replies(sub._client, 0.01)
    return sub


def _commit_hook(recorder: Recorder, started: threading.Event, killed: threading.Event,
                 live: dict[str, Any]) -> None:
    """A replica-side commit: copy the staged tensors into 'live' weights; the publisher is
    killed in the middle of it (the commit must complete from the staged bytes alone)."""

    def commit(staged: StagedVersion) -> None:
        if staged.version == 2:
            started.set()
            assert killed.wait(20)
        live.clear()
        live.update({name: t.clone() for name, t in staged.tensors.items()})
        live["_version"] = staged.version

    recorder.on_commit = commit


def run_case(case: Case) -> dict[str, Any]:
    t0 = time.monotonic()
    procs: list[Proc] = []
    sub: WeightSubscriber | None = None
    try:
        if case.kind.startswith("relay"):
            return _run_relay_case(case, procs, t0)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        paths = {"stream": case.stream, "announce_early": case.early}
        first = Proc("publisher", endpoint=endpoint, seed=A, kill_at=case.kill_at, **paths)
        procs.append(first)
        specs = SLICED_SPECS if case.sliced else SPECS
        recorder = Recorder(seeds={first.publisher_id: A}, specs=specs,
                            ranges=RANGES if case.sliced else None)
        started, killed, live = threading.Event(), threading.Event(), {}
        if case.kind == "commit":
            _commit_hook(recorder, started, killed, live)
        sub = _subscriber(endpoint, recorder, slow=case.kind == "external", case=case)
        first.publish(1, specs[1])
        wait_until(lambda: recorder.got(first.publisher_id, 1), 30, "v1")
        if case.kind == "late_joiner":  # killed while answering the joiner's 'latest'
            first.publish(2, BIG)
            wait_until(lambda: recorder.got(first.publisher_id, 2), 30, "v2")
            late = Recorder(seeds={first.publisher_id: A}, specs=SPECS)
            joiner = _subscriber(endpoint, late)
            first.wait_killed()
            joiner.close()
            assert late.problems == [] and late.delivered == []
        elif case.kind == "status":
            with pytest.raises(WeightPubTimeout):
                fetch_status(endpoint, timeout=3)
            first.wait_killed()
        elif case.kind == "commit":
            first.publish(2, BIG)
            assert started.wait(30)
            first.kill9()
            killed.set()
            wait_until(lambda: live.get("_version") == 2, 30, "the commit to finish")
            want = det_weights(A, 2, BIG)
            assert digests((k, v) for k, v in live.items() if k != "_version") == \
                digests(want.items())
        elif case.kind == "external":
            first.publish(2, BIG)
            wait_until(lambda: (sub.status()["fetching_fraction"] or 0) >= case.fraction
                       and sub.status()["fetching_version"] == 2, 30, "the transfer")
            first.kill9()
        else:
            first.publish(2, specs[2], wait=False)
            first.wait_killed()
        time.sleep(0.3)  # anything still in flight from the dead instance lands now
        if case.v2_impossible:
            assert not recorder.got(first.publisher_id, 2), "a partial v2 was offered"
        assert sub.latest() is not None and sub.latest().version in (1, 2)
        second = Proc("publisher", endpoint=endpoint, seed=B, clock_offset=case.clock_offset,
                      **paths)
        procs.append(second)
        recorder.seeds[second.publisher_id] = B
        second.publish(3, specs[3])
        wait_until(lambda: recorder.got(second.publisher_id, 3), 40,
                   "v3 of the restarted publisher")
        assert recorder.problems == [], recorder.problems
        assert sub._thread.is_alive()
        status = sub.status()
        assert status["publisher_id"] == second.publisher_id and status["staged_version"] == 3
        if case.stream:  # v3 came over the restarted instance's stream port
            latest = sub.latest()
            assert latest is not None and latest.data_path == "stream", status["stream"]
        return {"case": case.name, "seconds": round(time.monotonic() - t0, 1),
                "delivered": recorder.delivered[:], "restarted_rss_mib":
                round(_child_rss(second), 1)}
    finally:
        close_all(sub, procs)


def _child_rss(proc: Proc) -> float:
    try:
        return rss_mib(proc.pid)
    except OSError:
        return float("nan")


def _run_relay_case(case: Case, procs: list[Proc], t0: float) -> dict[str, Any]:
    up_endpoint = f"tcp://127.0.0.1:{free_port()}"
    down_endpoint = f"tcp://127.0.0.1:{free_port()}"
    upstream_kill = case.kill_at if case.kind == "relay_up" else None
    relay_kill = case.kill_at if case.kind == "relay_down" else None
    stream = {"stream": case.stream}
    upstream = Proc("publisher", endpoint=up_endpoint, seed=A, kill_at=upstream_kill, **stream)
    procs.append(upstream)
    relay = Proc("relay", upstream=up_endpoint, endpoint=down_endpoint, kill_at=relay_kill,
                 **stream)
    procs.append(relay)
    # relay versions keep the upstream numbers; v3 comes from the restarted upstream
    # (relay_up, seed B) or from the same upstream (relay_down, seed A)
    v3_seed = B if case.kind == "relay_up" else A
    recorder = Recorder(seeds={}, specs=SPECS,
                        seed_for=lambda _rid, version: v3_seed if version == 3 else A)
    sub = _subscriber(down_endpoint, recorder, case=case)
    try:
        upstream.publish(1, SMALL)
        wait_until(lambda: recorder.got(relay.publisher_id, 1), 30, "v1 through the relay")
        if case.kind == "relay_up":
            upstream.publish(2, BIG, wait=False)
            upstream.wait_killed()
            time.sleep(0.3)
            assert not recorder.got(relay.publisher_id, 2)
            upstream = Proc("publisher", endpoint=up_endpoint, seed=B, **stream)
            procs.append(upstream)
            upstream.publish(3, SMALL3)
            wait_until(lambda: recorder.got(relay.publisher_id, 3), 40, "v3 via the relay")
        else:
            upstream.publish(2, BIG)
            relay.wait_killed()
            time.sleep(0.3)
            assert not recorder.got(relay.publisher_id, 2)
            relay = Proc("relay", upstream=up_endpoint, endpoint=down_endpoint, **stream)
            procs.append(relay)
            # the new relay instance takes the upstream's latest (v2) and serves it whole
            wait_until(lambda: recorder.got(relay.publisher_id, 2), 40, "v2 via the new relay")
            upstream.publish(3, SMALL3)
            wait_until(lambda: recorder.got(relay.publisher_id, 3), 40, "v3 via the new relay")
        assert recorder.problems == [], recorder.problems
        assert sub._thread.is_alive()
        if case.stream:  # v3 came over the (new) relay's stream port
            latest = sub.latest()
            assert latest is not None and latest.data_path == "stream", sub.status()["stream"]
        return {"case": case.name, "seconds": round(time.monotonic() - t0, 1),
                "delivered": recorder.delivered[:], "restarted_rss_mib": round(
                    _child_rss(procs[-1]), 1)}
    finally:
        sub.close()


def test_kill9_matrix() -> None:
    before = rss_mib()
    results: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=6, thread_name_prefix="fault-case") as pool:
        futures = {case.name: pool.submit(run_case, case) for case in CASES}
        for name, future in futures.items():
            try:
                results[name] = future.result(timeout=200)
            except Exception as exc:  # collect every failure, not just the first
                results[name] = exc
    after = rss_mib()
    print(f"\nkill -9 matrix: {len(CASES)} cases, test process RSS {before:.0f} -> {after:.0f}"
          " MiB")
    for name, result in results.items():
        if isinstance(result, Exception):
            print(f"  FAIL {name}: {type(result).__name__}: {str(result)[:300]}")
        else:
            print(f"  ok   {name:<40} {result['seconds']:>5}s  restarted publisher RSS "
                  f"{result['restarted_rss_mib']} MiB  delivered {result['delivered']}")
    failed = {n: r for n, r in results.items() if isinstance(r, Exception)}
    assert not failed, f"{len(failed)} cases failed: {sorted(failed)}"
    assert len(CASES) >= 20
    assert after - before < 400, f"test process RSS grew {after - before:.0f} MiB"


def test_repeated_restarts_with_clocks_that_disagree() -> None:
    """Six instances in a row on one endpoint, each killed mid-transfer, their clocks
    jumping back and forth by up to a day: the subscriber follows every one of them."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    recorder = Recorder(seeds={}, specs=SPECS)
    sub = _subscriber(endpoint, recorder)
    offsets = [0.0, -30.0, -86400.0, 5.0, -3600.0, 0.0]
    try:
        for round_, offset in enumerate(offsets):
            seed = 100 + round_
            last = round_ == len(offsets) - 1
            proc = Proc("publisher", endpoint=endpoint, seed=seed, clock_offset=offset,
                        kill_at=None if last else "chunk:20")
            try:
                recorder.seeds[proc.publisher_id] = seed
                proc.publish(1, SMALL)  # every instance starts its numbering again
                wait_until(lambda p=proc: recorder.got(p.publisher_id, 1), 40,
                           f"v1 of instance {round_}")
                if not last:
                    proc.publish(2, BIG, wait=False)
                    proc.wait_killed()
                    assert not recorder.got(proc.publisher_id, 2)
            finally:
                proc.close()
        assert recorder.problems == []
        assert [v for _, v in recorder.delivered] == [1] * len(offsets)
        assert sub._thread.is_alive()
    finally:
        sub.close()
