"""The NIXL offers of a publisher and of a relay, seen from outside (issue 31): ``weightpub
status`` (a status reply's ``nixl``, the "nixl" line) and the publisher's Prometheus
endpoint (``weightpub_publisher_nixl_*``), real NIXL agents (UCX confined to loopback).

What must hold: buffers registered, offers made and versions announced without an offer
(by cause: ``off``, ``unregistered``, ``copy``) are the numbers ``nixl_status()`` holds,
and they move as versions go out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from publisher import WeightPublisher
from tests.transport.procs import det_weights, wait_until
from tests.transport.test_metrics import scrape
from weightpub.cli import main as cli_main
from weightpub.deployment_config import RelayConfig
from weightpub.relay import Relay
from weightpub.status import fetch_status

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("nixl_loopback")]

SEED = 5
SPEC = [("w", "float32", [256, 1024]), ("b", "int32", [10_000])]
CHUNK = 256 << 10


def _nixl_samples(url: str) -> dict[str, float]:
    """The ``weightpub_publisher_nixl_*`` samples, unoffered ones as ``unoffered:<cause>``."""
    out: dict[str, float] = {}
    for (name, labels), value in scrape(url).items():
        if name.startswith("weightpub_publisher_nixl_"):
            short = name.removeprefix("weightpub_publisher_nixl_").removesuffix("_total")
            out[short + "".join(f":{v}" for _, v in labels)] = value
    return out


def _relay(pub: WeightPublisher, closing: Callable[[Any], Any]) -> Relay:
    return closing(Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": pub.endpoint}, "cut_through": True,
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "heartbeat_interval": 0.2,
                       "nixl": True, "metrics_port": 0}})))


def test_status_and_metrics_show_the_offers_of_a_publisher_and_a_relay(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    pub = make_pub(chunk_size=CHUNK, nixl=True, metrics_port=0)
    relay = _relay(pub, closing)
    assert pub.metrics is not None and relay.publisher.metrics is not None
    urls = {"publisher": pub.metrics.url, "relay": relay.publisher.metrics.url}
    for url in urls.values():  # nothing registered or offered before the first version
        assert _nixl_samples(url) == {"on": 1, "registrations": 0, "registered_bytes": 0,
                                      "offers": 0, "unoffered:off": 0,
                                      "unoffered:unregistered": 0, "unoffered:copy": 0,
                                      "words_refused:claims": 0, "words_refused:ready": 0}
    for version in (1, 2):
        pub.publish(det_weights(SEED, version, SPEC), version=version)
        pub.wait_announced(version)
        wait_until(lambda v=version: _offered(relay, v), 60, f"the relay's offer of v{version}")
    total = pub.manifest(2).total_bytes
    for name, endpoint in (("publisher", pub.endpoint), ("relay", relay.endpoint)):
        nixl = fetch_status(endpoint).nixl
        assert nixl is not None and nixl.on and nixl.unoffered == (), (name, nixl)
        # keep_versions 1: one buffer registered, reused for both versions, each offered
        assert (nixl.registrations, nixl.offers) == (1, 2), (name, nixl)
        assert total <= nixl.registered_bytes < 2 * total, (name, nixl)
        samples = _nixl_samples(urls[name])
        assert samples["registrations"] == 1 and samples["offers"] == 2, (name, samples)
        assert samples["registered_bytes"] == nixl.registered_bytes
        assert cli_main(["status", endpoint]) == 0
        out = capsys.readouterr().out
        assert "nixl on: 1 buffer(s) registered" in out and "2 offer(s)" in out, out
        assert "unoffered" not in out
        assert cli_main(["status", endpoint, "--json"]) == 0
        assert '"registrations": 1' in capsys.readouterr().out


def test_a_version_announced_without_an_offer_is_shown_by_cause(
        make_pub: Callable[..., WeightPublisher], capsys: pytest.CaptureFixture[str]) -> None:
    """A relayed version that fails before its copy is complete (``copy``)."""
    upstream = make_pub(chunk_size=CHUNK)
    upstream.wait_announced(upstream.publish(det_weights(SEED, 1, SPEC), version=1))
    relay = make_pub(nixl=True, metrics_port=0)  # a relay's publisher, written in by hand
    assert relay.metrics is not None
    relayed = relay.relay_version(upstream.manifest(1))
    held = upstream._store.get(1)
    assert held is not None
    relayed.write_chunk(0, held.chunk_view(0))
    relayed.fail()
    wait_until(lambda: (relay.nixl_status() or {}).get("unoffered") == {"copy": 1}, 30,
               "the failed version counted")
    nixl = fetch_status(relay.endpoint).nixl
    assert nixl is not None and nixl.unoffered == (("copy", 1),) and nixl.offers == 0
    assert _nixl_samples(relay.metrics.url)["unoffered:copy"] == 1
    assert cli_main(["status", relay.endpoint]) == 0
    assert "unoffered: copy=1" in capsys.readouterr().out


def test_a_relay_where_nixl_cannot_run_shows_it_off_with_its_versions_unoffered(
        monkeypatch: pytest.MonkeyPatch, make_pub: Callable[..., WeightPublisher],
        closing: Callable[[Any], Any], capsys: pytest.CaptureFixture[str]) -> None:
    from publisher.store import nixl_export

    pub = make_pub(chunk_size=CHUNK)
    monkeypatch.setattr(nixl_export, "nixl_error", lambda: "NIXL is not available (test)")
    relay = _relay(pub, closing)
    monkeypatch.undo()
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    assert relay.publisher.metrics is not None
    for version in (1, 2):
        pub.publish(det_weights(SEED, version, SPEC), version=version)
        wait_until(lambda v=version: _unoffered(relay).get("off", 0) >= v, 60,
                   f"the relay's copy of v{version} (counted when complete)")
    nixl = fetch_status(relay.endpoint).nixl
    assert nixl is not None and not nixl.on and nixl.registrations == 0
    unoffered = dict(nixl.unoffered)
    assert set(unoffered) == {"off"} and unoffered["off"] >= 2, nixl
    samples = _nixl_samples(relay.publisher.metrics.url)
    assert samples["on"] == 0 and samples["unoffered:off"] == unoffered["off"]
    assert samples["offers"] == 0 and samples["unoffered:copy"] == 0
    assert cli_main(["status", relay.endpoint]) == 0
    out = capsys.readouterr().out
    assert "nixl off: 0 buffer(s) registered" in out and "unoffered: off=" in out, out


def _offered(relay: Relay, version: int) -> bool:
    try:
        return relay.publisher.manifest(version).nixl is not None
    except Exception:  # not announced yet
        return False


def _unoffered(relay: Relay) -> dict[str, int]:
    status = relay.publisher.nixl_status()
    assert status is not None
    unoffered = status["unoffered"]
    assert isinstance(unoffered, dict)
    return unoffered


def test_a_dropped_buffer_takes_its_claims_and_readiness_words_out_of_nixl() -> None:
    """``NixlExport.freed``: the buffer, its claims words and its readiness map are all
    deregistered (none left registered over memory that is about to go)."""
    import torch

    from publisher.store.buffer_claims import BufferClaims
    from publisher.store.nixl_export import NixlExport
    export = NixlExport("weightpub-test-freed")
    try:
        assert export.on, export.off_reason
        exporter = export._exporter
        assert exporter is not None
        buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        export.registered(buffer)
        offer = export.offer(buffer, buffer.numel(), claims=BufferClaims(buffer.numel()),
                             version=3, ready=export.ready_words(buffer), chunk_size=1 << 18)
        assert offer is not None and offer.claims is not None and offer.ready is not None
        assert exporter.registered_bytes > buffer.numel()  # the buffer and both maps
        export.freed(buffer.data_ptr())
        assert exporter.registered_bytes == 0 and export.registered_bytes == 0
    finally:
        export.close()


def test_refused_claims_and_readiness_words_are_tried_once_per_buffer(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """UCX refusing a buffer's claims words (or its readiness map) is remembered for that
    buffer: its later offers go without them (still offered), counted once in
    ``words_refused`` and logged once, and nothing is registered again until the buffer
    (so its words) changes."""
    import logging

    import msgspec
    import torch

    from publisher.publisher_metrics import _nixl_families
    from publisher.store.buffer_claims import BufferClaims
    from publisher.store.nixl_export import NixlExport
    from weightpub.fleet_view import nixl_line
    from weightpub_wire import protocol as wire
    from weightpub_wire.nixl_link import NixlExporter

    tries: list[int] = []
    register = NixlExporter.register

    def refuse_words(self: NixlExporter, address: int, length: int, **kw: Any) -> Any:
        if length < 64 << 10:  # words (the buffers here are 1 MiB)
            tries.append(length)
            raise RuntimeError("NIXL_ERR_BACKEND (test: UCX refused the words)")
        return register(self, address, length, **kw)

    monkeypatch.setattr(NixlExporter, "register", refuse_words)
    caplog.set_level(logging.WARNING, logger="weightpub.publisher")
    export = NixlExport("weightpub-test-refused")
    try:
        assert export.on, export.off_reason
        first, second = (torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(2))
        claims = {id(first): BufferClaims(1 << 20), id(second): BufferClaims(1 << 20)}
        for buffer in (first, second):
            export.registered(buffer)
        for version, buffer in enumerate((first, first, second, first, second), start=1):
            offer = export.offer(buffer, buffer.numel(), claims=claims[id(buffer)],
                                 version=version)
            assert offer is not None and offer.claims is None  # offered, without the words
        assert len(tries) == 2, tries  # once per buffer, not once per offer
        for _ in range(3):
            assert export.ready_words(first) is None
        assert len(tries) == 3, tries
        status = export.status()
        assert status["offers"] == 5 and status["unoffered"] == {}, status
        assert status["words_refused"] == {"claims": 2, "ready": 1}, status
        refusals = [r for r in caplog.records if "not tried again" in r.getMessage()]
        assert len(refusals) == 3, [r.getMessage() for r in refusals]
        # the pool made a new buffer (new claims) there: tried again, and taken this time
        monkeypatch.setattr(NixlExporter, "register", register)
        offer = export.offer(first, first.numel(), claims=BufferClaims(1 << 20), version=6)
        assert offer is not None and offer.claims is not None and offer.claims.version == 6
        assert export.status()["words_refused"] == {"claims": 2, "ready": 1}
        # and seen from outside: the status reply, its "nixl" line, the metrics
        holding = export.wire_status()
        assert holding.words_refused == (("claims", 2), ("ready", 1)), holding
        line = nixl_line(msgspec.msgpack.decode(msgspec.msgpack.encode(holding),
                                                type=wire.NixlHolding))
        assert line is not None and "words refused: claims=2, ready=1" in line.plain, line
        samples = {(family.name, sample.labels.get("kind")): sample.value
                   for family in _nixl_families(export.status()) for sample in family.samples
                   if "words_refused" in family.name}
        assert samples == {("weightpub_publisher_nixl_words_refused", "claims"): 2,
                           ("weightpub_publisher_nixl_words_refused", "ready"): 1}, samples
    finally:
        export.close()
