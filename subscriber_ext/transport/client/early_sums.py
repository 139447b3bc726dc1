"""Checksums that follow the manifest, subscriber side (``Manifest.sums_follow``, issue 29).

A publisher with ``announce_early`` announces a version before it is hashed; its sums
come over this client's own DEALER to the ROUTER (the CURVE-authenticated channel,
``weightpub_wire.sum_messages``), never over the stream port. ``EarlySums`` keeps one
``chunk_sums`` request out for the target while any sum is unknown (the publisher holds
it until sums past ``have`` are in), hands each reply to ``ChunkReceiver.sums_arrived``
(which judges the chunks that landed before their sum) and asks for the next ones at
once. No reply within ``request_timeout``: asked again; ``max_tries`` times in a row:
the version is given up (nothing staged). An ``error`` reply gives it up too (the
version is gone). A reply that breaks the rules is counted as a bad message and asked
again after the timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from subscriber_ext.transport.staging.assembly import Assembly
from weightpub_wire import protocol as wire
from weightpub_wire.errors import (
    ProtocolError,
    VersionUnavailable,
    WeightPubError,
    WeightPubTimeout,
)
from weightpub_wire.sum_messages import ChunkSums, ChunkSumsReply

__all__ = ["EarlySums"]


class EarlySums:
    """Asks the target's sums while its manifest says they follow (module text); a
    replier of the ``SyncClient`` (``reply_types``, ``owns``, ``on_reply``)."""

    reply_types = (ChunkSumsReply,)

    def __init__(self, send: Callable[[Any], bool], next_id: Callable[[], int], *,
                 target: Callable[[], Assembly | None],
                 arrived: Callable[[Assembly, tuple[int, ...], tuple[int, ...]], None],
                 give_up: Callable[[WeightPubError], None],
                 bad: Callable[[ProtocolError], None],
                 request_timeout: float, max_tries: int) -> None:
        self._send = send
        self._next_id = next_id
        self._target = target
        self._arrived = arrived
        self._give_up = give_up
        self._bad = bad
        self.request_timeout = request_timeout
        self.max_tries = max_tries
        self._req = 0  # the request out (0: none)
        self._for: Assembly | None = None  # the target it was asked for
        self._asked_at = 0.0
        self._tries = 0  # requests in a row without a reply
        self.replies = 0  # sum replies taken (status, tests)
        self.versions = 0  # targets whose sums followed their manifest
        self._counted: Assembly | None = None

    def status(self, held: int) -> dict[str, int]:
        """``held``: the receiver's count of chunks that waited for their sum."""
        return {"versions": self.versions, "replies": self.replies, "held": held}

    def tick(self, now: float) -> None:
        """Ask for the target's next sums when none is asked, or the last timed out."""
        target = self._target()
        if target is None or target.sums_in:
            return
        if self._counted is not target:
            self._counted = target
            self.versions += 1
        if self._req and self._for is target:
            if now - self._asked_at < self.request_timeout:
                return
            if self._tries >= self.max_tries:
                self._req = 0
                self._give_up(WeightPubTimeout(
                    f"version {target.manifest.version}: {self._tries} chunk_sums requests "
                    f"unanswered ({self.request_timeout}s each); "
                    f"{target.early_known} of {target.manifest.num_chunks} sums in"))
                return
        elif self._for is not target:
            self._tries = 0
        req = self._next_id()
        manifest = target.manifest
        if self._send(ChunkSums(req=req, publisher_id=manifest.publisher_id,
                                version=manifest.version, have=target.early_have)):
            self._req, self._for, self._asked_at = req, target, now
            self._tries += 1

    def owns(self, message: Any) -> bool:
        return isinstance(message, (ChunkSumsReply, wire.ErrorReply)) and self._req != 0 \
            and message.req == self._req

    def on_reply(self, message: Any) -> None:
        target, asked = self._target(), self._for
        self._req = 0
        if target is None or target is not asked:
            return  # the target changed meanwhile
        version = target.manifest.version
        if isinstance(message, wire.ErrorReply):
            kind = VersionUnavailable if message.code == "version_unavailable" else ProtocolError
            self._give_up(kind(f"chunk_sums: {message.message}"))
            return
        assert isinstance(message, ChunkSumsReply)
        try:
            if message.version != version:
                raise ProtocolError(f"chunk_sums_rep.version: {message.version}, asked "
                                    f"{version}")
            message.check(target.manifest.num_chunks, target.early_have)
        except ProtocolError as exc:
            self._req, self._asked_at = message.req, time.monotonic()  # asked again later
            self._bad(exc)
            return
        self._tries = 0
        self.replies += 1
        target.early_have = max(target.early_have, message.first + len(message.chunks))
        self._arrived(target, message.chunks, message.sums)
        self.tick(time.monotonic())  # the next ones at once
