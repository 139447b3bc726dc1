"""A member's peer counters as its report carries them (``client_report``'s
``peer_nixl_figures`` / ``peer_stream_figures``): within the wire's bounds whatever its
status holds, so a report is never refused for them; and the publisher's sum of them
(``wire.peer_total``) stays within those bounds too."""

from __future__ import annotations

from subscriber_ext.transport.client.client_report import (
    ClientReport,
    peer_nixl_figures,
    peer_stream_figures,
)
from weightpub_wire import protocol as wire

_MAX = (1 << 63) - 1


def test_none_without_peers_over_nixl_and_bounded_with_them() -> None:
    assert peer_nixl_figures(None) is None
    assert peer_nixl_figures({"bytes_from_peers": 5, "nixl_offers": 0,
                              "nixl_unoffered": {}}) is None  # nixl off: nothing counted
    causes = {f"c{i}": 1 for i in range(20)} | {"Odd Cause!": 2, "x" * 40: 3}
    peers = {"nixl_bytes_from_peers": 1 << 70, "nixl_chunks_from_peers": 3,
             "nixl_offers": 1, "nixl_unoffered": causes}
    figures = peer_nixl_figures(peers)
    assert figures is not None
    assert figures.bytes_from_peers == _MAX and figures.offers == 1
    assert len(figures.unoffered) == 16
    report = ClientReport("m", 1.0).message(1, "pub", peers)
    assert report.peer_nixl == figures and report.peer_stream is None
    assert wire.decode(wire.encode(report)) == report  # within every bound on the wire
    odd = peer_nixl_figures({"nixl_offers": 0, "nixl_unoffered": {"Odd Cause!": 2,
                                                                   "frames": 1}})
    assert odd is not None and odd.unoffered == (("frames", 1), ("other", 2))


def test_none_without_the_peer_stream_and_bounded_with_it() -> None:
    assert peer_stream_figures(None) is None
    # stream off: no asking side, no port
    assert peer_stream_figures({"bytes_from_peers": 5, "stream_served": None}) is None
    served = peer_stream_figures({"stream_served": {"stream_bytes_sent": 7,
                                                    "stream_chunks_sent": 1}})
    assert served == wire.PeerStreamFigures(bytes_served=7, chunks_served=1)
    causes = {f"c{i}": 1 for i in range(20)} | {"Bad Cause": 2}
    peers = {"stream_bytes_from_peers": 1 << 70, "stream_chunks_from_peers": 4,
             "stream_fallback_causes": causes, "stream_served": {"stream_bytes_sent": 9}}
    figures = peer_stream_figures(peers)
    assert figures is not None
    assert (figures.bytes_from_peers, figures.chunks_from_peers, figures.bytes_served,
            figures.chunks_served) == (_MAX, 4, 9, 0)
    assert len(figures.fallbacks) == 16 and ("c0", 1) in figures.fallbacks
    report = ClientReport("m", 1.0).message(1, "pub", peers)
    assert report.peer_stream == figures and report.peer_nixl is None
    assert wire.decode(wire.encode(report)) == report


def test_the_fleet_sum_stays_within_the_bounds() -> None:
    """Two members at the bound sum to the bound, not past it (a status reply past it
    would be refused by every ``weightpub status``); causes: the first 16 met."""
    big = wire.PeerStreamFigures(bytes_from_peers=_MAX, chunks_served=2,
                                 fallbacks=tuple((f"a{i}", 1) for i in range(10)))
    other = wire.PeerStreamFigures(bytes_served=3, chunks_served=1,
                                   fallbacks=(("a0", 4), *((f"b{i}", 1) for i in range(10))))
    total = wire.peer_total([big, None, other])
    assert total is not None and wire.peer_total([None]) is None
    assert (total.bytes_from_peers, total.bytes_served, total.chunks_served) == (_MAX, 3, 3)
    assert dict(total.fallbacks)["a0"] == 5 and len(total.fallbacks) == 16
    assert set(dict(total.fallbacks)) == {f"a{i}" for i in range(10)} | \
        {f"b{i}" for i in range(6)}
    reply = wire.StatusReply(req=1, publisher_id="p", started_at=1.0, latest_version=1,
                             versions=(1,), subscribers=(), peer_stream=total)
    assert wire.decode(wire.encode(reply)) == reply
