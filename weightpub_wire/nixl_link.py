"""One-sided reads of registered memory with NIXL (UCX: RDMA, NVLink, shared memory, TCP).

Why: every frontier anchor moves weights by one-sided reads of registered memory;
ZeroMQ over TCP spends CPU per byte on both sides. Here the side holding bytes
(a trainer's snapshot) registers its buffers once (``NixlExporter``) and hands out a
``NixlOffer`` over the control plane (ZeroMQ, CURVE-authenticated when keys are
set); a reader (``NixlReader``) adds the offer's agent and READs byte ranges of a
region straight into its own registered memory, then verifies them like any other
bytes (the manifest's checksums): a torn read of a region being overwritten fails
its checksum, never stages.

Wire rules: NIXL's own ``get_serialized_descs`` pickles; we never do. An offer is a
msgspec struct (agent name, the agent's metadata blob, regions as
``(address, length, device)``), bounded before anything is built, and the reader
builds its descriptor lists from those numbers. The metadata blob is parsed by
NIXL's C++ (``add_remote_agent``): accept offers only from an admitted peer.

The import is lazy (``nixl_cu12``, ``pip install weightpub[nixl]``); ``nixl_error``
says why the path is off where it cannot run.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import msgspec
import numpy

from weightpub_wire.errors import ProtocolError, TransportError

__all__ = ["NIXL_PATHS", "NixlClaims", "NixlExporter", "NixlOffer", "NixlReader", "NixlRegion",
           "NixlTransfer", "NixlWords", "decode_offer", "encode_offer", "nixl_error"]

#: NIXL's Python package on CPU-only and CUDA 12 hosts (the umbrella ``nixl`` pulls CUDA wheels)
MODULE = "nixl_cu12"
MAX_REGIONS = 64
MAX_METADATA = 1 << 20
MAX_NAME = 128
_U64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # user-space addresses fit
_POLL_S = 0.0002
_MAX_LANDINGS = 8  # words landings kept for reuse (one per holder's READ in flight)
#: words landings NIXL would not let go of, kept registered (bytes may still land there):
#: past this many, no more words READs are posted (``TransportError``: the caller falls
#: back), so a holder that keeps failing cannot grow this reader's registered memory
_MAX_STUCK = 64
_names = itertools.count()
#: ``StagedVersion.data_path`` / ``Report.data_path`` of a version read one-sided: every
#: chunk over NIXL, or some over ZeroMQ frames after a fallback
NIXL_PATHS = ("nixl", "nixl+zmq")
logger = logging.getLogger("weightpub.nixl")


class NixlRegion(msgspec.Struct, array_like=True, frozen=True):
    """One registered region: where it starts in the holder's address space, its size."""

    address: _U64
    length: _U64
    device: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0


class NixlClaims(msgspec.Struct, array_like=True, frozen=True):
    """Where a holder keeps, per ``region`` bytes of the offered buffer, the number of the
    version whose write reached them last (``publisher.store.buffer_claims``: little-endian
    int64 words in host memory, registered with the holder's agent). A claim is stored
    before its write and never undone, so a reader whose chunk failed its checksum READs
    the chunk's words: one above ``version`` means the buffer was reused for a newer
    version under the read (``reused``), not that the bytes were corrupt."""

    address: _U64
    length: Annotated[int, msgspec.Meta(ge=8, le=1 << 40)]  # bytes of words
    region: Annotated[int, msgspec.Meta(ge=4096, le=1 << 40)]  # buffer bytes per word
    version: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # the offered version's


class NixlOffer(msgspec.Struct, frozen=True):
    """What a reader needs to READ a holder's regions: its agent and the regions (and,
    optionally, where to tell a reused buffer from a corrupt one: ``claims``; readers
    that predate it ignore it)."""

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
    metadata: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_METADATA)]
    regions: Annotated[list[NixlRegion], msgspec.Meta(max_length=MAX_REGIONS)]
    mem_type: Annotated[str, msgspec.Meta(pattern="^(DRAM|VRAM)$")] = "DRAM"
    claims: NixlClaims | None = None
    #: a version offered before its copy is complete (a cut-through relay's): per chunk
    #: (``region`` is the chunk size) the version whose bytes are final there; a reader
    #: READs a chunk only once its word holds ``version`` (``NixlReader.ready_chunks``)
    ready: NixlClaims | None = None


_decoder = msgspec.msgpack.Decoder(NixlOffer)


def encode_offer(offer: NixlOffer) -> bytes:
    return msgspec.msgpack.encode(offer)


