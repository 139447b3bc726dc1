"""One-sided NIXL reads between two real processes (``weightpub_wire/nixl_link.py``).

A holder process registers a buffer of known bytes and prints its offer; this
process reads ranges of it into its own registered memory. Offers from the network
are checked before NIXL sees them; a read outside a region or into unregistered
memory is refused without a transfer; a holder killed -9 costs a named error
within the timeout, never a hang. UCX is confined to loopback (``UCX_NET_DEVICES``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from tests.transport.zygote import PRELOAD
from weightpub.bench.forked import ForkedProcess
from weightpub_wire import nixl_link
from weightpub_wire.errors import ProtocolError, TransportError
from weightpub_wire.nixl_link import (
    NixlClaims,
    NixlOffer,
    NixlReader,
    NixlRegion,
    decode_offer,
    encode_offer,
    nixl_error,
)

pytestmark = pytest.mark.timeout(120)
SIZE = 4 << 20

def _holder_main(size: int) -> None:
    """The holder, in a process forked from the tests' torch-preloaded forkserver (an
    interpreter start costs seconds of CPU): registers ``size`` known bytes, prints its
    offer, holds them until a line (or EOF) on stdin."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    from weightpub_wire.nixl_link import NixlExporter

    data = _expected(size)
    holder = NixlExporter("test-holder")
    region = holder.register(data.ctypes.data, data.nbytes)
    print("OFFER", encode_offer(holder.offer([region])).hex(), flush=True)
    sys.stdin.readline()
    holder.close()


def _expected(size: int = SIZE) -> np.ndarray:
    return (np.arange(size, dtype=np.int64) * 2654435761 % 251).astype(np.uint8)


def _start_holder() -> tuple[ForkedProcess, NixlOffer]:
    """A holder process of ``SIZE`` known bytes, and its offer (UCX on loopback)."""
    assert nixl_error() is None, nixl_error()  # a test dependency: installed in CI
    proc = ForkedProcess(_holder_main, (SIZE,), stderr=sys.__stderr__, preload=PRELOAD,
                         name="test-nixl-holder")
    try:
        assert proc.stdout is not None
        line = ""
        while not line.startswith("OFFER "):  # NIXL logs to stdout too
            line = proc.stdout.readline()
            assert line, "the holder printed no offer"
        return proc, decode_offer(bytes.fromhex(line.split()[1]))
    except BaseException:
        _stop_holder(proc)
        raise


def _stop_holder(proc: ForkedProcess) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def shared_holder() -> Iterator[NixlOffer]:
    """One holder for the tests that only read it (each with a reader of its own)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_NET_DEVICES", "lo")
        proc, offer = _start_holder()
        try:
            yield offer
        finally:
            _stop_holder(proc)


@pytest.fixture
def holder(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ForkedProcess, NixlOffer]]:
    """A holder of the test's own (it may kill it)."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    proc, offer = _start_holder()
    try:
        yield proc, offer
    finally:
        _stop_holder(proc)


def test_ranges_are_read_one_sided_into_registered_memory(shared_holder: NixlOffer) -> None:
    offer = shared_holder
    want = _expected()
    dest = np.zeros(SIZE, dtype=np.uint8)
    reader = NixlReader("test-reader")
    try:
        reader.register(dest.ctypes.data, dest.nbytes)
        pieces = [(0, 0, dest.ctypes.data, 4096),  # the head
                  (0, 1 << 20, dest.ctypes.data + (1 << 20), 12345),  # an odd slice
                  (0, SIZE - 100, dest.ctypes.data + SIZE - 100, 100)]  # the tail
        assert reader.read(offer, pieces, timeout=30) == 4096 + 12345 + 100
        for _, offset, _, length in pieces:
            assert np.array_equal(dest[offset:offset + length], want[offset:offset + length])
        assert not dest[8192:(1 << 20)].any()  # nothing else was written
        assert reader.read(offer, [(0, 0, dest.ctypes.data, SIZE)], timeout=30) == SIZE
        assert np.array_equal(dest, want)
    finally:
        reader.close()


