"""Issue 19 on a GPU: the checks a CPU cannot run (deselected on CPU CI).

One command on a machine with one (or more) CUDA GPU and the ``gpu`` extra, about
5 minutes on one H200 (tests/gpu/run_issue19.sh wraps it with a 10-minute bound):

    python -m pytest -m gpu tests/gpu/test_issue19_gpu.py -q -s -p no:cacheprovider

Each check prints one line, ``GPU-CHECK <name>: PASS|SKIP|FAIL <detail>``
(docs/RELIABILITY.md, "GPU findings", says which finding each one pins):

1. ``cuda_graphs_in_place`` / ``cuda_graphs_prepared``: a CUDA vLLM engine with CUDA
   graphs on (no ``enforce_eager``) matches transformers after every version, in
   place and prepared (reload + prepare).
2. ``busy_trainer_stream``: with seconds of work queued on the trainer's default
   stream, a version reaches a ``cuda_ipc`` subscriber before that work ends.
3. ``non_current_device``: weights on ``cuda:1`` while ``cuda:0`` is current, written
   by a kernel still queued when ``publish()`` runs, arrive bit-exact (two GPUs;
   one GPU has no non-current device: SKIP with the reason).
4. ``expandable_segments_4gib``: a 4 GiB version exported from an allocator with
   ``expandable_segments:True`` reaches a subscriber by CUDA IPC (handle > 256 bytes).
5. ``seed_reinit_20``: the seed communicator (NCCL) formed and closed 20 times,
   no thread or descriptor left behind.
6. ``nccl_two_processes``: a weightpub NCCL group between two processes; the peer
   is killed mid-broadcast and the trainer process gets ``GroupError`` and lives on.
   On one GPU both NCCL checks give each process its own ``NCCL_HOSTID`` (NCCL
   refuses two ranks on one device of one host) and the socket transport; if NCCL
   still refuses, the line says so (SKIP) and the trainer must still live on.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import wait_until_applied
from tests.vllm.helpers import EXT, assert_matches_hf, new_weights, save_tiny
from weightpub_wire.collective_group import scoped_environment

pytestmark = [
    pytest.mark.gpu, pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
KIND = "qwen2"
N = 6
GIB = 1 << 30


def line(check: str, verdict: str, detail: str) -> None:
    print(f"\nGPU-CHECK {check}: {verdict} {detail}", flush=True)


def _resources() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def one_gpu_nccl_env(host: str) -> dict[str, str]:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected", init.cc) unless the
    two processes look like two hosts: a distinct ``NCCL_HOSTID`` each, and the socket
    transport over loopback between them. Nothing on two GPUs."""
    if torch.cuda.device_count() > 1:
        return {}
    return {"NCCL_HOSTID": f"weightpub-{host}", "NCCL_NET": "Socket",
            "NCCL_SOCKET_IFNAME": "lo"}


