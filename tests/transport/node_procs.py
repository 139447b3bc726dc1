"""Child side of the node-staging tests: one "local rank" that joins its node's staging.

Run through ``tests.transport.procs`` (role ``node_rank``). It reports every
version it is offered (digests per tensor), marks it applied, and releases it at
once, or only on a ``release`` command when started with ``hold``.
"""

from __future__ import annotations

import os
import queue
from typing import Any

from tests.transport.procs import _commands, _emit, digests


def run_node_rank(args: dict[str, Any]) -> None:
    from subscriber_ext import SyncOptions, WeightSubscriber
    from subscriber_ext.transport.node.node_join import NodeStagingOwner, join_node_staging

    offered: queue.Queue[Any] = queue.Queue()
    options = SyncOptions(**args.get("options", {}))
    endpoint = args["endpoint"]
    told: dict[int, set[str]] = {}  # attempt -> tensors already reported ready

    def on_progress(partial: Any) -> None:  # runs on a transport thread: emit and return
        new = [n for n in partial.ready() if n not in told.setdefault(partial.attempt, set())]
        told[partial.attempt].update(new)
        _emit(event="partial", version=partial.version, attempt=partial.attempt,
              ready=len(told[partial.attempt]), cancelled=partial.cancelled,
              digests=digests((n, partial.tensors[n]) for n in new))

    source = join_node_staging(
        args["key"], rank=args["rank"], on_version=offered.put,
        on_progress=on_progress if args.get("progress") else None,
        subscribe=lambda on_version, allocator, **more: WeightSubscriber(
            endpoint, on_version=on_version, allocator=allocator, options=options,
            subscriber_id=f"node-{os.getpid()}", **more, **args.get("subscriber", {})))
    role = "owner" if isinstance(source, NodeStagingOwner) else "follower"
    _emit(event="ready", role=role, pid=os.getpid(), rank=args["rank"])
    held: list[Any] = []
    commands = _commands()
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            command = None
        if command is not None:
            cmd = command.get("cmd")
            if cmd == "exit":
                break
            if cmd == "status":
                _emit(event="status", id=command.get("id"), status=source.status())
            elif cmd == "release":
                for view in held:
                    view.release()
                _emit(event="released", id=command.get("id"), versions=[v.version for v in held])
                held.clear()
        try:
            view = offered.get(timeout=0.05)
        except queue.Empty:
            continue
        _emit(event="staged", version=view.version, publisher_id=view.publisher_id,
              digests=digests(view.items()), attempt=view.attempt)
        source.mark_applied(view.version)
        if args.get("hold"):
            held.append(view)
        else:
            view.release()
    for view in held:
        view.release()
    source.close()
    _emit(event="closed")