def test_bad_offers_and_reads_are_refused_before_any_transfer(shared_holder: NixlOffer) -> None:
    offer = shared_holder
    for data, match in ((b"\x93garbage", "nixl offer"),
                        (msgspec.msgpack.encode({"agent": "", "metadata": b"x", "regions": []}),
                         "nixl offer"),
                        (msgspec.msgpack.encode({"agent": "a", "metadata": b"x",
                                                 "regions": [[1, 2, 3]] * 65}), "nixl offer"),
                        (msgspec.msgpack.encode({"agent": "a", "metadata": b"x", "regions": [],
                                                 "mem_type": "GPU-ANY"}), "nixl offer")):
        with pytest.raises(ProtocolError, match=match):
            decode_offer(data)
    dest = np.zeros(1024, dtype=np.uint8)
    reader = NixlReader("test-reader")
    try:
        reader.register(dest.ctypes.data, dest.nbytes)
        with pytest.raises(ProtocolError, match="outside region 0"):
            reader.read(offer, [(0, SIZE - 10, dest.ctypes.data, 20)], timeout=5)
        with pytest.raises(ProtocolError, match="no region 3"):
            reader.read(offer, [(3, 0, dest.ctypes.data, 20)], timeout=5)
        other = np.zeros(64, dtype=np.uint8)
        with pytest.raises(ProtocolError, match="not registered"):
            reader.read(offer, [(0, 0, other.ctypes.data, 64)], timeout=5)
        lying = NixlOffer("someone-else", offer.metadata, offer.regions)
        with pytest.raises(ProtocolError, match="metadata is"):
            reader.read(lying, [(0, 0, dest.ctypes.data, 64)], timeout=5)
        assert reader.read(offer, [(0, 0, dest.ctypes.data, 1024)], timeout=30) == 1024
        assert np.array_equal(dest, _expected()[:1024])
        assert encode_offer(decode_offer(encode_offer(offer))) == encode_offer(offer)
        assert NixlRegion(1, 2) == NixlRegion(1, 2, 0)
        # claims words (a reused buffer told from a corrupt one): bounded when decoded,
        # refused before any READ when they do not cover the bytes asked about
        claimed = msgspec.structs.replace(offer, claims=NixlClaims(4096, 16, 65536, 3))
        assert decode_offer(encode_offer(claimed)) == claimed
        assert reader.newest_claim(offer, 0, 10, timeout=5) is None  # none offered
        with pytest.raises(ProtocolError, match="do not cover"):
            reader.newest_claim(claimed, 65536, 3 * 65536, timeout=5)
        for bad in ([4096, 16, 512, 3], [4096, 0, 65536, 3], [-1, 16, 65536, 3]):
            with pytest.raises(ProtocolError, match="nixl offer"):
                decode_offer(msgspec.msgpack.encode(
                    {"agent": "a", "metadata": b"x", "regions": [], "claims": bad}))
        # landings NIXL never let go of are bounded: past the limit no words READ is posted
        words = NixlClaims(offer.regions[0].address, 64, 65536, 1)
        reader._stuck.extend(np.zeros(1, dtype="<i8") for _ in range(nixl_link._MAX_STUCK))
        with pytest.raises(TransportError, match="never let go of"):
            reader.start_words(offer, words, 0, 8)
    finally:
        reader.close()
    assert reader.stuck_landings == 0  # forgotten with the rest on close


def test_a_holder_killed_mid_version_costs_a_named_error_not_a_hang(holder) -> None:
    proc, offer = holder
    dest = np.zeros(SIZE, dtype=np.uint8)
    reader = NixlReader("test-reader")
    try:
        reader.register(dest.ctypes.data, dest.nbytes)
        assert reader.read(offer, [(0, 0, dest.ctypes.data, SIZE)], timeout=30) == SIZE
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(TransportError, match="nixl"):
            for _ in range(50):  # a transport may notice on the first read or a later one
                reader.read(offer, [(0, 0, dest.ctypes.data, SIZE)], timeout=3)
        assert time.monotonic() - start < 60
    finally:
        reader.close()
