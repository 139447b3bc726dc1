"""What the GPU paths rely on, checked where no GPU is (issue 19, docs/RELIABILITY.md).

Each test pins one finding's fix with the part that runs on a CPU: the environment
an NCCL group is built under (read against torch's own header), the bound on a
rendezvous that never completes, the size of CUDA IPC handles torch makes, exactly
counted page-locked staging, the devices a snapshot waits for, and where the
collective path's device work is allowed to run (the source, read with ``ast``).
"""

from __future__ import annotations

import ast
import gc
import mmap
import os
import re
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from publisher.store.snapshot import cuda_devices
from weightpub_wire import protocol as wire
from weightpub_wire.buffers import BufferPool, HostAllocator, page_locked
from weightpub_wire.collective_group import (
    GroupError,
    bounded_start,
    nccl_environment,
    scoped_environment,
    stuck_rendezvous,
)
from weightpub_wire.collective_layout import (
    MAX_IPC_HANDLE_BYTES,
    MAX_IPC_STORAGE_BYTES,
    IpcHandle,
    ipc_handle_limit,
)
from weightpub_wire.errors import StagingBudgetError

REPO = Path(__file__).resolve().parents[2]
NCCL_HEADER = (Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed"
               / "c10d" / "ProcessGroupNCCL.hpp")