def _cycles_per_second() -> float:
    """``torch.cuda._sleep`` spins for clock cycles: how many make a second here."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return 100_000_000 / (time.perf_counter() - start)


# -- 1. CUDA graphs: in place and prepared -------------------------------------------------------
def test_cuda_graphs_in_place_and_prepared_match_transformers(tmp_path) -> None:
    from vllm import LLM

    llm = LLM(model=str(save_tiny(KIND, 0, tmp_path)), dtype="float32", skip_tokenizer_init=True,
              enforce_eager=False, max_model_len=256, max_num_seqs=8,
              gpu_memory_utilization=0.25, worker_extension_cls=EXT,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    try:
        modes = (("cuda_graphs_in_place", {"apply_mode": "in_place"}, (101, 102)),
                 ("cuda_graphs_prepared", {"apply_mode": "reload", "prepare": True}, (103, 104)))
        for check, options, seeds in modes:
            with WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) as pub:
                status = llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,),
                                            kwargs=options)[0]
                try:
                    for seed in seeds:
                        weights = new_weights(KIND, seed)
                        version = pub.publish(weights)
                        rank = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                                  fail_on_error=True, timeout=120)[0]
                        try:
                            assert_matches_hf(llm, KIND, weights, N)
                        except AssertionError as exc:
                            line(check, "FAIL", f"version {version}: {exc}")
                            raise
                finally:
                    llm.collective_rpc("stop_weight_subscriber")
            line(check, "PASS", f"apply_mode {status.get('apply_mode')}, CUDA graphs on, "
                 f"{len(seeds)} versions match transformers (last commit "
                 f"{rank['commits'][-1]['seconds'] * 1e3:.2f} ms)")
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


# -- 2. a busy trainer stream --------------------------------------------------------------------
def _ipc_receiver(endpoint: str, device: str, out: Any, versions: int) -> None:
    """A subscriber process on the collective path: (version, data_path, wall clock)."""
    from subscriber_ext import WeightSubscriber

    torch.cuda.set_device(device)
    with WeightSubscriber(endpoint, collective=True, collective_device=device,
                          staging_budget_bytes=12 * GIB) as sub:
        out.put(("ready",))
        for wanted in range(1, versions + 1):
            staged = sub.wait_for_version(wanted, timeout=300)
            out.put((staged.version, staged.data_path, time.time()))
            staged.release()


def test_a_busy_trainer_stream_does_not_hold_a_version_back() -> None:
    ctx = mp.get_context("spawn")
    weights = {"w": torch.randn(16 << 20)}  # 64 MiB, host: the trainer's snapshot is ready
    busy_s = 6.0
    with WeightPublisher("tcp://127.0.0.1:0", collective="cuda_ipc", collective_device="cuda:0",
                         heartbeat_interval=0.2) as pub:
        out = ctx.Queue()
        proc = ctx.Process(target=_ipc_receiver, args=(pub.endpoint, "cuda:0", out, 2))
        proc.start()
        try:
            assert out.get(timeout=120) == ("ready",)
            time.sleep(2.0)  # the member polls for the handle
            pub.publish(weights)
            first = out.get(timeout=120)
            cycles = _cycles_per_second()
            torch.cuda._sleep(int(cycles * busy_s))  # the trainer's step, queued on its stream
            busy = torch.cuda.Event()
            busy.record()
            queued_at = time.time()
            pub.publish(weights)
            version, path, at = out.get(timeout=120)
            still_busy = not busy.query()
            busy.synchronize()
            ended = time.time()
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    detail = (f"version {version} by {path} {at - queued_at:.2f}s after publish; the stream's "
              f"work ended {ended - queued_at:.2f}s after (first version by {first[1]})")
    ok = path == "cuda_ipc" and still_busy
    line("busy_trainer_stream", "PASS" if ok else "FAIL", detail)
    assert ok, detail


# -- 3. weights on a non-current device ----------------------------------------------------------
def test_weights_on_a_non_current_device_are_copied_when_final() -> None:
    if torch.cuda.device_count() < 2:
        line("non_current_device", "SKIP", "one GPU: no device other than the current one to "
             "hold weights (tests/transport/test_gpu_invariants.py checks the devices waited for)")
        pytest.skip("one GPU")
    from subscriber_ext import WeightSubscriber

    torch.cuda.set_device(0)
    with torch.cuda.device(1):
        cycles = _cycles_per_second()
        torch.cuda._sleep(int(cycles * 2))  # the kernel that writes the weights is still queued
        weights = {"w": torch.full((64 << 20,), 3.0, device="cuda:1"),
                   "b": torch.arange(1 << 20, device="cuda:1", dtype=torch.float32)}
    with WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) as pub, \
            WeightSubscriber(pub.endpoint) as sub:
        version = pub.publish(weights)
        try:
            staged = sub.wait_for_version(version, timeout=120)
        except Exception as exc:  # stale bytes hashed: every chunk fails its checksum
            line("non_current_device", "FAIL", f"version {version} never staged: {exc}")
            raise
        ok = all(torch.equal(staged.tensors[name], t.cpu()) for name, t in weights.items())
        staged.release()
    line("non_current_device", "PASS" if ok else "FAIL",
         "weights on cuda:1 (current cuda:0), written 2 s after publish() was called: "
         f"{'bit-exact' if ok else 'STALE bytes'}")
    assert ok


# -- 4. expandable segments, a version of at least 4 GiB -----------------------------------------
EXPANDABLE_BYTES = 4 * GIB + (8 << 20)
BLOCK = 256 << 20


def _expandable_publisher(out: Any, inbox: Any) -> None:
    """The trainer, its allocator on expandable segments (set before CUDA starts)."""
    torch.cuda.set_device(0)
    weights = torch.empty(EXPANDABLE_BYTES, dtype=torch.uint8, device="cuda:0")
    for index, start in enumerate(range(0, EXPANDABLE_BYTES, BLOCK)):
        weights[start: start + BLOCK] = index % 251 + 1
    with WeightPublisher("tcp://127.0.0.1:0", collective="cuda_ipc", collective_device="cuda:0",
                         heartbeat_interval=0.2, chunk_size=64 << 20,
                         collective_bucket_bytes=256 << 20) as pub:
        out.put(("endpoint", pub.endpoint))
        inbox.get(timeout=120)  # the subscriber is polling
        version = pub.publish({"w": weights})
        table = pub._collective.table  # type: ignore[union-attr]
        deadline = time.monotonic() + 120
        while (table.newest_ipc is None or table.newest_ipc.version < version) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        handle = table.newest_ipc
        out.put(("handle", -1 if handle is None else len(handle.handle),
                 b"" if handle is None else handle.handle[:2]))
        inbox.get(timeout=300)  # until the subscriber has it


def test_expandable_segments_version_of_4_gib_by_cuda_ipc() -> None:
    from subscriber_ext import WeightSubscriber

    ctx = mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC": "1"}
    # the child inherits it; this process's allocator is already set
    with scoped_environment(env):
        # the exporter is the child: the importer (this process) may pidfd_getfd its
        # descriptors under Yama ptrace_scope 1 (a parent may trace its descendants)
        proc = ctx.Process(target=_expandable_publisher, args=(out, inbox))
        proc.start()
    detail = ""
    ok = False
    try:
        kind, endpoint = out.get(timeout=180)
        assert kind == "endpoint"
        with WeightSubscriber(endpoint, collective=True, collective_device="cuda:0",
                              staging_budget_bytes=12 * GIB) as sub:
            time.sleep(2.0)
            inbox.put("go")
            _, handle_bytes, prefix = out.get(timeout=300)
            staged = sub.wait_for_version(1, timeout=300)
            data = staged.tensors["w"]
            exact = all(bool((data[s: s + BLOCK] == i % 251 + 1).all())
                        for i, s in enumerate(range(0, EXPANDABLE_BYTES, BLOCK)))
            ok = staged.data_path == "cuda_ipc" and exact and handle_bytes > 256
            detail = (f"{EXPANDABLE_BYTES / GIB:.2f} GiB by {staged.data_path}, handle "
                      f"{handle_bytes} bytes (kind {prefix[1:2]!r}: 'e' = expandable segment), "
                      f"{'bit-exact' if exact else 'WRONG BYTES'}")
            if staged.data_path != "cuda_ipc":
                detail += f"; collective status {sub.status().get('collective')}"
            staged.release()
        inbox.put("done")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    line("expandable_segments_4gib", "PASS" if ok else "FAIL", detail)
    assert ok, detail


# -- 5. the seed communicator formed and closed 20 times -----------------------------------------
def _seed_worker(port_box: Any, out: Any, device: str) -> None:
    """The replica's worker: rank 0 (it serves the store), 20 groups in a row."""
    from subscriber_ext.vllm_ext.seed.communicator import WeightCommunicator

    os.environ.update(one_gpu_nccl_env("worker"))
    torch.cuda.set_device(device)
    while True:
        port = port_box.get(timeout=120)
        if port is None:
            return
        try:
            comm = WeightCommunicator("127.0.0.1", port, 0, 2, device=device, timeout_s=60)
            tensor = torch.zeros(1 << 20, device=device)
            comm.broadcast(tensor, src=1)
            out.put(("ok", float(tensor[0])))
            comm.close()
        except Exception as exc:
            out.put(("error", f"{type(exc).__name__}: {exc}"[:400]))
            return


