"""The seed's broadcast group can be formed and torn down again and again (issue 19, finding 9).

A trainer calls ``init_communicator`` after every replica restart; each group it
leaves behind (threads, sockets, a store server) would stay for the life of the
trainer. Two members (trainer = last rank, one worker) in threads of this process,
over gloo, 20 times: the process ends with the threads and descriptors it began with.
"""

from __future__ import annotations

import gc
import os
import socket
import threading
import time

import pytest
import torch

from subscriber_ext.vllm_ext.seed.communicator import WeightCommunicator
from weightpub_wire.errors import ClosedError

pytestmark = pytest.mark.timeout(300)
CYCLES = 20


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _resources() -> tuple[int, int]:
    """(native threads, open descriptors) of this process."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _one_group(cycle: int) -> None:
    port = _free_port()
    received: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            comm = WeightCommunicator("127.0.0.1", port, rank, 2, timeout_s=30)
            try:
                tensor = torch.arange(4.0) + cycle if rank == comm.client_rank else torch.zeros(4)
                comm.broadcast(tensor, src=comm.client_rank)
                received[rank] = tensor.tolist()
            finally:
                comm.close()
                comm.close()  # idempotent
            with pytest.raises(ClosedError):
                comm.broadcast(torch.zeros(1), src=1)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert received == {0: [cycle, cycle + 1, cycle + 2, cycle + 3],
                        1: [cycle, cycle + 1, cycle + 2, cycle + 3]}


def _settled() -> tuple[int, int]:
    deadline = time.monotonic() + 10
    gc.collect()
    now = _resources()
    while time.monotonic() < deadline:  # a closing thread may take a moment to exit
        time.sleep(0.1)
        gc.collect()
        later = _resources()
        if later == now:
            return now
        now = later
    return now


def test_twenty_groups_leave_no_threads_or_descriptors_behind() -> None:
    _one_group(0)  # first use loads libraries and their long-lived threads
    threads, fds = _settled()
    for cycle in range(1, CYCLES + 1):
        _one_group(cycle)
    after_threads, after_fds = _settled()
    assert after_threads <= threads, (threads, after_threads)
    assert after_fds <= fds + 1, (fds, after_fds)  # not one per group
