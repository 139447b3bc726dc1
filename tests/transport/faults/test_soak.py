"""Soak: 600 versions while subscribers join, leave and restart; RSS and fds stay flat.

One publisher (this process) and four subscriber slots (this process) that are
closed, re-created and left empty on a fixed pseudo-random schedule, plus a
subscriber process that is killed with SIGKILL and started again. After a
warm-up of 100 versions the test process's RSS and open file descriptors are
sampled every 100 versions (with all four slots live) and printed; growth
beyond a small allowance fails. Every version any subscriber is offered is
checked bit-exact, and at the end every live subscriber has the last version.
Slots 0 and 1 and the subscriber process take their chunks over the stream port
(``stream=True``, issue 29), slots 2 and 3 over frames: the stream's connections,
threads and tokens come and go with them, and stay bounded too.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.faults.harness import Recorder
from tests.transport.faults.tools import fds, rss_mib
from tests.transport.procs import Child, det_weights, digests, wait_until

pytestmark = pytest.mark.timeout(240)
VERSIONS = 600
SPEC = [("w", "float32", [256, 192]), ("b", "bfloat16", [500]), ("s", "int64", [])]  # 193 KiB
SEED = 77


def test_soak_rss_and_fds_stay_flat(spawn: Callable[..., Child]) -> None:
    rng = random.Random(2024)
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_size=64 << 10, heartbeat_interval=0.2,
                          stream=True)
    specs = {v: SPEC for v in range(1, VERSIONS + 1)}
    recorder = Recorder(seeds={pub.publisher_id: SEED}, specs=specs)
    slots: list[WeightSubscriber | None] = [None] * 4
    joins = leaves = restarts = kills = 0

    def open_slot(index: int) -> None:
        slots[index] = WeightSubscriber(pub.endpoint, on_version=recorder,
                                        subscriber_id=f"slot-{index}", report_interval=0.5,
                                        stream=index < 2)

    child = spawn("subscriber", endpoint=pub.endpoint, options={"stream": True})
    child.event("ready", timeout=60)
    samples: list[tuple[int, float, int]] = []
    try:
        for index in range(4):
            open_slot(index)
        for version in range(1, VERSIONS + 1):
            pub.publish(det_weights(SEED, version, SPEC), version=version)
            if version % 100 == 0:  # checkpoint: all slots live, the newest version everywhere
                for index, sub in enumerate(slots):
                    if sub is None:
                        open_slot(index)
                        joins += 1
                for sub in slots:
                    assert sub is not None
                    staged = sub.wait_for_version(version, timeout=30)
                    assert digests(staged.items()) == digests(
                        det_weights(SEED, version, SPEC).items())
                if version >= 200:
                    time.sleep(0.3)  # let buffers return to the pools
                    samples.append((version, rss_mib(), fds()))
                if version in (200, 400):  # kill -9 the subscriber process, start a new one
                    child.kill9()
                    child.close()
                    kills += 1
                    child = spawn("subscriber", endpoint=pub.endpoint,
                                  options={"stream": True})
                    child.event("ready", timeout=60)
                continue
            index = rng.randrange(4)
            action = rng.random()
            sub = slots[index]
            if action < 0.04 and sub is not None:  # leave
                sub.close()
                slots[index] = None
                leaves += 1
            elif action < 0.08 and sub is None:  # join
                open_slot(index)
                joins += 1
            elif action < 0.11 and sub is not None:  # restart under the same id
                sub.close()
                open_slot(index)
                restarts += 1
            time.sleep(0.06)
        child.event("staged", timeout=60, version=VERSIONS)
        assert recorder.problems == [], recorder.problems[:5]
        fleet = pub.fleet()
        # rows do not pile up: four slots (restarts reuse their id) and three processes
        assert len(fleet) <= 7, [r.subscriber_id for r in fleet]
        server = pub._stream
        assert server is not None and server.accepted > 0 and server.bytes_sent > 0
        # a connection per live stream subscriber (two slots, the process) at most: the
        # closed and killed ones' connections ended with them
        wait_until(lambda: server.status()["connections"] <= 3, 10,
                   "the stream connections of closed subscribers to end")
    finally:
        for sub in slots:
            if sub is not None:
                sub.close()
        pub.close()
    print(f"\nsoak: {VERSIONS} versions, {joins} joins, {leaves} leaves, {restarts} restarts, "
          f"{kills} subscriber processes killed; {len(recorder.delivered)} versions offered, "
          "all bit-exact")
    for version, rss, count in samples:
        print(f"  after v{version}: RSS {rss:.1f} MiB, {count} open fds")
    first, last = samples[0], samples[-1]
    assert last[1] - first[1] < 40, samples  # MiB, flat within noise
    assert abs(last[2] - first[2]) <= 2, samples
