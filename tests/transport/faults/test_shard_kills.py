"""kill -9 of one trainer rank of a 2-rank ``ShardedPublisher``; the restarted rank is followed.

Plain (non-FSDP) ranks, each publishing its own tensors, in forkserver children
(``children.shard_rank_child``). Rank 1 dies by SIGKILL at its point while
version 2 is on its way: before it submits its shard (the coordinator never has
the union: it drops it after ``shard_timeout``), or while serving the shard's
chunks (the union is announced; the subscriber cannot complete it). Each case asserts:

- every version offered to the subscriber is bit-exact (``Recorder``, the union of
  both ranks' tensors), and version 2 never is: the subscriber keeps version 1;
- rank 1 restarted (a new process, a new port, the same coordinator), version 3 is
  followed bit-exact; the subscriber's thread lives on.

The two cases run in parallel threads, each with its own processes and ports.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from subscriber_ext import WeightSubscriber
from tests.transport.faults.harness import Proc, Recorder, Spec, close_all
from tests.transport.procs import free_port, pace_replies, wait_until
from weightpub.status import fetch_status

pytestmark = pytest.mark.timeout(120)

SEED = 33
RANK_SPECS: dict[int, tuple[Spec, Spec]] = {  # version -> (rank 0's tensors, rank 1's)
    1: ([("a", "float32", [64, 64])], [("b", "float32", [128, 128]), ("s", "int64", [])]),
    2: ([("a", "float32", [256, 256])], [("b", "float32", [1024, 1024]),
                                          ("c", "bfloat16", [999])]),  # rank 1: 33 chunks
    3: ([("a", "float32", [64, 64]), ("n", "int8", [77])], [("b", "float32", [128, 128])]),
}
UNION = {version: [*first, *second] for version, (first, second) in RANK_SPECS.items()}
#: name -> (kill point, ranks and subscriber on the stream path)
CASES = {"before_its_submit": ("submit", False), "serving_chunks": ("chunk:12", False),
         "streaming_chunks": ("stream_chunk:12", True)}  # rank 1's v1 is stream chunk 1


def run_case(kill_at: str, stream: bool = False) -> dict[str, Any]:
    t0 = time.monotonic()
    announce = f"tcp://127.0.0.1:{free_port()}"
    collect = f"tcp://127.0.0.1:{free_port()}"
    procs: list[Proc] = []
    sub: WeightSubscriber | None = None
    try:
        rank0 = Proc("shard_rank", rank=0, world_size=2, announce=announce, coordinator=collect,
                     seed=SEED, shard_timeout=1.0, stream=stream)
        procs.append(rank0)
        rank1 = Proc("shard_rank", rank=1, world_size=2, coordinator=collect, seed=SEED,
                     kill_at=kill_at, stream=stream)
        procs.append(rank1)
        union = rank0.publisher_id  # the coordinator's: one instance for the whole case
        recorder = Recorder(seeds={union: SEED}, specs=UNION)
        sub = WeightSubscriber(announce, on_version=recorder, request_timeout=0.5,
                               max_chunk_retries=2, window_bytes=1 << 20, report_interval=0.3,
                               stream=stream)
        for version in (1, 2):
            rank0.publish(version, RANK_SPECS[version][0])
            rank1.publish(version, RANK_SPECS[version][1], wait=version == 1)
            if version == 1:
                wait_until(lambda: recorder.got(union, 1), 30, "v1")
                pace_replies(sub._client, 0.01)  # rank 1 dies mid-transfer of v2
        rank1.wait_killed()
        if kill_at == "submit":  # the coordinator holds rank 0's shard only: dropped
            wait_until(lambda: _dropped(announce) == 1, 10, "v2 dropped")
        else:  # announced, rank 1 gone: the subscriber gives the version up
            wait_until(lambda: "timed out" in str(sub.status()["last_error"]), 20,
                       "v2 given up")
        assert not recorder.got(union, 2), "a partial v2 was offered"
        latest = sub.latest()
        assert latest is not None and latest.version == 1

        rank1 = Proc("shard_rank", rank=1, world_size=2, coordinator=collect, seed=SEED,
                     stream=stream)
        procs.append(rank1)
        rank0.publish(3, RANK_SPECS[3][0])
        rank1.publish(3, RANK_SPECS[3][1])
        wait_until(lambda: recorder.got(union, 3), 30, "v3 after rank 1 restarted")
        assert recorder.problems == [], recorder.problems
        assert [version for _, version in recorder.delivered] == [1, 3]
        assert sub._thread.is_alive()
        if stream:  # v3 came over both ranks' stream ports
            latest = sub.latest()
            assert latest is not None and latest.data_path == "stream", sub.status()["stream"]
        return {"case": kill_at, "seconds": round(time.monotonic() - t0, 1)}
    finally:
        close_all(sub, procs)


def _dropped(announce: str) -> int:
    group = fetch_status(announce, timeout=5).shard_group
    assert group is not None
    return group.dropped_versions


def test_kill9_of_a_sharded_trainer_rank() -> None:
    with ThreadPoolExecutor(max_workers=len(CASES), thread_name_prefix="shard-case") as pool:
        futures = {name: pool.submit(run_case, *case) for name, case in CASES.items()}
        results = {name: future.result(timeout=100) for name, future in futures.items()}
    for name, result in results.items():
        print(f"  ok   {name:<20} {result['seconds']:>5}s")