def decode_offer(data: bytes) -> NixlOffer:
    """An offer from the network, checked (sizes, counts, names) before anything is built."""
    if len(data) > MAX_METADATA + 64 * MAX_REGIONS + 1024:
        raise ProtocolError(f"nixl offer: {len(data)} bytes is over the bound")
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"nixl offer: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"nixl offer: not msgpack ({exc})") from exc


def nixl_error() -> str | None:
    """Why the NIXL path cannot run here, or None."""
    try:
        __import__(MODULE)
    except Exception as exc:  # ImportError, or a broken native library
        return (f"NIXL is not available ({type(exc).__name__}: {exc}); "
                "install it with `pip install weightpub[nixl]`")
    return None


def _agent(prefix: str) -> Any:
    error = nixl_error()
    if error is not None:
        raise TransportError(error)
    if "UCX_NET_DEVICES" not in os.environ:
        logger.warning("nixl: UCX_NET_DEVICES is not set, so UCX listens on every interface "
                       "(docs/RELIABILITY.md); set it to the fabric's devices, e.g. "
                       "UCX_NET_DEVICES=mlx5_0:1 (or lo on one host)")
    api = __import__(f"{MODULE}._api", fromlist=["nixl_agent", "nixl_agent_config"])
    name = f"{prefix}-{os.getpid()}-{next(_names)}"
    config = api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
    with _agent_lock:  # the bindings' config class is swapped while this agent is made
        bind = api.nixlBind
        plain = bind.nixlAgentConfig
        bind.nixlAgentConfig = _paced_config(plain)
        try:
            return name, api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = plain


_agent_lock = threading.Lock()
#: microseconds NIXL's progress thread waits for UCX events between turns; the
#: Python API fixes it at 0, a thread that spins: 0.15-0.3 of a core per idle agent
#: on this box, taken from the copies and hashes beside it (docs/benchmarks.md). The
#: wait ends early on an event (UCX's event fd), so reads do not wait it out.
PROGRESS_DELAY_US = 1000


def _paced_config(plain: Any) -> Any:
    """NIXL's agent config class with ``pthrDelay`` pinned to ``PROGRESS_DELAY_US``."""

    class Paced(plain):
        def __setattr__(self, key: str, value: Any) -> None:
            if key == "pthrDelay":
                value = PROGRESS_DELAY_US
            super().__setattr__(key, value)

    return Paced


class NixlExporter:
    """Registers buffers once and offers them for one-sided reads; deregisters on close."""

    def __init__(self, prefix: str = "weightpub-holder") -> None:
        self.name, self._agent = _agent(prefix)
        self._lock = threading.Lock()
        self._registered: dict[tuple[int, int], Any] = {}

    def register(self, address: int, length: int, *, mem_type: str = "DRAM",
                 device: int = 0) -> NixlRegion:
        """Register ``[address, address + length)`` (once; again is free)."""
        key = (address, length)
        with self._lock:
            if key not in self._registered:
                self._registered[key] = self._agent.register_memory(
                    [(address, length, device, "")], mem_type)
        return NixlRegion(address, length, device)

    def forget(self, address: int, length: int) -> None:
        """Deregister a buffer that is being freed (never read it after)."""
        with self._lock:
            handle = self._registered.pop((address, length), None)
        if handle is not None:
            self._agent.deregister_memory(handle)

    def offer(self, regions: Sequence[NixlRegion], mem_type: str = "DRAM",
              claims: NixlClaims | None = None, ready: NixlClaims | None = None) -> NixlOffer:
        """The regions with the agent's metadata as it is now: it carries the remote keys
        of every buffer registered so far, so an offer made before a registration does
        not reach the new buffer (the reader adds the agent again when it changes)."""
        with self._lock:
            metadata = bytes(self._agent.get_agent_metadata())
        return NixlOffer(self.name, metadata, list(regions), mem_type, claims, ready)

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._registered)

    def close(self) -> None:
        with self._lock:
            handles, self._registered = list(self._registered.values()), {}
        for handle in handles:
            self._agent.deregister_memory(handle)


class NixlTransfer:
    """One READ in flight (``NixlReader.start``): whose, NIXL's handle, its bytes."""

    __slots__ = ("agent", "handle", "nbytes", "state")

    def __init__(self, agent: str, handle: Any, nbytes: int) -> None:
        self.agent = agent
        self.handle = handle
        self.nbytes = nbytes
        self.state = "PROC"


class NixlWords:
    """One READ of a holder's words in flight (``NixlReader.start_words``)."""

    __slots__ = ("count", "landing", "released", "transfer")

    def __init__(self, transfer: NixlTransfer, landing: numpy.ndarray, count: int) -> None:
        self.transfer = transfer
        self.landing = landing
        self.count = count
        self.released = False


