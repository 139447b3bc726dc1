"""What a ``SyncClient`` asks of its chunk sources next, and when it gives up.

Split from ``sync_client.py``: the credit (chunks in flight per serving source,
bounded by ``window_bytes`` and ``MAX_CHUNKS_IN_FLIGHT``), the one top-up loop
over the sources ``source_choice.py`` picked for the target (first sources, the
peers, take their share of each serving source's next chunks; the serving source
gets the rest under its credit), re-asking what timed out, and the tries per
chunk after which the version is given up. The table itself is
``request_table.py``; the sources are ``staging/chunk_source.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from subscriber_ext.transport.client.source_choice import SourceChoice
from subscriber_ext.transport.staging.assembly import Assembly
from subscriber_ext.transport.staging.request_table import RequestTable
from weightpub_wire import protocol as wire
from weightpub_wire.errors import WeightPubError, WeightPubTimeout

__all__ = ["FetchCredit", "IdleWatch"]


@dataclass
class IdleWatch:
    """The backstop (issue 28.1): a target with chunks missing and nothing asked of any
    source for ``limit`` seconds cannot complete; ``check`` then names what is missing."""

    since: tuple[tuple[int, int], float] | None = None  # (fetch, base) idle from then

    def check(self, target: Assembly, requests: RequestTable, now: float,
              limit: float) -> WeightPubError | None:
        key = (target.fetch_version, target.fetch_base)
        if requests.requests or not target.missing:
            self.since = None
            return None
        if self.since is None or self.since[0] != key:
            self.since = (key, now)
            return None
        if now - self.since[1] < limit:
            return None
        self.since = None
        manifest = target.manifest
        missing = list(target.missing)[:4096]
        whose = "" if manifest.shards is None else \
            f" of ranks {sorted({manifest.shard_of(chunk).rank for chunk in missing})}"
        return WeightPubTimeout(
            f"version {manifest.version}: {len(target.missing)} chunks{whose} missing and "
            f"none asked of any source for {limit}s; given up")


class FetchCredit:
    """Fills the window of chunks in flight for the target; counts each chunk's tries."""

    def __init__(self, requests: RequestTable, choice: SourceChoice, *,
                 target: Callable[[], Assembly | None],
                 give_up: Callable[[WeightPubError], None], window_bytes: int,
                 max_chunk_retries: int) -> None:
        """``choice``: the sources (``source_choice.py``); ``target()``: the version being
        fetched; ``give_up(why)``: abandon the target (a chunk failed too often)."""
        self.requests = requests
        self.choice = choice
        self._target = target
        self._give_up = give_up
        self.window_bytes = window_bytes
        self.max_chunk_retries = max_chunk_retries
        self.idle = IdleWatch()

    def credit(self) -> int:
        """Chunks the client may have in flight to each serving source for its target."""
        target = self._target()
        if target is None:
            return 0
        chunks = self.window_bytes // target.manifest.chunk_size
        return max(1, min(chunks, wire.MAX_CHUNKS_IN_FLIGHT))

    def top_up(self, now: float) -> None:
        """Ask for more chunks of the target while there is credit (first sources first)."""
        target = self._target()
        if target is None:
            return
        firsts, serving = self.choice.sources(target.manifest)
        window = self.credit()
        # enough to fill each serving source's credit and every first source's window, not
        # the whole version: this runs after every chunk (4,096 chunks: 16 M checks each)
        ahead = sum(first.ahead() for first in firsts)
        asked = self.requests.asked()
        for source in serving:
            room = source.room(window)
            if room <= 0 and not firsts:
                continue
            todo = source.candidates(target, asked, max(room, 0) + ahead)
            for first in firsts:
                if not todo:
                    break
                todo = first.ask(target, todo, now)
            if room > 0 and todo:
                source.ask(target, todo[:room], now)

    def expire(self, now: float) -> None:
        """Re-ask (or, after too many tries, abandon) what a source did not answer in time."""
        target = self._target()

        def retry(chunk: int, why: str, error: type[WeightPubError]) -> bool:
            return self.count_retry(chunk, why, error) or self._target() is not target

        for source in self.choice.live():
            if source.expire(now, retry):
                return
        if target is None or self._target() is not target:
            return
        limits = [limit for source in self.choice.live()
                  if (limit := source.idle_limit()) is not None]
        if limits:
            stalled = self.idle.check(target, self.requests, now, min(limits))
            if stalled is not None:
                self._give_up(stalled)

    def count_retry(self, chunk: int, why: str, error: type[WeightPubError]) -> bool:
        """Count one more try of a chunk; abandon the version when it has failed too often."""
        tries = self.requests.count_try(chunk)
        target = self._target()
        if tries <= self.max_chunk_retries or target is None:
            return False
        self._give_up(error(f"chunk {chunk} of version {target.manifest.version} "
                            f"{why} {tries} times"))
        return True
