"""``weightpub status`` prints what strangers reported without letting it act on the terminal."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
import zmq

from publisher import WeightPublisher
from tests.transport.faults.tools import RawPeer
from weightpub.cli import main as cli_main
from weightpub.fleet_view import printable
from weightpub_wire import protocol as wire

pytestmark = pytest.mark.timeout(60)

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\x9b1m\r\x08\u202egnp.exe\u2066"


def test_printable_replaces_every_control_and_format_character() -> None:
    out = printable(ESCAPES, limit=1000).plain
    assert out.isprintable()
    for char in ("\x1b", "\x07", "\x9b", "\r", "\x08", "\u202e", "\u2066"):
        assert char not in out
    assert "pwned" in out and "\ufffd" in out
    assert printable("plain text, ünïcode ok").plain == "plain text, ünïcode ok"


def test_status_command_sanitizes_peer_text(
    make_pub: Callable[..., WeightPublisher], capsys: pytest.CaptureFixture[str],
) -> None:
    pub = make_pub()
    pub.wait_announced(pub.publish({"w": torch.arange(3)}), timeout=20)
    ctx = zmq.Context()
    peer = RawPeer(ctx, pub.endpoint)
    try:
        # names are refused on the wire if they hold C0/C1 controls; format characters pass
        peer.send(wire.Report(subscriber_id="evil\u202eexe.txt", staged_version=1,
                              applied_version=1, last_error=ESCAPES))
        peer.call(wire.StatusRequest(req=1))
    finally:
        peer.close()
        ctx.destroy(linger=0)
    assert cli_main(["status", pub.endpoint]) == 0
    out = capsys.readouterr().out
    assert "evil" in out and "\ufffd" in out
    assert not any(c in out for c in ("\x1b", "\x07", "\x9b", "\r", "\x08", "\u202e", "\u2066"))
    assert cli_main(["status", pub.endpoint, "--json"]) == 0
    raw = capsys.readouterr().out
    assert raw.isascii()  # every control and format character escaped
    assert json.loads(raw)["subscribers"][0]["last_error"] == ESCAPES
