"""A subscriber's side of the collective path: ask to join, hold back fetches, take results.

Runs on the subscriber thread (``SyncClient`` calls ``announce``, ``defer``,
``tick``, ``on_reply``, ``follow``); the blocking work (rendezvous, broadcasts,
CUDA IPC copies) runs on its ``CollectiveReceiver`` thread, which calls back into
the subscriber thread to get a staging buffer (``begin``) and to hand the result
over (``finish`` / ``failed``). One staging and one commit path: a version that
arrives by broadcast is verified against the manifest's chunk checksums and
delivered exactly like a fetched one (``SyncClient.deliver``).

The rules that keep it from ever costing a version:

* while this node is a member of the publisher's group, **or has asked to join
  it** (the path is announced and usable, the publisher has not refused it), a new
  manifest is not fetched over ZeroMQ (``defer``) for up to the announced timeout
  (plus ``JOIN_GRACE_S`` while the epoch forms): the publisher starts every epoch
  with a round of its newest version, so a version announced while this node's
  epoch was forming, or while a re-form closed its old epoch, still comes by the
  group;
* the moment a named failure happens (``FALLBACK_CAUSES``: the round fails here,
  the group is lost, the join fails or does not happen in time, the publisher
  refuses the node, no staging memory ...), the version is fetched over ZeroMQ
  frames; each such fallback is counted by cause (``status()``, the polls, so
  ``weightpub status``, and the replica's metric) and logged at WARNING
  (rate-limited per cause);
* a partial broadcast is never staged: the buffer is abandoned unless every chunk
  matched its checksum.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

import torch

from subscriber_ext.transport.collective.collective_receiver import (
    LATER,
    CollectiveReceiver,
    GroupJob,
    IpcJob,
)
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.budget_gate import BudgetGate
from subscriber_ext.transport.staging.chunk_listener import ChunkListener
from subscriber_ext.transport.staging.progress import ProgressFeed
from weightpub_wire import protocol as wire
from weightpub_wire.bounded_counts import count_bounded
from weightpub_wire.buffers import BufferPool
from weightpub_wire.collective_backends import collective_backend
from weightpub_wire.collective_layout import MAX_FALLBACK_CAUSES, CollectiveAnnounce
from weightpub_wire.cuda_ipc import device_uuid
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["LATER", "CollectiveMember"]

log = logging.getLogger("weightpub.collective")
POLL_S = 0.25
REFUSED_POLL_S = 2.0
#: a node that asked to join waits this much beyond the timeout for its epoch: the
#: publisher's join delay (0.3 s), its wait for old members after a teardown (1.5 s), polls
JOIN_GRACE_S = 3.0
_KEEP_VERSIONS = 16



class SyncClient(Protocol):
    """What the collective path needs of the sync client: its public face only."""

    @property
    def current_version(self) -> int: ...
    @property
    def gate(self) -> BudgetGate: ...
    @property
    def pool(self) -> BufferPool: ...
    @property
    def listeners(self) -> list[ChunkListener]: ...

    def send(self, message: wire.Message) -> bool: ...
    def yield_target(self, version: int) -> bool: ...
    def consider(self, manifest: wire.Manifest) -> None: ...
    def deliver(self, assembly: Assembly) -> None: ...


RunOnClient = Callable[[Callable[[SyncClient], None]], None]


class CollectiveMember:
    """One subscriber's membership in its publisher's collective path."""

    def __init__(self, subscriber_id: str, *, endpoint: str, device: str | None,
                 run_on_client: RunOnClient, limits: wire.Limits) -> None:
        self.subscriber_id = subscriber_id
        dialled = parse_endpoint(endpoint)
        self.host = dialled.host if dialled.scheme == "tcp" else "127.0.0.1"
        if device is not None:
            self.device = torch.device(device)
        elif torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.limits = limits
        self.announced: CollectiveAnnounce | None = None
        self.instance: str | None = None
        self.state = ""  # the publisher's last answer ("" before the first)
        self.reason = ""
        self.rounds = 0
        self.fallback_causes: dict[str, int] = {}  # versions fetched over zmq instead, by cause
        self.bytes_received = 0
        self.last_error: str | None = None
        self.ipc_done = 0
        self.closed = False
        self._run_on_client = run_on_client
        self._claims: dict[int, float] = {}  # version -> when to give up waiting for it
        self._manifests: OrderedDict[int, wire.Manifest] = OrderedDict()
        self._given_up: OrderedDict[int, None] = OrderedDict()  # versions fetched over zmq
        # progress feeds of the assemblies rounds are filling (held: an id is never reused)
        self._feeds: dict[Assembly, ProgressFeed] = {}
        self._ids = itertools.count(1)
        self._next_poll = 0.0
        self._ended_epoch = 0  # the newest epoch the publisher says is over
        self._ended_at = 0.0  # when it said so while the receiver was still in it
        self._warn = RateLimitedLog(log)
        self.receiver = CollectiveReceiver(self)
        self.receiver.start()

    @property
    def fallbacks(self) -> int:
        """Versions held back for the group but fetched over ZeroMQ frames (every cause)."""
        return sum(self.fallback_causes.values())

    # -- what the publisher offers ---------------------------------------------------------
    def announce(self, info: CollectiveAnnounce | None) -> None:
        if info != self.announced:
            self.announced = info
            self._next_poll = 0.0
            if info is not None and not self.usable():
                self.reason = self._unusable_reason()
                self._warn.warning("unusable", f"collective path {info.backend} announced but "
                                               f"not usable here: {self.reason}")

    def follow(self, publisher_id: str) -> None:
        """The subscriber follows another publisher instance: its old group means nothing."""
        self.instance = publisher_id
        self.announced = None
        self._claims.clear()
        self._manifests.clear()
        self._given_up.clear()
        self._ended_epoch = 0
        self._ended_at = 0.0
        self.state, self.reason = "", ""
        self.ipc_done = 0

    def in_group(self) -> bool:
        """Whether the publisher will broadcast new versions to this node."""
        if not self.receiver.ready_for_rounds():
            return False
        info = self.announced
        return info is not None and (not collective_backend(info.backend).has_group or (
            self.receiver.publisher_id == self.instance
            and self.receiver.epoch > self._ended_epoch))

    def usable(self) -> bool:
        return self.announced is not None and not self._unusable_reason()

    def _unusable_reason(self) -> str:
        info = self.announced
        if info is None:
            return "not announced"
        backend = collective_backend(info.backend)  # known: the announce was checked
        if backend.needs_cuda and self.device.type != "cuda":
            return f"{info.backend} needs a CUDA device; this subscriber runs on the CPU"
        if backend.same_gpu and device_uuid(self.device) != info.device_uuid:
            return f"{info.backend} needs the publisher's GPU (a different one here)"
        return ""

    # -- the subscriber thread -------------------------------------------------------------
    def defer(self, client: SyncClient, manifest: wire.Manifest) -> bool:
        """Whether to leave ``manifest`` to the broadcast instead of fetching it now."""
        self.announce(manifest.collective)
        self._manifests[manifest.version] = manifest
        while len(self._manifests) > 8:
            self._manifests.popitem(last=False)
        if manifest.collective is None or manifest.version in self._given_up:
            return False  # no path offered, or given up already (counted then)
        if manifest.version in self._claims:
            return True
        blocked = self._blocked()
        if blocked is not None:  # the path cannot bring it: counted, fetched by the caller
            self._give_up(client, manifest.version, *blocked, fetch=False)
            return False
        assert self.announced is not None
        wait = self.announced.timeout
        if not collective_backend(self.announced.backend).has_group:  # the handle comes by poll
            wait = min(wait, 10.0)
        elif not self.in_group():  # asked to join: the next epoch's first round brings it
            wait += JOIN_GRACE_S
        self._claims[manifest.version] = time.monotonic() + wait
        return True

    def _blocked(self) -> tuple[str, str] | None:
        """(cause, why) when versions cannot wait for the collective path here."""
        if self.closed or self.receiver.poll_state(self.instance)[0] == "leaving":
            return "closing", "this subscriber is closing"
        if self.announced is None:
            return "unusable", "the publisher no longer announces a collective path"
        if not self.usable():
            return "unusable", self._unusable_reason()
        if self.state == "refused":
            return "refused", f"the publisher refused this node: {self.reason or 'no reason'}"
        return None

    def tick(self, client: SyncClient, now: float) -> None:
        if self.usable() and now >= self._next_poll:
            state, epoch = self.receiver.poll_state(self.instance)
            assert self.announced is not None
            poll = wire.CollectivePoll(req=next(self._ids), subscriber_id=self.subscriber_id,
                                       state=state, epoch=epoch, backend=self.announced.backend,
                                       device_uuid=device_uuid(self.device)
                                       if self.device.type == "cuda" else "",
                                       ipc_done=self.ipc_done,
                                       fallbacks=tuple(sorted(self.fallback_causes.items())))
            if client.send(poll):
                self._next_poll = now + (REFUSED_POLL_S if self.state == "refused" else POLL_S)
        if not self._claims:
            return
        receiving = self.receiver.receiving
        keepalive = self.announced.keepalive if self.announced is not None else 1.0
        for version, deadline in sorted(self._claims.items(), reverse=True):  # newest first:
            if version not in self._claims:  # an older one gives way when a newer is given up
                continue
            if version <= client.current_version:
                del self._claims[version]
                continue
            blocked = self._blocked()
            in_group = self.in_group()
            if blocked is not None:
                self._give_up(client, version, *blocked)
            elif in_group and version <= self.receiver.passed and receiving != version:
                self._give_up(client, version, "round_passed", "its round went by without "
                                                               "this node")
            elif not in_group and self._ended_at and self.receiver.state == "member" and \
                    now - self._ended_at > 2 * keepalive + 1.0:  # no CLOSE came: it failed
                self._give_up(client, version, "epoch_ended", "the publisher ended epoch "
                                                              f"{self.receiver.epoch}")
            elif receiving:
                self._claims[version] = max(deadline, now + 1.0)  # a round is under way
            elif now > deadline:
                if in_group:
                    self._give_up(client, version, "round_timeout", "no broadcast round came "
                                                                    "in time")
                else:
                    self._give_up(client, version, "join_timeout",
                                  f"asked to join, but no epoch took this node in time "
                                  f"(the publisher says {self.state or 'nothing'})")

    def on_reply(self, client: SyncClient, reply: wire.CollectiveReply) -> None:
        if reply.publisher_id != self.instance or self.announced is None:
            return
        self.state, self.reason = reply.state, reply.reason
        if reply.state == "off":
            self.announce(None)
            return
        info = self.announced
        if not collective_backend(info.backend).has_group:  # no rounds: an IPC handle
            handle = reply.ipc
            if handle is not None and handle.version > max(client.current_version,
                                                           self.ipc_done) \
                    and handle.version not in self._given_up:
                self.receiver.submit(IpcJob(handle, info, self.device))
            return
        mine = self.receiver.epoch if self.receiver.publisher_id == self.instance else 0
        if reply.epoch > mine or (reply.epoch == mine and reply.state not in ("forming",
                                                                              "active")):
            if mine > self._ended_epoch and self.receiver.state == "member":
                self._ended_at = time.monotonic()  # its CLOSE, or its failure, is on the way
            self._ended_epoch = max(self._ended_epoch, mine)  # its rounds will not come
        if reply.state in ("forming", "active") and reply.rank > 0 and self.instance:
            self._ended_at = 0.0
            self.receiver.submit(GroupJob(
                epoch=reply.epoch, rank=reply.rank, world_size=reply.world_size,
                announce=info, host=self.host, publisher_id=self.instance,
                device=self.device))

    def status(self) -> dict[str, Any]:
        info = self.announced
        state, epoch = self.receiver.poll_state(self.instance)
        return {
            "backend": None if info is None else info.backend,
            "usable": self.usable(),
            "receiver": state,
            "epoch": epoch,
            "publisher_says": self.state or None,
            "reason": self.reason or None,
            "rounds": self.rounds,
            "bytes_received": self.bytes_received,
            "held_back": sorted(self._claims),  # versions waiting for a round
            "fallbacks": self.fallbacks,
            "fallback_causes": dict(self.fallback_causes),
            "last_error": self.last_error,
        }

    def close(self) -> None:
        """Say so to the publisher (it re-forms its group at once), then stop receiving."""
        if self.usable() and self.instance is not None:
            self.call(self._leave, timeout=1.0)
        self.closed = True
        self.receiver.stop()

    def _leave(self, client: SyncClient) -> None:
        assert self.announced is not None
        client.send(wire.CollectivePoll(req=next(self._ids), subscriber_id=self.subscriber_id,
                                        state="leaving", backend=self.announced.backend))

    # -- the receiver thread's calls, run on the subscriber thread -------------------------
    def call(self, function: Callable[[SyncClient], Any], timeout: float = 5.0) -> Any:
        """Run ``function(client)`` on the subscriber thread; its result (None on timeout)."""
        if self.closed:
            return None
        future: Future[Any] = Future()

        def run(client: SyncClient) -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(client))
                except BaseException as exc:
                    future.set_exception(exc)

        self._run_on_client(run)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            return None

    def begin(self, client: SyncClient, version: int, total_bytes: int | None,
              backend: str) -> Assembly | str | None:
        """A staging buffer for ``version`` (None: not wanted here; ``LATER``: no manifest yet)."""
        manifest = self._manifests.get(version)
        if manifest is None or manifest.publisher_id != self.instance:
            return LATER if version > client.current_version else None
        if total_bytes is not None and manifest.total_bytes != total_bytes:
            return None
        if version <= client.current_version or version in self._given_up:
            return None
        if not client.yield_target(version):
            return None  # already fetching it (or newer) over zmq
        if client.gate.is_refused(manifest) or not client.gate.admit(manifest):
            client.gate.take_waiting()  # the zmq path waits for memory, or reports
            self._give_up(client, version, "staging_budget", "no staging memory for it now")
            return None
        assembly = Assembly(manifest, client.pool)
        assembly.data_path = backend
        feed = next((f for f in client.listeners if isinstance(f, ProgressFeed)), None)
        if feed is not None:  # prepare layers while the buckets arrive, as for frames
            follower = feed.follow(assembly)
            follower.target_started(manifest)  # sets assembly.attempt for the commit side
            self._feeds[assembly] = follower
            while len(self._feeds) > 4:  # bounded: a round hands its assembly back
                self._feeds.pop(next(iter(self._feeds)))
        return assembly

    def verified(self, client: SyncClient, assembly: Assembly, chunks: range) -> None:
        """A bucket's chunks matched the manifest: their tensors may be final."""
        follower = self._feeds.get(assembly)
        if follower is not None:
            for chunk in chunks:
                follower.chunk_verified(assembly.manifest, chunk, memoryview(b""))

    def finish(self, client: SyncClient, assembly: Assembly, nbytes: int) -> None:
        follower = self._feeds.pop(assembly, None)
        if follower is not None:
            follower.target_completed(assembly.manifest)
        self.rounds += 1
        self.bytes_received += nbytes
        assembly.count_received("collective", nbytes)
        version = assembly.manifest.version
        for claimed in [v for v in self._claims if v <= version]:
            del self._claims[claimed]
        client.deliver(assembly)

    def failed(self, client: SyncClient, version: int, assembly: Assembly | None,
               why: str, cause: str = "round_failed") -> None:
        if assembly is not None:
            follower = self._feeds.pop(assembly, None)
            if follower is not None:
                follower.target_dropped(assembly.manifest)  # drop what was prepared from it
            assembly.abandon()
        self._give_up(client, version, cause, why)

    def left(self, client: SyncClient, why: str, cause: str = "") -> None:
        """The receiver left its group. ``cause`` "": the publisher closed the epoch to
        re-form it, and the next epoch's first round brings what is held back; otherwise
        every version held back is fetched now."""
        self._ended_at = 0.0
        if not cause:
            deadline = time.monotonic() + JOIN_GRACE_S + (
                self.announced.timeout if self.announced is not None else 0.0)
            for version in self._claims:
                self._claims[version] = max(self._claims[version], deadline)
            return
        if why:
            self.last_error = why[:1024]
        for version in sorted(self._claims, reverse=True):
            if version in self._claims:
                self._give_up(client, version, cause, f"left the group ({why})")

    def _give_up(self, client: SyncClient, version: int, cause: str, why: str, *,
                 fetch: bool = True) -> None:
        """Fetch ``version`` over ZeroMQ frames (``fetch`` False: the caller does), counted
        under ``cause``; older versions held back give way to it without a count."""
        claimed = self._claims.pop(version, None) is not None
        if version in self._given_up and not claimed:
            return  # already fetched over zmq (the group was given up before its round)
        for older in [v for v in self._claims if v < version]:
            del self._claims[older]
            self._given_up[older] = None
        self._given_up[version] = None
        while len(self._given_up) > _KEEP_VERSIONS:
            self._given_up.popitem(last=False)
        if version <= client.current_version:
            return
        count_bounded(self.fallback_causes, cause, MAX_FALLBACK_CAUSES)
        self.last_error = f"version {version}: {why} ({cause})"[:1024]
        self._warn.warning(f"fallback:{cause}", f"collective path: {self.last_error}; fetching "
                                                "it over ZeroMQ frames")
        manifest = self._manifests.get(version)
        if fetch and manifest is not None:
            client.consider(manifest)
