"""The collective data path on CUDA (deselected on CPU CI; skipped where CUDA is missing).

One command on a single-GPU machine with the ``gpu`` extra installed (a few minutes):

    python -m pytest -m gpu tests/gpu/test_collective_gpu.py -q -s

1. A CUDA vLLM engine (TP=1) and the trainer on the same GPU: ``cuda_ipc``, the path
   one GPU allows (NCCL needs two devices). The publisher keeps the newest version
   in device memory and hands out its CUDA IPC handle; the replica copies it into
   its staging bucket by bucket, verifies the chunks and commits as usual. Three
   versions match transformers with ``data_path == "cuda_ipc"``; the commit pause
   and publish-to-applied time are printed.
2. Throughput, same run, interleaved: a 1 GiB version to a subscriber process on the
   same GPU by CUDA IPC vs by ZeroMQ frames (publish -> staged and verified).
3. With two GPUs only: the same over NCCL (the subscriber on ``cuda:1``).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import pytest
import torch

from publisher import WeightPublisher
from subscriber_ext import wait_until_applied
from tests.vllm.helpers import EXT, assert_matches_hf, new_weights, save_tiny

pytestmark = [
    pytest.mark.gpu, pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (a trainer and a replica on one GPU: CUDA IPC)"),
]
KIND = "qwen2"
N = 6
BIG = 1 << 30


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vllm import LLM

    engine = LLM(model=str(save_tiny(KIND, 0, tmp_path_factory.mktemp("ipc"))),
                 dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
                 max_model_len=256, gpu_memory_utilization=0.3, worker_extension_cls=EXT)
    yield engine
    del engine


def test_cuda_ipc_into_a_cuda_engine_matches_transformers(llm):
    with WeightPublisher("tcp://127.0.0.1:0", collective="cuda_ipc",
                         collective_device="cuda:0", heartbeat_interval=0.2) as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,),
                           kwargs={"collective": True})
        pauses, delays = [], []
        try:
            for seed in (81, 82, 83):
                weights = new_weights(KIND, seed)
                on_gpu = {name: t.cuda() for name, t in weights.items()}  # a trainer's weights
                started = time.perf_counter()
                version = pub.publish(on_gpu)
                rank = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                          fail_on_error=True)[0]
                delays.append(time.perf_counter() - started)
                assert rank["data_path"] == "cuda_ipc", rank
                pauses.append(rank["commits"][-1]["seconds"])
                assert_matches_hf(llm, KIND, weights, N)
            path = rank["subscriber"]["collective"]
            assert path["fallbacks"] == 0 and path["rounds"] >= 3, path
        finally:
            llm.collective_rpc("stop_weight_subscriber")
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"\ncuda_ipc into a CUDA engine ({nbytes / 1e6:.1f} MB): commit pause "
          f"{statistics.median(pauses) * 1e3:.2f} ms (median of 3), publish -> applied "
          f"{statistics.median(delays) * 1e3:.1f} ms")


def _receive(endpoint: str, collective: bool, device: str, out: Any) -> None:
    """A subscriber process: (version, data_path, wall clock when staged) per version."""
    from subscriber_ext import WeightSubscriber

    torch.cuda.set_device(device)
    with WeightSubscriber(endpoint, collective=collective, collective_device=device,
                          staging_budget_bytes=4 * BIG) as sub:
        out.put(("ready",))
        seen = 0
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            staged = sub.wait_for_version(seen + 1, timeout=600)
            out.put((staged.version, staged.data_path, time.time()))
            seen = staged.version
            staged.release()
            if seen >= 6:
                return


def _race(backend: str, device: str) -> None:
    """Publish 1 GiB versions to one subscriber per path, interleaved; print the rates."""
    ctx = mp.get_context("spawn")
    weights = {"w": torch.randn(BIG // 4, device="cuda:0")}
    with WeightPublisher("tcp://127.0.0.1:0", collective=backend, collective_device="cuda:0",
                         collective_bucket_bytes=256 << 20, chunk_size=16 << 20) as fast, \
            WeightPublisher("tcp://127.0.0.1:0", chunk_size=16 << 20) as frames:
        queues = {name: ctx.Queue() for name in ("fast", "frames")}
        procs = [ctx.Process(target=_receive, args=(fast.endpoint, True, device, queues["fast"])),
                 ctx.Process(target=_receive, args=(frames.endpoint, False, device,
                                                    queues["frames"]))]
        for proc in procs:
            proc.start()
        try:
            for q in queues.values():
                assert q.get(timeout=120) == ("ready",)
            time.sleep(3.0)  # the fast subscriber joins the path (group / handle polls)
            times: dict[str, list[float]] = {"fast": [], "frames": []}
            for version in range(1, 7):
                for name, pub in (("fast", fast), ("frames", frames)):  # interleaved
                    started = time.time()
                    pub.publish(weights, version=version)
                    got, path, at = queues[name].get(timeout=300)
                    assert got == version
                    if name == "fast" and version > 1:
                        assert path == backend, path
                    if version > 1:  # the first version warms buffers up
                        times[name].append(at - started)
        finally:
            for proc in procs:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
    fast_s, frames_s = statistics.median(times["fast"]), statistics.median(times["frames"])
    print(f"\n1 GiB version, publish -> staged and verified (median of 5): {backend} "
          f"{fast_s:.3f} s ({BIG / fast_s / 1e9:.2f} GB/s), zmq frames {frames_s:.3f} s "
          f"({BIG / frames_s / 1e9:.2f} GB/s): {frames_s / fast_s:.1f}x")


def test_cuda_ipc_throughput_vs_zeromq_frames():
    _race("cuda_ipc", "cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_nccl_throughput_vs_zeromq_frames():
    _race("nccl", "cuda:1")