class NixlReader:
    """Reads byte ranges of an offer's regions into local registered memory."""

    def __init__(self, prefix: str = "weightpub-reader") -> None:
        self.name, self._agent = _agent(prefix)
        self._local: dict[tuple[int, int], Any] = {}
        self._starts: list[tuple[int, int]] = []  # ``_local``'s keys, sorted (``_into``)
        self._kinds: dict[tuple[int, int], tuple[str, int]] = {}  # (mem_type, device)
        self._remotes: dict[str, tuple[str, bytes]] = {}  # agent -> (NIXL's name, metadata)
        #: landings of words READs (``start_words``), registered, free for reuse
        self._landings: list[numpy.ndarray] = []
        self._stuck: list[numpy.ndarray] = []  # landings of READs NIXL did not let go of

    def register(self, address: int, length: int, *, mem_type: str = "DRAM",
                 device: int = 0) -> None:
        """Register a local destination buffer once (staging is reused across versions);
        ``mem_type`` "VRAM" with its CUDA ``device`` for GPU memory."""
        if (address, length) not in self._local:
            self._local[(address, length)] = self._agent.register_memory(
                [(address, length, device, "")], mem_type)
            self._kinds[(address, length)] = (mem_type, device)
            bisect.insort(self._starts, (address, length))

    def registered(self, address: int, length: int) -> bool:
        return (address, length) in self._local

    def forget_local(self, address: int, length: int) -> None:
        """Deregister a local buffer that is being freed (nothing reads into it after)."""
        handle = self._local.pop((address, length), None)
        self._kinds.pop((address, length), None)
        if handle is not None:
            self._starts.remove((address, length))
            self._agent.deregister_memory(handle)

    @property
    def registered_bytes(self) -> int:
        return sum(length for _, length in self._local)

    def offer(self, regions: Sequence[NixlRegion], claims: NixlClaims | None = None
              ) -> NixlOffer:
        """This reader's own registered memory offered for one-sided reads (toward peers
        over NIXL: a member READs a version where it landed in another member's staging,
        registered when it came over NIXL, so exporting it costs no registration). Each
        region must lie in one registered local buffer, all of one memory kind
        (``ProtocolError`` otherwise). Call on the thread that uses this reader."""
        kinds = set()
        for region in regions:
            into = self._into(region.address, region.length)
            if into is None or region.length <= 0:
                raise ProtocolError(f"nixl offer: [{region.address:#x}, +{region.length}) is "
                                    "not in this reader's registered memory")
            kinds.add(self._kinds[into])
        if len(kinds) > 1:
            raise ProtocolError("nixl offer: regions in DRAM and VRAM")
        mem_type, _ = kinds.pop() if kinds else ("DRAM", 0)
        return NixlOffer(self.name, bytes(self._agent.get_agent_metadata()), list(regions),
                         mem_type, claims)

    def connect(self, offer: NixlOffer) -> str:
        """Add the offer's agent (again when its metadata changed: a buffer registered
        since carries new remote keys); returns the name NIXL knows it by."""
        held = self._remotes.get(offer.agent)
        known = None if held is None or held[1] != offer.metadata else held[0]
        if known is None:
            try:
                added = self._agent.add_remote_agent(offer.metadata)
            except Exception as exc:
                raise TransportError(f"nixl: cannot add agent {offer.agent!r}: {exc}") from exc
            known = added.decode() if isinstance(added, bytes) else str(added)
            if known != offer.agent:
                self._agent.remove_remote_agent(known)
                raise ProtocolError(f"nixl offer names agent {offer.agent!r} but its "
                                    f"metadata is {known!r}'s")
            self._remotes[offer.agent] = (known, offer.metadata)
        return known

    def read(self, offer: NixlOffer, pieces: Iterable[tuple[int, int, int, int]],
             *, timeout: float) -> int:
        """READ ``(region, offset, local_address, length)`` pieces; return the bytes read.

        Every piece must lie inside its region and a registered local buffer; the
        transfer is polled until done, an error, or ``timeout`` seconds
        (``TransportError``: the caller falls back to ZeroMQ frames).
        """
        transfer = self.start(offer, pieces)
        if transfer is None:
            return 0
        deadline = time.monotonic() + timeout
        try:
            while not self.poll(transfer):
                if time.monotonic() > deadline:
                    raise TransportError(f"nixl read from {offer.agent!r}: not done "
                                         f"after {timeout:.1f} s")
                time.sleep(_POLL_S)  # NIXL's progress thread moves the bytes
        except TransportError:
            self.forget(offer.agent)  # a holder that failed once is added afresh next time
            raise
        finally:
            self.release(transfer)
        return transfer.nbytes

    def newest_claim(self, offer: NixlOffer, start: int, stop: int, *,
                     timeout: float) -> int | None:
        """The newest version claimed over bytes ``[start, stop)`` of the offer's region 0,
        READ from its claims words now (``NixlClaims``); None when the offer has none.
        ``TransportError`` as ``read``; ``ProtocolError`` when the words are not there."""
        claims = offer.claims
        if claims is None or stop <= start:
            return None
        first = start // claims.region
        words = self._wait_words(offer, claims, first, -(-stop // claims.region) - first,
                                 timeout)
        return int(words.max())

    def ready_mask(self, offer: NixlOffer, first: int, count: int, *,
                   timeout: float) -> numpy.ndarray:
        """Which of chunks ``first`` .. ``first + count - 1`` (of the offer's region 0) are
        final now, READ from the offer's readiness map (``NixlOffer.ready``); all of
        them when it has none. ``TransportError`` as ``read``; ``ProtocolError`` when
        the map does not cover them."""
        ready = offer.ready
        if ready is None:
            return numpy.ones(max(count, 0), dtype=bool)
        return self._wait_words(offer, ready, first, count, timeout) >= ready.version

    def _wait_words(self, offer: NixlOffer, where: NixlClaims, first: int, count: int,
                    timeout: float) -> numpy.ndarray:
        """``start_words``, polled until done or ``timeout`` (``TransportError``)."""
        read = self.start_words(offer, where, first, count)
        deadline = time.monotonic() + timeout
        try:
            while (words := self.words_done(read)) is None:
                if time.monotonic() > deadline:
                    raise TransportError(f"nixl read from {offer.agent!r}: words not read "
                                         f"after {timeout:.1f} s")
                time.sleep(_POLL_S)
            return words.copy()
        except TransportError:
            self.forget(offer.agent)  # a holder that failed once is added afresh next time
            raise
        finally:
            self.release_words(read)

    def start_words(self, offer: NixlOffer, where: NixlClaims, first: int,
                    count: int) -> NixlWords:
        """Post a READ of words ``first`` .. ``first + count - 1`` of ``where`` (claims
        words or a readiness map, the offer's agent's) into a landing of this reader's
        own, registered once and reused; return at once (``words_done``, then
        ``release_words``). Why not wait: a holder that does not answer must not hold
        the caller's thread (the subscriber's loop). ``ProtocolError`` when the words
        do not cover the range; ``TransportError`` when the READ cannot be posted."""
        if first < 0 or count <= 0 or (first + count) * 8 > where.length:
            raise ProtocolError(f"nixl offer: words of {where.length} bytes do not cover "
                                f"[{first}, {first + count}) (one per {where.region} bytes)")
        if len(self._stuck) >= _MAX_STUCK:
            raise TransportError(f"nixl: {len(self._stuck)} words READs were never let go "
                                 "of; no more are posted")
        landing = next((each for each in self._landings if len(each) >= count), None)
        if landing is None:
            landing = numpy.zeros(max(count, 512), dtype="<i8")
            self.register(landing.ctypes.data, landing.nbytes)
        else:
            self._landings.remove(landing)
        probe = NixlOffer(offer.agent, offer.metadata,
                          [NixlRegion(where.address, where.length)], "DRAM")
        try:
            transfer = self.start(probe, [(0, first * 8, landing.ctypes.data, count * 8)])
        except BaseException:
            self._landings.append(landing)
            raise
        assert transfer is not None
        return NixlWords(transfer, landing, count)

    def words_done(self, read: NixlWords) -> numpy.ndarray | None:
        """The words once READ (a view of the landing: valid until ``release_words``), None
        while in flight; ``TransportError`` when the READ failed."""
        if not self.poll(read.transfer):
            return None
        return read.landing[:read.count]

    def release_words(self, read: NixlWords) -> None:
        """Release a words READ (cancelled if still in flight). Its landing is reused only
        when NIXL let go of it; one it refused (bytes may still land) is kept aside,
        registered and never reused (``stuck_landings``)."""
        if read.released:
            return
        read.released = True
        if self.release(read.transfer):
            if len(self._landings) < _MAX_LANDINGS:
                self._landings.append(read.landing)
            else:
                self.forget_local(read.landing.ctypes.data, read.landing.nbytes)
        else:
            self._stuck.append(read.landing)

    @property
    def stuck_landings(self) -> int:
        """Words landings NIXL would not let go of (kept, never reused)."""
        return len(self._stuck)

    def start(self, offer: NixlOffer,
              pieces: Iterable[tuple[int, int, int, int]]) -> NixlTransfer | None:
        """Post one READ of ``pieces`` (checked as ``read`` does) and return at once;
        ``poll`` it, then ``release`` it. None when there is nothing to read."""
        remote: list[tuple[int, int, int]] = []
        local: list[tuple[int, int, int]] = []
        local_kind = "DRAM"
        for index, offset, address, length in pieces:
            if not 0 <= index < len(offer.regions):
                raise ProtocolError(f"nixl read: no region {index}")
            region = offer.regions[index]
            if offset < 0 or length <= 0 or offset + length > region.length:
                raise ProtocolError(f"nixl read: [{offset}, {offset + length}) is outside "
                                    f"region {index} ({region.length} bytes)")
            into = self._into(address, length)
            if into is None:
                raise ProtocolError("nixl read: destination is not registered memory")
            kind, device = self._kinds[into]
            if local and kind != local_kind:
                raise ProtocolError("nixl read: destinations of one READ in DRAM and VRAM")
            local_kind = kind
            remote.append((region.address + offset, length, region.device))
            local.append((address, length, device))
        if not remote:
            return None
        agent = self.connect(offer)
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(local, local_kind),
                self._agent.get_xfer_descs(remote, offer.mem_type), agent)
        except Exception as exc:
            self.forget(offer.agent)
            raise TransportError(f"nixl read from {offer.agent!r}: {exc}") from exc
        transfer = NixlTransfer(offer.agent, handle, sum(n for _, n, _ in remote))
        try:
            transfer.state = self._agent.transfer(handle)
        except Exception as exc:  # NIXL's own (remote disconnect, backend errors)
            self.release(transfer)
            self.forget(offer.agent)
            raise TransportError(f"nixl read from {offer.agent!r}: {exc}") from exc
        return transfer

    def _into(self, address: int, length: int) -> tuple[int, int] | None:
        """The registered local buffer holding ``[address, address + length)``, or None:
        the nearest one starting at or below it (a sparse buffer registers up to a
        thousand ranges, and a READ may have a piece per row), else any (overlaps)."""
        index = bisect.bisect_right(self._starts, (address, 1 << 64)) - 1
        if index >= 0:
            start, size = self._starts[index]
            if address + length <= start + size:
                return start, size
        return next(((a, n) for a, n in self._starts
                     if a <= address and address + length <= a + n), None)

    def poll(self, transfer: NixlTransfer) -> bool:
        """True when the READ is done; ``TransportError`` when it failed."""
        try:
            if transfer.state not in ("DONE", "ERR"):
                transfer.state = self._agent.check_xfer_state(transfer.handle)
        except Exception as exc:
            transfer.state = "ERR"
            raise TransportError(f"nixl read from {transfer.agent!r}: {exc}") from exc
        if transfer.state == "ERR":
            raise TransportError(f"nixl read from {transfer.agent!r} failed")
        return transfer.state == "DONE"

    def release(self, transfer: NixlTransfer) -> bool:
        """Free the transfer's handle (NIXL cancels one still in flight); False when NIXL
        refused, i.e. bytes may still land in the destination: never hand it on then."""
        if transfer.handle is None:
            return True
        try:
            self._agent.release_xfer_handle(transfer.handle)
        except Exception as exc:  # a transfer still in flight towards a dead holder
            logger.warning("nixl: could not release a transfer from %r: %s",
                           transfer.agent, exc)
            return False
        transfer.handle = None
        return True

    def forget(self, agent: str) -> None:
        """Drop a holder (it restarted or was refused): its memory is never read again."""
        held = self._remotes.pop(agent, None)
        if held is not None:
            try:
                self._agent.remove_remote_agent(held[0])
            except Exception as exc:  # already gone on NIXL's side
                logger.info("nixl: removing agent %r: %s", agent, exc)

    def keep(self, agents: set[str]) -> None:
        """Drop every holder not in ``agents`` (a restarted rank's old agent, a publisher
        gone): remote agents stay bounded by the holders of the current version."""
        for agent in [a for a in self._remotes if a not in agents]:
            self.forget(agent)

    def close(self) -> None:
        for agent in list(self._remotes):
            self.forget(agent)
        for handle in self._local.values():
            self._agent.deregister_memory(handle)
        self._local = {}
        self._kinds = {}
        self._starts = []
        self._landings = []
        self._stuck = []
