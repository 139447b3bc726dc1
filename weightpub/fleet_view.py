"""The fleet as a table for people: one row per subscriber, refreshed in place with ``--watch``.

Every string a peer sent goes through ``printable`` (non-printable characters,
escapes included, become U+FFFD) into a ``rich.text.Text``, never parsed as
markup, so a stranger's report cannot move the cursor or recolour the screen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from weightpub_wire import protocol as wire
from weightpub_wire.collective_layout import GroupStatus
from weightpub_wire.errors import WeightPubTimeout

__all__ = ["fleet_table", "group_line", "peer_cell", "peer_line", "printable",
           "received_cell", "watch_fleet"]

#: the peer figures a row may carry: (``Report`` field, its column of bytes from peers)
_PEER_COLUMNS = (("peer_nixl", "nixl peers"), ("peer_stream", "stream peers"))


def printable(text: str, limit: int = 200, style: str = "") -> Text:
    """Peer text made safe for a terminal, cut to ``limit`` characters."""
    clean = "".join(c if c.isprintable() else "\ufffd" for c in text[:limit])
    return Text(clean + ("…" if len(text) > limit else ""), style=style)


def group_line(group: GroupStatus | None) -> Text | None:
    """The collective path's group: backend, epoch, members (ids are peer text)."""
    if group is None:
        return None
    line = Text(f"collective {printable(group.backend, 16)} {printable(group.state, 16)}, "
                f"epoch {group.epoch}, {len(group.members)} member(s): ")
    line.append_text(printable(", ".join(group.members) or "-", 400))
    if group.waiting:
        line.append("; waiting: ")
        line.append_text(printable(", ".join(group.waiting), 200))
    line.append(f"; {group.rounds} round(s), last version {group.last_version}, "
                f"{group.bytes_sent} bytes")
    if group.fallbacks:  # versions nodes held back for the group but fetched over ZeroMQ
        line.append("; fell back to zmq: ", style="yellow")
        line.append_text(printable(", ".join(f"{member} {cause}={count}" for member, cause, count
                                             in group.fallbacks), 400, style="yellow"))
    if group.last_error:
        line.append("; last error: ")
        line.append_text(printable(group.last_error, 200, style="red"))
    return line


def memory_line(memory: wire.HostMemory | None) -> Text | None:
    """The publisher's host memory against its budget."""
    if memory is None:
        return None
    mib = 1 << 20
    line = Text(f"host memory {memory.held_bytes / mib:.1f} MiB held of a "
                f"{memory.budget_bytes / mib:.1f} MiB budget (keep_versions "
                f"{memory.keep_versions}), {memory.send_queued_bytes / mib:.1f} MiB of reply "
                f"scratch")
    if memory.nixl_registered_bytes:
        line.append(f"; {memory.nixl_registered_bytes / mib:.1f} MiB registered for NIXL")
    if memory.nixl_off_reason:
        line.append("; nixl off: ", style="yellow")
        line.append_text(printable(memory.nixl_off_reason, 200, style="yellow"))
    if memory.withdrawn_version:
        line.append(f"; version {memory.withdrawn_version} withdrawn: ", style="yellow")
        line.append_text(printable(memory.withdrawn_reason, 300, style="yellow"))
    return line


def stream_line(stream: wire.StreamPort | None) -> Text | None:
    """The publisher's plain-TCP stream port (``stream=True``): connections, tokens, bytes."""
    if stream is None:
        return None
    line = Text(f"stream port {stream.port}: {stream.connections} open, {stream.accepted} "
                f"accepted, {stream.refused} refused, {stream.turned_away} turned away, "
                f"{stream.cut} cut; {stream.bytes_sent / (1 << 20):.1f} MiB in "
                f"{stream.chunks_sent} chunks sent; tokens {stream.tokens_issued} issued, "
                f"{stream.tokens_denied} denied")
    if stream.slice_bytes_sent:
        line.append(f"; slices {stream.slice_bytes_sent / (1 << 20):.1f} MiB "
                    f"({stream.slice_bytes_gathered / (1 << 20):.1f} gathered)")
    if stream.refused or stream.cut or stream.tokens_denied:
        line.stylize("yellow")
    return line


def nixl_line(nixl: wire.NixlHolding | None) -> Text | None:
    """The NIXL offers of a publisher or relay (``nixl=True``): buffers registered, offers,
    versions announced without one by cause (why it is off: the host memory line)."""
    if nixl is None:
        return None
    line = Text(f"nixl {'on' if nixl.on else 'off'}: {nixl.registrations} buffer(s) "
                f"registered ({nixl.registered_bytes / (1 << 20):.1f} MiB), {nixl.offers} "
                "offer(s)")
    _append_counts(line, "unoffered", nixl.unoffered, 200)
    _append_counts(line, "words refused", nixl.words_refused, 200)
    if not nixl.on:
        line.stylize("yellow")
    return line