def test_seed_communicator_reinitialised_20_times_leaks_nothing() -> None:

    ctx = mp.get_context("spawn")
    worker_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    port_box, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_seed_worker, args=(port_box, out, worker_device))
    proc.start()
    with scoped_environment(one_gpu_nccl_env("trainer")):
        before, after = _seed_cycles(port_box, out, proc, worker_device)
    ok = after[0] <= before[0] + 2 and after[1] <= before[1] + 2
    line("seed_reinit_20", "PASS" if ok else "FAIL",
         f"20 groups (worker on {worker_device}"
         f"{', NCCL_HOSTID per process' if one_gpu_nccl_env('x') else ''}): threads "
         f"{before[0]} -> {after[0]}, descriptors {before[1]} -> {after[1]}")
    assert ok


def _seed_cycles(port_box: Any, out: Any, proc: Any,
                 worker_device: str) -> tuple[tuple[int, int], tuple[int, int]]:
    from subscriber_ext.vllm_ext.seed.communicator import WeightCommunicator
    from weightpub_wire.collective_group import bounded_start

    before: tuple[int, int] | None = None
    try:
        for cycle in range(21):
            port = _free_port()
            port_box.put(port)
            time.sleep(0.2)  # rank 0 binds the store first
            try:
                comm = bounded_start(
                    lambda p=port: WeightCommunicator("127.0.0.1", p, 1, 2, device="cuda:0",
                                                      timeout_s=60),
                    90.0, lambda: None, "seed communicator")
            except Exception as exc:
                worker = ("?", "no word from the worker")
                with contextlib.suppress(Exception):
                    worker = out.get(timeout=30)
                reason = f"{type(exc).__name__}: {str(exc)[:300]} (worker: {worker[1]})"
                if cycle == 0 and worker_device == "cuda:0":
                    line("seed_reinit_20", "SKIP", "NCCL refuses two ranks on one GPU (even as "
                         f"two NCCL_HOSTIDs): {reason}")
                    pytest.skip(reason)
                line("seed_reinit_20", "FAIL", f"cycle {cycle}: {reason}")
                raise
            tensor = torch.full((1 << 20,), float(cycle + 1), device="cuda:0")
            comm.broadcast(tensor, src=1)
            kind, value = out.get(timeout=120)
            assert (kind, value) == ("ok", float(cycle + 1)), (kind, value)
            comm.close()
            if cycle == 0:  # the first group loads NCCL and its long-lived threads
                gc.collect()
                time.sleep(1.0)
                before = _resources()
        gc.collect()
        time.sleep(2.0)
        after = _resources()
    finally:
        port_box.put(None)
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert before is not None
    return before, after


