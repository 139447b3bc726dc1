"""A member's peers-over-NIXL counters as its report carries them
(``client_report.peer_nixl_figures``): within the wire's bounds whatever its status
holds, so a report is never refused for them."""

from __future__ import annotations

from subscriber_ext.transport.client.client_report import ClientReport, peer_nixl_figures
from weightpub_wire import protocol as wire


def test_none_without_peers_over_nixl_and_bounded_with_them() -> None:
    assert peer_nixl_figures(None) is None
    assert peer_nixl_figures({"bytes_from_peers": 5, "nixl_offers": 0,
                              "nixl_unoffered": {}}) is None  # nixl off: nothing counted
    causes = {f"c{i}": 1 for i in range(20)} | {"Odd Cause!": 2, "x" * 40: 3}
    figures = peer_nixl_figures({"nixl_bytes_from_peers": 1 << 70, "nixl_chunks_from_peers": 3,
                                 "nixl_offers": 1, "nixl_unoffered": causes})
    assert figures is not None
    assert figures.bytes_from_peers == (1 << 63) - 1 and figures.offers == 1
    assert len(figures.unoffered) == 16
    report = ClientReport("m", 1.0).message(1, "pub", figures)
    assert wire.decode(wire.encode(report)) == report  # within every bound on the wire
    odd = peer_nixl_figures({"nixl_offers": 0, "nixl_unoffered": {"Odd Cause!": 2,
                                                                   "frames": 1}})
    assert odd is not None and odd.unoffered == (("frames", 1), ("other", 2))