def shard_line(group: wire.ShardGroup | None) -> Text | None:
    """A shard coordinator: its ranks, the versions still collecting and what was dropped."""
    if group is None:
        return None
    line = Text(f"sharded over {group.world_size} trainer ranks")
    for pending in group.pending:
        missing = sorted(set(range(group.world_size)) - set(pending.ranks_in))
        shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
        line.append(f"; version {pending.version} waits {pending.waiting_seconds:.1f}s for "
                    f"ranks {shown}", style="yellow")
    line.append(f"; {group.dropped_versions} version(s) dropped, {group.refused_submits} "
                "submit(s) refused")
    if group.last_error:
        line.append("; last error: ")
        line.append_text(printable(group.last_error, 200, style="red"))
    return line


def received_cell(fraction: float | None) -> str:
    """What a subscriber pulled of its applied version: "0.52x" (a rank's slices), "-"
    when it did not say (an older subscriber, nothing applied yet)."""
    return "-" if fraction is None else f"{fraction:.2f}x"


def peer_cell(figures: wire.PeerFigures | None) -> str:
    """What a member took from peers (READ over NIXL, or received on their stream
    ports): "12.0M"; "-" when it did not say (not that path, an older subscriber). The
    rest of its figures: ``--json``."""
    return "-" if figures is None else f"{_mib(figures.bytes_from_peers)}M"


def peer_line(figures: wire.PeerFigures | None) -> Text | None:
    """The fleet's peers over NIXL (issue 31) or over the stream (``docs/peer-stream.md``),
    summed over the rows seen recently, and their causes."""
    if figures is None:
        return None
    taken = f"{_mib(figures.bytes_from_peers)} MiB in {figures.chunks_from_peers} chunk(s)"
    if isinstance(figures, wire.PeerStreamFigures):
        text = (f"peers over the stream: {taken} from peers, {_mib(figures.bytes_served)} "
                f"MiB in {figures.chunks_served} chunk(s) served")
    elif isinstance(figures, wire.PeerNixlFigures):
        text = f"peers over nixl: {taken} READ from peers, {figures.offers} offer(s) made"
    else:  # a kind this tool does not know yet
        text = f"peers: {taken} from peers"
    line = Text(text)
    _append_counts(line, figures.CAUSES, figures.causes(), 400)
    return line


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.1f}"


def _append_counts(line: Text, label: str, counts: Iterable[tuple[str, int]],
                   width: int) -> None:
    """``; label: a=1, b=2`` in yellow (a peer's words, cut to ``width``), if any."""
    shown = ", ".join(f"{key}={count}" for key, count in counts)
    if shown:
        line.append(f"; {label}: ", style="yellow")
        line.append_text(printable(shown, width, style="yellow"))


def fleet_table(reply: wire.StatusReply) -> Group:
    """A header line, the collective group (if any) and a table of the subscribers."""
    header = Text(f"publisher {printable(reply.publisher_id, 12)}  "
                  f"latest version {reply.latest_version}"
                  f"  holding {list(reply.versions)}  sent {reply.bytes_sent_full} bytes in full,"
                  f" {reply.bytes_sent_delta} as deltas"
                  + (f", {reply.bytes_sent_slices} as slices of {reply.slice_plans} plans"
                     if reply.slice_plans or reply.bytes_sent_slices else ""))
    table = Table(expand=False)
    # bytes taken from peers over NIXL / the stream: a column only where some member
    # reports them
    peers = [(field, column) for field, column in _PEER_COLUMNS
             if any(getattr(report, field) is not None for report in reply.subscribers)]
    for column, justify in (("subscriber", "left"), ("ranks", "left"), ("staged", "right"),
                            ("applied", "right"), ("lag", "right"), ("path", "left"),
                            ("received", "right"), *[(column, "right") for _, column in peers],
                            ("last error", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for report in sorted(reply.subscribers, key=lambda r: r.subscriber_id):
        lag = max(0, reply.latest_version - report.applied_version)
        table.add_row(
            printable(report.subscriber_id),
            ",".join(map(str, report.ranks)),  # a replica's ranks on that node (ours: ints)
            str(report.staged_version),
            str(report.applied_version),
            Text(str(lag), style="yellow" if lag else "green"),
            printable(report.data_path or "-", 16),  # how the applied version came
            received_cell(report.received_fraction),
            *[peer_cell(getattr(report, field)) for field, _ in peers],
            printable(report.last_error or "", style="red"),
        )
    lines = [line for line in (memory_line(reply.memory), shard_line(reply.shard_group),
                               group_line(reply.collective), stream_line(reply.stream),
                               nixl_line(reply.nixl), peer_line(reply.peer_nixl),
                               peer_line(reply.peer_stream))
             if line is not None]
    return Group(header, *lines, table)


def watch_fleet(fetch: Callable[[], wire.StatusReply], *, interval: float = 1.0,
                count: int | None = None, console: Console | None = None) -> None:
    """Redraw the table every ``interval`` s (``count`` times, or until Ctrl-C).

    A publisher that stops answering shows as a line in the table's place; the
    watch goes on and recovers when it answers again.
    """
    console = console or Console()
    done = 0
    with Live(console=console, auto_refresh=False) as live:
        while count is None or done < count:
            try:
                view: Group | Text = fleet_table(fetch())
            except WeightPubTimeout as exc:
                view = Text(f"no answer: {exc}", style="red")
            live.update(view, refresh=True)
            done += 1
            if count is None or done < count:
                time.sleep(interval)