# -- 6. NCCL between two processes; the peer killed mid-broadcast --------------------------------
NCCL_TIMEOUT = 10.0
DATA, STALL = 1, 2


def _nccl_member(port: int, device: str, out: Any) -> None:
    """A node: takes buckets until told to stall (a replica hung in its step), then waits
    to be killed without posting the broadcast the trainer is in."""
    from weightpub_wire.collective_group import CollectiveGroup, GroupError, connect_store

    os.environ.update(one_gpu_nccl_env("node"))
    torch.cuda.set_device(device)
    try:
        store = connect_store("127.0.0.1", port, 30.0)
        group = CollectiveGroup("nccl", store, "issue19/1", 1, 2, timeout=NCCL_TIMEOUT,
                                local_host="127.0.0.1", device=torch.device(device))
    except GroupError as exc:
        out.put(("refused", str(exc)[:400]))
        return
    out.put(("joined", ""))
    bucket = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    while True:
        header = torch.zeros(1, dtype=torch.int64)
        group.broadcast(header)  # host memory: the control group
        if int(header[0]) == STALL:
            out.put(("stalled", 0))
            time.sleep(3600)
        group.broadcast(bucket)
        out.put(("bucket", int(bucket[0])))


def test_nccl_between_two_processes_and_a_peer_killed_mid_broadcast() -> None:
    from weightpub_wire.collective_group import (
        CollectiveGroup,
        GroupError,
        Rendezvous,
        stuck_rendezvous,
    )

    ctx = mp.get_context("spawn")
    device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    rendezvous = Rendezvous("127.0.0.1", timeout=30.0)
    out = ctx.Queue()
    proc = ctx.Process(target=_nccl_member, args=(rendezvous.port, device, out))
    proc.start()
    group = None
    started = time.monotonic()
    try:
        try:
            with scoped_environment(one_gpu_nccl_env("trainer")):  # NCCL reads it at init
                group = CollectiveGroup("nccl", rendezvous.store, "issue19/1", 0, 2,
                                        timeout=NCCL_TIMEOUT, local_host="127.0.0.1",
                                        device=torch.device("cuda:0"))
        except GroupError as exc:
            member = ("?", "no word from the member")
            with contextlib.suppress(Exception):
                member = out.get(timeout=30)
            alive = _gloo_still_works()
            detail = (f"NCCL refused the group after {time.monotonic() - started:.1f}s: "
                      f"{str(exc)[:300]}; member: {member[1][:200]}; this process lives on "
                      f"({'a fresh gloo group works' if alive else 'GLOO FAILED'}; stuck "
                      f"rendezvous threads {stuck_rendezvous()})")
            line("nccl_two_processes", "SKIP" if alive else "FAIL", detail)
            assert alive, detail
            pytest.skip(detail)
        assert out.get(timeout=60)[0] == "joined"
        bucket = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda:0")
        for _ in range(3):
            group.broadcast(torch.tensor([DATA], dtype=torch.int64))
            group.broadcast(bucket)
            assert out.get(timeout=60) == ("bucket", 7)
        group.broadcast(torch.tensor([STALL], dtype=torch.int64))
        assert out.get(timeout=60)[0] == "stalled"
        killer = threading.Timer(1.0, os.kill, args=(proc.pid, signal.SIGKILL))
        killer.start()  # the node dies while the trainer's NCCL broadcast waits for it
        posted = time.monotonic()
        why = "none"
        failed_after: float | None = None
        try:
            group.broadcast(bucket)
        except GroupError as exc:
            failed_after = time.monotonic() - posted
            why = str(exc)[:200]
        killer.join()
        group.close()
        group = None
        time.sleep(5.0)  # a watchdog or monitor that would end the process has had its chance
        alive = _gloo_still_works()
        ok = failed_after is not None and failed_after < NCCL_TIMEOUT + 10 and alive
        line("nccl_two_processes", "PASS" if ok else "FAIL",
             f"3 buckets of 64 MiB to {device}; the node killed during a pending broadcast: "
             f"GroupError after {failed_after if failed_after is None else round(failed_after, 2)}"
             f"s ({why}); this process lives on ({'gloo works' if alive else 'GLOO FAILED'})")
        assert ok
    finally:
        if group is not None:
            group.close()
        if proc.is_alive():
            proc.kill()
        rendezvous.close()


def _gloo_still_works() -> bool:
    """A fresh two-rank gloo group in this process (threads): the process is healthy."""
    from torch.distributed import TCPStore

    from weightpub_wire.collective_group import CollectiveGroup

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=20))
    got: list[list[int]] = []

    def member(rank: int) -> None:
        mine = store if rank == 0 else TCPStore("127.0.0.1", store.port, is_master=False,
                                                wait_for_workers=False)
        group = CollectiveGroup("gloo", mine, "alive", rank, 2, timeout=20.0,
                                local_host="127.0.0.1")
        try:
            got.append(group.all_gather_flags(rank + 1))
        finally:
            group.close()

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return got == [[1, 2], [1, 2]]
