"""Child side of the relay tests: one relay (``weightpub.relay.Relay``) in its own process.

Run through ``tests.transport.procs`` (role ``relay``) so a test can kill -9 it while a
downstream subscriber READs its copy over NIXL (``test_nixl_relay.py``). Args:
``upstream`` (endpoint), ``cut_through`` and ``downstream`` (publisher options). It
answers ``status`` with the relay publisher's NIXL status and the versions it holds,
each with whether its manifest carries a NIXL offer.
"""

from __future__ import annotations

import os
import queue
from typing import Any

from tests.transport.procs import _commands, _emit


def run_relay(args: dict[str, Any]) -> None:
    from weightpub.deployment_config import RelayConfig
    from weightpub.relay import Relay

    relay = Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": args["upstream"]},
        "cut_through": bool(args.get("cut_through", True)),
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "heartbeat_interval": 0.2,
                       **args.get("downstream", {})}}))
    _emit(event="ready", endpoint=relay.endpoint, pid=os.getpid())
    commands = _commands()
    while True:
        try:
            command = commands.get(timeout=600)
        except queue.Empty:
            break
        cmd = command.get("cmd")
        if cmd == "exit":
            break
        if cmd == "status":
            publisher = relay.publisher
            store = publisher._store
            held = store.versions()
            offered = [v for v in held if (version := store.get(v)) is not None
                       and version.manifest.nixl is not None]
            _emit(event="status", id=command.get("id"), nixl=publisher.nixl_status(),
                  versions=list(held), offered=offered,
                  bytes_sent_full=publisher.data_stats()["bytes_sent_full"])
    relay.close()
    _emit(event="closed")
