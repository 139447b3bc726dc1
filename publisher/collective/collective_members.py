"""Who is in the collective group: the subscribers that asked, and the plan of each epoch.

A plain, thread-safe class (no torch, no sockets): the serving thread feeds it
polls (``CollectivePoll``) and answers with what it says (``CollectiveReply``); the
collective thread asks it when to re-form the group and with whom.

Rules:

* a subscriber is **eligible** for the next epoch when its last poll is recent
  (``member_ttl``), says ``free`` (its receiver is idle) and arrived after the
  last failure or teardown (so a replica that died mid-broadcast, which never
  polls again, is not waited for), and it is not serving a penalty (it missed a
  rendezvous it was planned into, while others made it);
* the group is **re-formed** (a new epoch) when a member stops polling, reports
  that it left this epoch, or a newcomer has been eligible for ``join_delay``
  (joiners arriving together are taken in one re-form); after a teardown the next
  epoch waits up to ``regroup`` seconds for the previous members to report back
  free, so one re-form takes everyone who is still alive;
* rows are bounded per client (CURVE key or address) and in total; a refused
  poll gets ``state="refused"`` with the reason;
* each poll carries the node's fallback counts by cause (versions it held back
  for the group but fetched over ZeroMQ frames); ``status`` shows them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from weightpub_wire import protocol as wire
from weightpub_wire.collective_backends import collective_backend
from weightpub_wire.collective_layout import MAX_FALLBACK_CAUSES, MAX_MEMBERS, GroupStatus

__all__ = ["MemberLimits", "MemberTable", "Plan"]


@dataclass(frozen=True, slots=True)
class MemberLimits:
    member_ttl: float = 3.0  # a member silent this long is dropped from the next epoch
    join_delay: float = 0.3  # a newcomer waits this long, so simultaneous joiners form once
    regroup: float = 1.5  # after a teardown, wait this long at most for the old members
    max_members: int = MAX_MEMBERS
    max_rows_per_client: int = 16
    max_penalty: float = 60.0


@dataclass(slots=True)
class _Row:
    subscriber_id: str
    client: str
    state: str
    epoch: int
    device_uuid: str
    last_poll: float
    free_since: float  # when it last started polling "free" (inf while not free)
    ipc_done: int = 0
    strikes: int = 0
    penalty_until: float = 0.0
    fallbacks: tuple[tuple[str, int], ...] = ()


@dataclass(slots=True)
class Plan:
    """One epoch: its members in rank order (rank = index + 1; the publisher is rank 0)."""

    epoch: int
    members: tuple[tuple[str, str], ...]
    active: bool = False
    ranks: dict[tuple[str, str], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ranks = {key: index + 1 for index, key in enumerate(self.members)}


class MemberTable:
    """Polls in, replies out; re-form decisions for the collective thread."""

    def __init__(self, backend: str, limits: MemberLimits, *, device_uuid: str = "") -> None:
        self.backend = backend
        self.spec = collective_backend(backend)
        self.limits = limits
        self.device_uuid = device_uuid
        self._rows: dict[tuple[str, str], _Row] = {}
        self._lock = threading.Lock()
        self.plan: Plan | None = None
        self._previous: tuple[tuple[str, str], ...] = ()  # the last plan's members
        self._epoch = 0
        self._since = 0.0  # the last failure or teardown: only polls after it count as free
        self.newest_ipc: wire.IpcHandle | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    # -- the serving thread ----------------------------------------------------------------
    def poll(self, client: str, poll: wire.CollectivePoll, now: float, *, publisher_id: str,
             started_at: float) -> wire.CollectiveReply:
        def reply(state: str, **fields: object) -> wire.CollectiveReply:
            return wire.CollectiveReply(req=poll.req, publisher_id=publisher_id,
                                        started_at=started_at, state=state, **fields)  # type: ignore[arg-type]

        if poll.backend != self.backend:
            return reply("refused", reason=f"this publisher serves {self.backend}, not "
                                           f"{poll.backend}")
        if self.spec.same_gpu and poll.device_uuid != self.device_uuid:
            return reply("refused", reason=f"{self.backend} needs the publisher's GPU "
                                           f"({self.device_uuid or 'none'}); this subscriber "
                                           f"runs on {poll.device_uuid or 'no GPU'}")
        key = (client, poll.subscriber_id)
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                refused = self._room_locked(client, now)
                if refused:
                    return reply("refused", reason=refused)
                row = self._rows[key] = _Row(poll.subscriber_id, client, poll.state, poll.epoch,
                                             poll.device_uuid, now, float("inf"))
            if poll.state == "free" and row.free_since == float("inf"):
                row.free_since = now
            elif poll.state != "free":
                row.free_since = float("inf")
            row.state, row.epoch, row.last_poll = poll.state, poll.epoch, now
            row.ipc_done = max(row.ipc_done, poll.ipc_done)
            row.fallbacks = poll.fallbacks
            if poll.state == "leaving":
                del self._rows[key]
                return reply("idle")
            if not self.spec.has_group:  # no epochs: the newest IPC handle, to every member
                return reply("active", ipc=self.newest_ipc)
            plan = self.plan
            if plan is None or key not in plan.ranks:
                state = "refused" if row.penalty_until > now else "waiting"
                reason = "missed a rendezvous; excluded for a while" if state == "refused" \
                    else ""
                return reply(state, epoch=self._epoch, reason=reason)
            return reply("active" if plan.active else "forming", epoch=plan.epoch,
                         rank=plan.ranks[key], world_size=len(plan.members) + 1)

    def _room_locked(self, client: str, now: float) -> str | None:
        self._expire_locked(now)
        if sum(1 for r in self._rows.values() if r.client == client) >= \
                self.limits.max_rows_per_client:
            return f"client has {self.limits.max_rows_per_client} subscribers polling already"
        if len(self._rows) >= self.limits.max_members:
            return f"{self.limits.max_members} subscribers in the collective path already"
        return None

    def _expire_locked(self, now: float) -> None:
        stale = now - 10 * self.limits.member_ttl
        for key in [k for k, r in self._rows.items() if r.last_poll < stale]:
            del self._rows[key]

    # -- the collective thread -------------------------------------------------------------
    def _eligible_locked(self, now: float) -> list[tuple[str, str]]:
        ttl = self.limits.member_ttl
        return sorted(key for key, row in self._rows.items()
                      if now - row.last_poll <= ttl and row.state == "free"
                      and row.last_poll > self._since and row.penalty_until <= now)

    def reform_due(self, now: float) -> bool:
        """Whether the current plan should give way to a new epoch now."""
        with self._lock:
            plan = self.plan
            eligible = self._eligible_locked(now)
            if plan is None:
                if not any(now - self._rows[k].free_since >= self.limits.join_delay
                           for k in eligible):
                    return False
                back = set(eligible)
                alive = [k for k in self._previous if k in self._rows
                         and now - self._rows[k].last_poll <= self.limits.member_ttl
                         and self._rows[k].penalty_until <= now]
                return all(k in back for k in alive) or \
                    now - self._since >= self.limits.regroup
            if not plan.active:
                return False
            for key in plan.members:
                row = self._rows.get(key)
                if row is None or now - row.last_poll > self.limits.member_ttl:
                    return True  # silent: dead or unreachable
                if row.epoch == plan.epoch and row.state == "free":
                    return True  # it left this epoch (its receiver failed)
            return any(k not in plan.ranks
                       and now - self._rows[k].free_since >= self.limits.join_delay
                       for k in eligible)

    def new_plan(self, now: float) -> Plan | None:
        """The next epoch's plan from the eligible subscribers (None: nobody to serve)."""
        with self._lock:
            members = tuple(self._eligible_locked(now))
            self._epoch += 1
            self.plan = Plan(self._epoch, members) if members else None
            return self.plan

    def activate(self) -> None:
        with self._lock:
            if self.plan is not None:
                self.plan.active = True

    def end_plan(self, now: float, *, arrived: list[int] | None = None) -> None:
        """The epoch is over (failed, or torn down for a re-form). ``arrived``: after a failed
        rendezvous, the ranks that made it; the others get a growing penalty."""
        with self._lock:
            plan, self.plan = self.plan, None
            self._since = now
            self._previous = () if plan is None else plan.members
            if plan is None or arrived is None or not arrived:
                return
            for key, rank in plan.ranks.items():
                row = self._rows.get(key)
                if row is None:
                    continue
                if rank in arrived:
                    row.strikes = 0
                else:
                    row.strikes += 1
                    row.penalty_until = now + min(self.limits.max_penalty,
                                                  2.0 ** row.strikes)

    def subscriber_ids(self, keys: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
        return tuple(key[1] for key in keys)

    def ipc_done(self, version: int, now: float) -> bool:
        """No group (cuda_ipc): whether every live member has copied ``version`` (or a
        newer one)."""
        with self._lock:
            live = [r for r in self._rows.values()
                    if now - r.last_poll <= self.limits.member_ttl]
            return all(r.ipc_done >= version for r in live)

    def status(self, now: float, **counters: object) -> GroupStatus:
        with self._lock:
            plan = self.plan
            members = () if plan is None else plan.members
            waiting = tuple(k for k in self._eligible_locked(now)
                            if plan is None or k not in plan.ranks)
            if not self.spec.has_group:  # no group: every live member
                members = tuple(k for k, r in self._rows.items()
                                if now - r.last_poll <= self.limits.member_ttl)
                state = "active" if members else "idle"
            else:
                state = "idle" if plan is None else "active" if plan.active else "forming"
            ttl = self.limits.member_ttl
            fallbacks = tuple((row.subscriber_id, cause, count)
                              for row in self._rows.values() if now - row.last_poll <= ttl
                              for cause, count in row.fallbacks if count)
            return GroupStatus(backend=self.backend, state=state,
                               epoch=plan.epoch if plan is not None else self._epoch,
                               members=tuple(k[1] for k in members)[:MAX_MEMBERS],
                               waiting=tuple(k[1] for k in waiting)[:MAX_MEMBERS],
                               fallbacks=fallbacks[:MAX_MEMBERS * MAX_FALLBACK_CAUSES],
                               **counters)  # type: ignore[arg-type]
