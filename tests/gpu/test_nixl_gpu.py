"""VRAM to VRAM over NIXL between two processes (issue 31.5), run when a GPU is lent.

A holder process puts known bytes in GPU memory, registers them (``mem_type``
"VRAM") and prints its offer; this process READs them one-sided into its own
registered GPU memory, checks every byte on the device, and prints one line per
check (``GPU-CHECK nixl_<name>: PASS|FAIL ...``, GB/s of the steady rounds) for
``tests/gpu/run_issue31.sh``. Also DRAM -> VRAM (a CPU trainer's snapshot into a GPU
replica's memory). UCX is confined to loopback; on one GPU UCX uses cuda_ipc / cuda_copy.
Skipped without CUDA or without NIXL (CPU CI: it must import and skip cleanly).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from weightpub_wire.nixl_link import NixlReader, decode_offer, nixl_error

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
needs = pytest.mark.skipif(not torch.cuda.is_available() or nixl_error() is not None,
                           reason="needs a CUDA GPU and nixl-cu12")
SIZE = 256 << 20
ROUNDS = 6

HOLDER = textwrap.dedent("""
    import sys, torch
    from weightpub_wire.nixl_link import NixlExporter, encode_offer
    where = sys.argv[1]
    data = (torch.arange({size} // 4, dtype=torch.int32) * 2654435761).view(torch.uint8)
    data = data.cuda() if where == "VRAM" else data.contiguous()
    torch.cuda.synchronize()
    holder = NixlExporter("gpu-holder")
    region = holder.register(data.data_ptr(), data.numel(), mem_type=where,
                             device=data.device.index or 0)
    print("OFFER", encode_offer(holder.offer([region], where)).hex(), flush=True)
    sys.stdin.readline()
    holder.close()
""")


def _expected() -> torch.Tensor:
    return (torch.arange(SIZE // 4, dtype=torch.int32) * 2654435761).view(torch.uint8)


def _read_rounds(where: str) -> tuple[bool, float]:
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(size=SIZE), where],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    reader = NixlReader("gpu-reader")
    try:
        assert proc.stdout is not None
        line = ""
        while not line.startswith("OFFER "):  # NIXL logs to stdout too
            line = proc.stdout.readline()
            assert line, "the holder printed no offer"
        offer = decode_offer(bytes.fromhex(line.split()[1]))
        dest = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
        reader.register(dest.data_ptr(), SIZE, mem_type="VRAM", device=dest.device.index or 0)
        seconds = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            reader.read(offer, [(0, 0, dest.data_ptr(), SIZE)], timeout=120)
            seconds.append(time.perf_counter() - start)
        exact = bool(torch.equal(dest.cpu(), _expected()))
        return exact, SIZE / statistics.median(seconds[2:]) / 1e9
    finally:
        reader.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@needs
@pytest.mark.parametrize("where", ["VRAM", "DRAM"])
def test_nixl_reads_into_gpu_memory(where: str) -> None:
    exact, gbps = _read_rounds(where)
    name = "vram_to_vram" if where == "VRAM" else "dram_to_vram"
    print(f"GPU-CHECK nixl_{name}: {'PASS' if exact else 'FAIL'} {SIZE >> 20} MiB, "
          f"{gbps:.1f} GB/s steady")
    assert exact