# -- finding 2: a dying replica cannot kill the trainer ------------------------------------------
def _error_modes(header: str) -> dict[int, str]:
    body = re.search(r"enum ErrorHandlingMode \{(.*?)\};", header, re.S)
    assert body is not None, "torch's ErrorHandlingMode enum moved"
    return {int(value): name for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", body.group(1))}


def test_nccl_groups_are_built_so_no_watchdog_or_monitor_can_end_the_process() -> None:
    header = NCCL_HEADER.read_text()
    env = nccl_environment()
    for name in env:  # every variable we set is one torch reads (a rename fails here)
        assert f'"{name}"' in header, name
    modes = _error_modes(header)
    tear_down = re.search(r"#define SHOULD_TEAR_DOWN\(a\) \((.*?)\)\n", header)
    assert tear_down is not None
    # SHOULD_TEAR_DOWN(a) is "a != NoHandling && a != CleanUpOnly": rethrow on the watchdog
    excluded = set(re.findall(r"a != (\w+)", tear_down.group(1)))
    mode = modes[int(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"])]
    assert mode in excluded and mode == "CleanUpOnly", (mode, excluded)
    assert modes[3] == "SkipCleanUp" and "SkipCleanUp" not in excluded  # torch's default kills
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"  # the monitor's terminateProcess
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # no dump signal in the shared store
    assert env["TORCH_NCCL_PROPAGATE_ERROR"] == "0"
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"


def test_the_environment_is_scoped_to_the_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = list(nccl_environment())
    monkeypatch.setenv(keys[0], "3")  # the trainer's own choice, for its own groups
    monkeypatch.delenv(keys[1], raising=False)
    with scoped_environment(nccl_environment()):
        assert {key: os.environ[key] for key in keys} == nccl_environment()
    assert os.environ[keys[0]] == "3"
    assert keys[1] not in os.environ


# -- finding 4: an NCCL rendezvous that never completes is bounded -------------------------------
def test_a_rendezvous_that_never_returns_is_abandoned_at_its_deadline() -> None:
    released = threading.Event()
    aborted: list[float] = []

    def never() -> None:  # ncclCommInitRank waiting for a rank that is not coming
        released.wait(30)

    before = stuck_rendezvous()
    started = time.monotonic()
    with pytest.raises(GroupError, match="not done within 0.5s"):
        bounded_start(never, 0.5, lambda: aborted.append(time.monotonic()), "probe")
    assert aborted and aborted[0] - started < 5
    assert stuck_rendezvous() == before + 1
    released.set()
    assert bounded_start(lambda: 42, 5.0, lambda: aborted.append(0.0), "probe") == 42
    with pytest.raises(ZeroDivisionError):
        bounded_start(lambda: 1 // 0, 5.0, lambda: aborted.append(0.0), "probe")
    assert len(aborted) == 1


# -- finding 6: CUDA IPC handles as large as torch makes them ------------------------------------
def _torch_handle(storage_bytes: int, *, fabric: bool, segment: int = 20 << 20) -> bytes:
    """``shareIpcHandle`` of an expandable segment: format and kind bytes, the header
    (pid, padding, segment size, count), one fd or fabric handle per spanned segment."""
    spanned = -(-storage_bytes // segment) + 1
    header = (1234).to_bytes(8, "little") + segment.to_bytes(8, "little") \
        + spanned.to_bytes(8, "little")
    return b"\x01\x02" + header + (bytes(64) if fabric else bytes(4)) * spanned


@pytest.mark.parametrize("storage_bytes", [1 << 20, 4 << 30, 16_100_000_000, 140 << 30])
@pytest.mark.parametrize("fabric", [False, True])
def test_expandable_segment_handles_fit_the_wire(storage_bytes: int, fabric: bool) -> None:
    raw = _torch_handle(storage_bytes, fabric=fabric)
    if storage_bytes >= 4 << 30:
        assert len(raw) > 256  # the old bound refused every such version
    handle = IpcHandle(version=3, device_index=0, handle=raw, storage_bytes=storage_bytes,
                       storage_offset=0, ref_counter_handle=b"/torch_1_2_3",
                       ref_counter_offset=0, event_handle=bytes(64), event_sync_required=True)
    reply = wire.CollectiveReply(req=1, publisher_id="pub-1", started_at=1.5, state="active",
                                 ipc=handle)
    back = wire.decode_as(wire.encode(reply), wire.CollectiveReply)
    assert back.ipc == handle
    assert len(raw) <= ipc_handle_limit(storage_bytes) <= MAX_IPC_HANDLE_BYTES
    # the small-segment worst case (2 MiB segments) fits as well
    assert len(_torch_handle(storage_bytes, fabric=True, segment=2 << 20)) \
        <= ipc_handle_limit(storage_bytes)


def test_a_handle_larger_than_its_storage_allows_is_refused() -> None:
    storage = 4 << 30
    common = dict(version=3, device_index=0, storage_bytes=storage, storage_offset=0,
                  ref_counter_handle=b"r", ref_counter_offset=0, event_handle=b"",
                  event_sync_required=False)
    ok = IpcHandle(handle=bytes(ipc_handle_limit(storage)), **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="handle"):
        IpcHandle(handle=bytes(ipc_handle_limit(storage) + 1), **common)  # type: ignore[arg-type]
    frame = wire.encode(wire.CollectiveReply(req=1, publisher_id="pub-1", started_at=1.5,
                                             state="active", ipc=ok))
    assert MAX_IPC_STORAGE_BYTES < 1 << 40 and MAX_IPC_HANDLE_BYTES < 64 << 20  # a control frame
    assert len(frame) < MAX_IPC_HANDLE_BYTES


# -- finding 7: page-locked staging of exactly its bytes, counted, and released -------------------
class _Registry:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.mapped_at_unregister: list[bool] = []
        self.maps: dict[int, weakref.ref[mmap.mmap]] = {}

    def register(self, address: int, nbytes: int) -> None:
        assert address not in self.registered
        self.registered[address] = nbytes

    def unregister(self, address: int) -> None:
        self.registered.pop(address)
        self.unregistered.append(address)
        ref = self.maps.get(address)
        self.mapped_at_unregister.append(ref is not None and ref() is not None)


def test_pinned_buffers_are_exact_counted_and_unregistered_with_their_last_view() -> None:
    registry = _Registry()
    pool = BufferPool(max_buffers=1, pinned=True, budget_bytes=40_000_000,
                      allocator=HostAllocator(registry.register, registry.unregister))
    nbytes = 16_100_001  # torch's host allocator would pin 32 MiB (a power of two)
    first = pool.take(nbytes)
    assert registry.registered == {first.data_ptr(): nbytes}
    assert pool.held_bytes == nbytes  # the budget sees what is locked
    first.fill_(7)
    view = first[10:20]
    pool.give(first)  # kept for reuse: still registered
    again = pool.take(nbytes - 5)  # the same pinned buffer again
    assert again.data_ptr() == view.data_ptr() - 10 and len(registry.registered) == 1
    with pytest.raises(StagingBudgetError):
        pool.take(30_000_000)  # would pass the budget; nothing is allocated
    assert len(registry.registered) == 1
    pool.forget(again.data_ptr())  # never coming back: the pool stops counting it
    address = again.data_ptr()
    del first, again
    gc.collect()
    assert registry.unregistered == []  # a view is still alive: the memory stays locked
    assert int(view.sum()) == 70
    del view
    gc.collect()
    assert registry.unregistered == [address] and pool.held_bytes == 0
    pageable = pool.take(1000, pinned=False)
    assert not registry.registered and pageable.numel() == 1000


def test_memory_is_unregistered_before_it_is_unmapped() -> None:
    registry = _Registry()
    mapping = mmap.mmap(-1, 1 << 20)
    buffer = page_locked(mapping, 1 << 20, registry.register, registry.unregister)
    registry.maps[buffer.data_ptr()] = weakref.ref(mapping)
    del mapping
    buffer[:5] = 1
    del buffer
    gc.collect()
    assert registry.mapped_at_unregister == [True]


def test_node_staging_segments_are_page_locked_exactly_when_asked() -> None:
    from subscriber_ext.transport.node.shared_segments import SharedSegments

    registry = _Registry()
    segments = SharedSegments("gpu-invariants", register=registry.register,
                              unregister=registry.unregister)
    pool = BufferPool(max_buffers=0, pinned=True, allocator=segments, budget_bytes=1 << 30)
    buffer = pool.take(5_000_001)
    segment = segments.segment_of(buffer)
    assert segment is not None and segment.nbytes == 5_000_001
    assert registry.registered == {buffer.data_ptr(): 5_000_001}
    address = buffer.data_ptr()
    pool.give(buffer)  # dropped: the descriptor closes, the mapping lives with its views
    del buffer
    gc.collect()
    assert registry.unregistered == [address] and segments.total_bytes == 0
    plain = pool.take(4096, pinned=False)
    assert not registry.registered and plain.numel() == 4096
    segments.close()


# -- finding 5: a snapshot waits for every device its sources live on -----------------------------
def test_a_snapshot_waits_for_each_source_device_once() -> None:
    devices = [torch.device("cuda", 1), torch.device("cpu"), torch.device("cuda", 0),
               torch.device("cuda", 1), torch.device("meta")]
    assert cuda_devices(devices) == [torch.device("cuda", 1), torch.device("cuda", 0)]
    assert cuda_devices([torch.device("cpu")]) == []


# -- findings 3, 10, 11: where the collective path's device work runs ----------------------------
DEVICE_FILES = ["publisher/collective/collective_sender.py",
                "publisher/collective/collective_ipc.py",
                "subscriber_ext/transport/collective/collective_receiver.py",
                "weightpub_wire/collective_group.py"]
STREAM_CONTEXTS = {"on_stream", "side_stream", "stream"}  # group's, cuda_ipc's, torch.cuda's


def _stream_context(node: ast.With) -> bool:
    for item in node.items:
        call = item.context_expr
        if isinstance(call, ast.Call):
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in STREAM_CONTEXTS:
                return True
    return False


def _device_work(tree: ast.AST) -> list[tuple[ast.Call, bool]]:
    """Each device allocation (``device=`` keyword) or ``copy_``, and whether a stream
    context encloses it."""
    found: list[tuple[ast.Call, bool]] = []

    def visit(node: ast.AST, inside: bool) -> None:
        if isinstance(node, ast.With) and _stream_context(node):
            inside = True
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            allocates = name in ("empty", "zeros", "ones", "tensor", "full") and any(
                k.arg == "device" and ast.unparse(k.value) != "'cpu'" for k in node.keywords)
            if allocates or name == "copy_":
                found.append((node, inside))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


@pytest.mark.parametrize("path", DEVICE_FILES)
def test_device_buckets_are_filled_and_copied_on_the_collective_stream(path: str) -> None:
    tree = ast.parse((REPO / path).read_text())
    work = _device_work(tree)
    assert work, f"{path}: no device allocation or copy found (the check reads nothing)"
    outside = [f"{path}:{node.lineno} {ast.unparse(node)[:80]}"
               for node, inside in work if not inside]
    assert outside == [], "device work on the caller's stream:\n" + "\n".join(outside)
    moved = [f"{path}:{node.lineno}" for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "to" and "device" in ast.unparse(node)]
    assert moved == [], f"headers or flags moved to the device: {moved}"


def test_flags_and_headers_travel_in_host_memory_over_the_control_group() -> None:
    """On gloo the control group is the group; the flags never touch a device."""
    from torch.distributed import TCPStore

    from weightpub_wire.collective_group import CollectiveGroup
    from weightpub_wire.collective_layout import RoundHeader

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results: dict[int, object] = {}

    def member(rank: int) -> None:
        mine = store if rank == 0 else TCPStore("127.0.0.1", store.port, is_master=False,
                                                wait_for_workers=False)
        group = CollectiveGroup("gloo", mine, "inv/1", rank, 2, timeout=20.0,
                                local_host="127.0.0.1")
        try:
            words = RoundHeader.empty() if rank else RoundHeader(
                kind=0, epoch=1, version=9, publisher=5).to_tensor()
            group.broadcast(words)
            results[rank] = (words.device.type, group.all_gather_flags(rank + 1))
        finally:
            group.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {0: ("cpu", [1, 2]), 1: ("cpu", [1, 2])}
