"""NIXL from relays (issue 31): a relay offers its copy of each version over NIXL to the
subscribers behind it, real NIXL agents on every side (UCX confined to loopback).

What must hold: a downstream subscriber READs bit-exact versions from the relay's own
agent (``data_path`` "nixl", the relay sends no chunk frame); the relay registers each
pool buffer once, whatever the versions do, and deregisters on close; a cut-through
relay offers a version only once its copy is complete (downstream gets frames before
that); a relay where NIXL cannot run serves frames with the cause counted
(``nixl_status()["unoffered"]``); a relay killed -9 mid-read stages nothing downstream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from publisher import WeightPublisher
from subscriber_ext import WeightSubscriber
from tests.transport.procs import Child, det_weights, digests, pace_replies, wait_until
from weightpub.deployment_config import RelayConfig
from weightpub.relay import Relay

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("nixl_loopback")]

SEED = 11
SPEC = [("w", "float32", [512, 1024]), ("b", "int32", [70_000]), ("e", "uint8", [4_321])]
CHUNK = 256 << 10


def _relay(pub: WeightPublisher, closing: Callable[[Any], Any], *, cut_through: bool,
           **downstream: Any) -> Relay:
    return closing(Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": pub.endpoint}, "cut_through": cut_through,
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "heartbeat_interval": 0.2,
                       "nixl": True, **downstream}})))


def _exact(staged: Any, version: int) -> bool:
    return digests(staged.items()) == digests(det_weights(SEED, version, SPEC).items())


def _complete(relay: Relay, version: int) -> None:
    """Wait until the relay holds ``version`` whole (and, with NIXL on, offers it)."""
    def offered() -> bool:
        try:
            return relay.publisher.manifest(version).nixl is not None
        except Exception:  # not announced yet
            return False

    wait_until(offered, 60, f"version {version} offered by the relay")


def _agent(relay: Relay) -> str:
    exporter = relay.publisher._nixl._exporter  # type: ignore[union-attr]
    assert exporter is not None
    return str(exporter.name)


@pytest.mark.parametrize("cut_through", [False, True])
def test_subscribers_behind_a_relay_read_its_copy_over_nixl(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        cut_through: bool) -> None:
    pub = make_pub(chunk_size=CHUNK)  # the trainer offers no NIXL: only the relay does
    relay = _relay(pub, closing, cut_through=cut_through)
    # store-and-forward announces a whole version: one subscriber READs them all; behind
    # a cut-through relay a subscriber joins once the copy is complete (before, frames)
    steady = None if cut_through else closing(WeightSubscriber(relay.endpoint,
                                                                request_timeout=10.0))
    for version in (1, 2, 3):
        pub.publish(det_weights(SEED, version, SPEC), version=version)
        _complete(relay, version)
        assert relay.publisher.manifest(version).nixl.agent == _agent(relay)  # type: ignore
        sub = steady or closing(WeightSubscriber(relay.endpoint, request_timeout=10.0))
        staged = sub.wait_for_version(version, timeout=60)
        assert staged.publisher_id == relay.publisher.publisher_id and _exact(staged, version)
        assert staged.data_path == "nixl", sub.status()["nixl"]
        staged.release()
        assert sub.status()["nixl"]["fallbacks"] == 0
        if sub is not steady:
            sub.close()  # else it would take the next version as announced: frames
    assert relay.publisher.data_stats()["bytes_sent_full"] == 0  # every byte one-sided
    nixl = relay.publisher.nixl_status()
    assert nixl is not None and nixl["on"] is True and nixl["unoffered"] == {}
    # keep_versions 1: one pool buffer, registered once and reused for the three versions
    assert nixl["registrations"] == 1, nixl
    assert 0 < int(nixl["registered_bytes"]) < 2 * relay.publisher.manifest().total_bytes


def test_a_relay_registers_each_pool_buffer_once_across_versions(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any]) -> None:
    """Two versions kept: the relay's pool makes a second buffer (registered then) and
    reuses both for later versions without registering anything again."""
    pub = make_pub(chunk_size=CHUNK)
    relay = _relay(pub, closing, cut_through=True, keep_versions=2)
    seen = []
    for version in range(1, 6):
        pub.publish(det_weights(SEED, version, SPEC), version=version)
        _complete(relay, version)
        status = relay.publisher.nixl_status()
        assert status is not None
        seen.append((status["registrations"], status["registered_bytes"]))
    assert seen[1] == seen[-1], seen  # nothing registered after the second buffer was made
    assert seen[-1][0] == 2, seen
    late = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0))
    staged = late.wait_for_version(5, timeout=60)
    assert _exact(staged, 5) and staged.data_path == "nixl"


def test_a_cut_through_relay_offers_a_version_only_when_its_copy_is_complete(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any]) -> None:
    pub = make_pub(chunk_size=CHUNK)
    relay = _relay(pub, closing, cut_through=True)
    pace_replies(relay.subscriber._client, 0.05)  # the relay's own copy takes ~1.5 s
    early = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0))
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    seen = []  # (offered, complete): the offer read first, so an offer implies complete

    def watch() -> bool:
        try:
            offered = relay.publisher.manifest(1).nixl is not None
        except Exception:
            return False  # not announced downstream yet
        relayed = relay._open  # set a moment after the version is in the store
        if relayed is None:
            return False
        seen.append((offered, relayed.complete))
        return relay.subscriber.status()["staged_version"] == 1

    wait_until(watch, 60, "the relay's copy of version 1", interval=0.01)
    assert (False, False) in seen, seen  # announced while its copy was incomplete
    assert all(complete for offered, complete in seen if offered), seen
    _complete(relay, 1)
    staged = early.wait_for_version(1, timeout=60)  # took the version before the offer
    assert _exact(staged, 1) and staged.data_path == "zmq"
    late = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0))
    staged = late.wait_for_version(1, timeout=60)
    assert _exact(staged, 1) and staged.data_path == "nixl"
    assert relay.publisher.nixl_status()["unoffered"] == {}  # type: ignore[index]


def test_a_relayed_version_that_fails_before_its_copy_is_complete_is_never_offered(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any]) -> None:
    upstream = make_pub(chunk_size=CHUNK, keep_versions=2)
    for version in (1, 2):
        upstream.publish(det_weights(SEED, version, SPEC), version=version)
    upstream.wait_announced(2)
    relay = make_pub(nixl=True)  # a relay's publisher: relayed versions written in by hand
    first = relay.relay_version(upstream.manifest(1))
    held = upstream._store.get(1)
    assert held is not None
    for chunk in range(upstream.manifest(1).num_chunks // 2):
        first.write_chunk(chunk, held.chunk_view(chunk))
    assert relay.manifest(1).nixl is None
    first.fail()  # superseded upstream
    second = relay.relay_version(upstream.manifest(2))
    held = upstream._store.get(2)
    assert held is not None
    for chunk in range(upstream.manifest(2).num_chunks):
        assert relay.manifest(2).nixl is None  # not before the last chunk
        second.write_chunk(chunk, held.chunk_view(chunk))
    assert relay.manifest(2).nixl is not None
    status = relay.nixl_status()
    assert status is not None and status["unoffered"] == {"copy": 1}, status
    assert status["offers"] == 1
    sub = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0))
    staged = sub.wait_for_version(2, timeout=60)
    assert _exact(staged, 2) and staged.data_path == "nixl"


@pytest.mark.parametrize("cut_through", [True, False])
def test_a_relay_without_nixl_serves_frames_with_the_cause_counted(
        monkeypatch: pytest.MonkeyPatch, make_pub: Callable[..., WeightPublisher],
        closing: Callable[[Any], Any], cut_through: bool) -> None:
    from publisher.store import nixl_export

    pub = make_pub(chunk_size=CHUNK)
    monkeypatch.setattr(nixl_export, "nixl_error", lambda: "NIXL is not available (test)")
    relay = _relay(pub, closing, cut_through=cut_through)
    monkeypatch.undo()
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    sub = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0))
    for version in (1, 2):
        pub.publish(det_weights(SEED, version, SPEC), version=version)
        staged = sub.wait_for_version(version, timeout=60)
        assert _exact(staged, version) and staged.data_path == "zmq"
        staged.release()
    status = relay.publisher.nixl_status()
    assert status is not None and status["on"] is False and "(test)" in str(
        status["off_reason"])
    # every version the relay announced went out unoffered, cause "off" (the relay may
    # also have copied the upstream's latest when it joined)
    assert status["unoffered"].get("off", 0) >= 2 and set(status["unoffered"]) == {"off"}
    assert status["registered_bytes"] == 0 and status["offers"] == 0
    assert sub.status()["nixl"]["fallbacks"] == 0  # nothing was offered, nothing refused


def test_a_relay_killed_mid_read_never_stages_a_partial_version(
        spawn: Callable[..., Child], make_pub: Callable[..., WeightPublisher],
        closing: Callable[[Any], Any], paced_reads: Callable[[int], list[float]]) -> None:
    chunk = 1 << 20
    pub = make_pub(chunk_size=chunk)
    relay = spawn("relay", upstream=pub.endpoint, cut_through=True,
                  downstream={"nixl": True})
    endpoint = relay.event("ready", timeout=60)["endpoint"]
    pub.publish({"big": det_weights(SEED, 1, [("big", "uint8", [32 * chunk])])["big"]},
                version=1)
    wait_until(lambda: 1 in relay.request("status")["offered"], 60, "the relay's offer")
    paced = paced_reads(chunk)  # one chunk per READ, seen done one per 0.3 s
    sub = closing(WeightSubscriber(endpoint, request_timeout=2.0, max_chunk_retries=1,
                                   window_bytes=2 * chunk))
    wait_until(lambda: len(paced) >= 1, 60, "a first chunk read one-sided from the relay")
    relay.kill9()
    fraction = sub.status()["fetching_fraction"]
    assert fraction is not None and fraction < 1.0  # killed mid-version
    wait_until(lambda: sub.status()["nixl"]["fallbacks"] >= 1
               or sub.status()["fetching_version"] is None, 60,
               "the dead relay noticed (a READ failed, timed out, or the version given up)")
    time.sleep(3)  # any late READ, and the ZeroMQ fallback to a dead relay, play out
    assert sub.latest() is None  # nothing partial was ever staged
    status = sub.status()
    assert status["staged_version"] == 0, status
    assert set(status["nixl"]["fallback_causes"]) <= {"transfer", "unreachable", "timeout"}


def test_closing_a_relay_deregisters_its_buffers(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any]) -> None:
    pub = make_pub(chunk_size=CHUNK)
    relay = _relay(pub, closing, cut_through=True)
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    _complete(relay, 1)
    sub = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0))
    staged = sub.wait_for_version(1, timeout=60)
    assert staged.data_path == "nixl"
    staged.release()
    exporter = relay.publisher._nixl._exporter  # type: ignore[union-attr]
    assert exporter is not None and exporter.registered_bytes > 0
    relay.close()
    assert exporter.registered_bytes == 0  # NIXL's own handles released
    status = relay.publisher.nixl_status()
    assert status is not None and status["registered_bytes"] == 0 and status["on"] is False


def test_a_relay_under_curve_on_both_sides_offers_nixl_only_to_admitted_subscribers(
        tmp_path: Any, closing: Callable[[Any], Any]) -> None:
    """The relay's offer names its registered memory: it rides only on the relay's own
    authenticated PUB/ROUTER, so an admitted subscriber READs bit-exact from the relay's
    agent and one whose key is not admitted gets no manifest, no offer, not a byte. The
    trainer is CURVE too (the relay is a client admitted there) and offers NIXL itself:
    the relay READs its copy one-sided over the authenticated control plane."""
    from weightpub_wire.errors import WeightPubTimeout
    from weightpub_wire.keys import create_key_pair

    up_allowed, down_allowed = tmp_path / "up_allowed", tmp_path / "down_allowed"
    up_allowed.mkdir()
    down_allowed.mkdir()
    up_public, up_secret = create_key_pair(tmp_path, "trainer")
    _, relay_client_secret = create_key_pair(up_allowed, "relay_client")
    relay_public, relay_secret = create_key_pair(tmp_path, "relay")
    _, member_secret = create_key_pair(down_allowed, "member")
    _, stranger_secret = create_key_pair(tmp_path, "stranger")
    pub = closing(WeightPublisher("tcp://127.0.0.1:0", nixl=True, chunk_size=CHUNK,
                                  heartbeat_interval=0.2, curve_secret_key_file=str(up_secret),
                                  curve_allowed_clients_dir=str(up_allowed)))
    relay = closing(Relay(RelayConfig.model_validate({
        "upstream": {"endpoint": pub.endpoint, "curve_server_key_file": str(up_public),
                     "curve_secret_key_file": str(relay_client_secret)},
        "cut_through": False,
        "downstream": {"endpoint": "tcp://127.0.0.1:0", "heartbeat_interval": 0.2,
                       "nixl": True, "curve_secret_key_file": str(relay_secret),
                       "curve_allowed_clients_dir": str(down_allowed)}})))
    member = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0,
                                      curve_server_key_file=str(relay_public),
                                      curve_secret_key_file=str(member_secret)))
    stranger = closing(WeightSubscriber(relay.endpoint, request_timeout=3.0,
                                        curve_server_key_file=str(relay_public),
                                        curve_secret_key_file=str(stranger_secret)))
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    _complete(relay, 1)
    assert relay.publisher.manifest(1).nixl.agent == _agent(relay)  # type: ignore[union-attr]
    staged = member.wait_for_version(1, timeout=60)
    assert _exact(staged, 1) and staged.data_path == "nixl", member.status()["nixl"]
    assert relay.subscriber.status()["nixl"]["bytes_read"] > 0  # the relay READ the trainer
    assert pub.data_stats()["bytes_sent_full"] == 0
    assert relay.publisher.data_stats()["bytes_sent_full"] == 0  # every byte one-sided
    with pytest.raises(WeightPubTimeout):
        stranger.wait_for_version(1, timeout=3)
    status = stranger.status()
    assert status["publisher_latest_version"] in (0, None), status  # no manifest came
    assert status["nixl"]["available"] is None and status["nixl"]["bytes_read"] == 0
    assert status["handshake_failures"] >= 1, status  # refused by the relay's CURVE


def test_a_cut_through_relay_with_a_readiness_map_is_read_while_it_copies(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``nixl_cut_through``: the relay offers a version with its first announcement and a
    per-chunk readiness map; downstream READs each chunk once the map says it is final,
    so READs overlap the relay's upstream copy, and no chunk is READ before its bytes
    are in (no checksum failure, no frame)."""
    from weightpub_wire.nixl_link import NixlReader, NixlTransfer

    pub = make_pub(chunk_size=CHUNK)
    relay = _relay(pub, closing, cut_through=True, nixl_cut_through=True)
    pace_replies(relay.subscriber._client, 0.05)  # the relay's own copy takes ~1 s
    seen: list[bool] = []  # per data READ seen done downstream: the relay's copy complete?
    poll = NixlReader.poll

    def watched(self: NixlReader, transfer: NixlTransfer) -> bool:
        done = poll(self, transfer)
        opened = relay._open
        if done and transfer.nbytes > 4096 and opened is not None:  # not a map's READ
            seen.append(opened.complete)
        return done

    monkeypatch.setattr(NixlReader, "poll", watched)
    sub = closing(WeightSubscriber(relay.endpoint, request_timeout=10.0, window_bytes=CHUNK))
    pub.publish(det_weights(SEED, 1, SPEC), version=1)
    staged = sub.wait_for_version(1, timeout=60)
    nixl = sub.status()["nixl"]
    assert _exact(staged, 1) and staged.data_path == "nixl", nixl
    assert nixl["fallbacks"] == 0 and sub.status()["checksum_failures"] == 0, nixl
    assert False in seen and seen[-1] is True, seen  # READs done while the copy went on
    assert relay.publisher.data_stats()["bytes_sent_full"] == 0  # not one chunk frame
    status = relay.publisher.nixl_status()
    assert status is not None and status["offers"] == 1 and status["unoffered"] == {}


def test_a_relayed_version_that_never_completes_falls_back_as_unready(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any]) -> None:
    """Offered at once with a readiness map, then its copy stalls half way: downstream
    READs the final half, waits for the rest up to ``request_timeout`` (cause
    ``unready``), and stages nothing of it; the next version is READ whole."""
    upstream = make_pub(chunk_size=CHUNK, keep_versions=2)
    for version in (1, 2):
        upstream.publish(det_weights(SEED, version, SPEC), version=version)
    upstream.wait_announced(2)
    relay = make_pub(nixl=True, nixl_cut_through=True)  # a relay's publisher, by hand
    first = relay.relay_version(upstream.manifest(1))
    assert relay.manifest(1).nixl is not None and relay.manifest(1).nixl.ready is not None
    held = upstream._store.get(1)
    assert held is not None
    half = upstream.manifest(1).num_chunks // 2
    for chunk in range(half):
        first.write_chunk(chunk, held.chunk_view(chunk))
    staged_versions: list[int] = []
    sub = closing(WeightSubscriber(relay.endpoint, request_timeout=2.0, window_bytes=CHUNK,
                                   on_version=lambda s: staged_versions.append(s.version)))
    wait_until(lambda: sub.status()["nixl"]["fallback_causes"].get("unready"), 60,
               "the rest of version 1 given up as unready")
    assert sub.status()["nixl"]["bytes_read"] >= half * CHUNK  # the final half was READ
    first.fail()  # superseded upstream
    second = relay.relay_version(upstream.manifest(2))
    held = upstream._store.get(2)
    assert held is not None
    for chunk in range(upstream.manifest(2).num_chunks):
        second.write_chunk(chunk, held.chunk_view(chunk))
    staged = sub.wait_for_version(2, timeout=60)
    assert _exact(staged, 2) and staged.data_path == "nixl" and staged_versions == [2]
    nixl = sub.status()["nixl"]
    assert nixl["fallback_causes"] == {"unready": 1}, nixl
    assert sub.status()["checksum_failures"] == 0


def _relay_whole(relay: WeightPublisher, upstream: WeightPublisher, version: int) -> None:
    """A relay's publisher (by hand) takes ``version`` of ``upstream`` and copies it whole."""
    relayed = relay.relay_version(upstream.manifest(version))
    held = upstream._store.get(version)
    assert held is not None
    for chunk in range(upstream.manifest(version).num_chunks):
        relayed.write_chunk(chunk, held.chunk_view(chunk))


def test_a_readiness_map_that_does_not_answer_holds_nothing_else(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch, stalled_words: Callable[[], list[Any]]) -> None:
    """The READ of version 1's readiness map is never answered. The subscriber's loop does
    not wait for it: version 2, announced meanwhile, is READ and staged while that READ
    is still in flight, well inside its bound (``CLAIMS_TIMEOUT_S``, 60 s here: the wait
    in place it replaced held the loop that long). Past the bound (1 s for version 3) the
    holder is given up as ``unanswered`` and frames serve the version."""
    from subscriber_ext.transport.client import nixl_source

    upstream = make_pub(chunk_size=CHUNK, keep_versions=3)
    for version in (1, 2, 3):
        upstream.publish(det_weights(SEED, version, SPEC), version=version)
    upstream.wait_announced(3)
    relay = make_pub(nixl=True, nixl_cut_through=True, keep_versions=2)  # by hand
    monkeypatch.setattr(nixl_source, "CLAIMS_TIMEOUT_S", 60.0)
    stalled = stalled_words()
    _relay_whole(relay, upstream, 1)
    sub = closing(WeightSubscriber(relay.endpoint, request_timeout=60.0, window_bytes=CHUNK))
    wait_until(lambda: stalled, 60, "version 1's readiness map READ posted")
    _relay_whole(relay, upstream, 2)
    staged = sub.wait_for_version(2, timeout=30)
    nixl = sub.status()["nixl"]
    assert len(stalled) == 1 and _exact(staged, 2) and staged.data_path == "nixl", nixl
    assert nixl["fallbacks"] == 0, nixl  # version 1 was superseded, not given up
    staged.release()
    monkeypatch.setattr(nixl_source, "CLAIMS_TIMEOUT_S", 1.0)
    stalled_words()
    _relay_whole(relay, upstream, 3)
    staged = sub.wait_for_version(3, timeout=30)
    nixl = sub.status()["nixl"]
    assert len(stalled) == 2 and _exact(staged, 3) and staged.data_path == "zmq", nixl
    assert nixl["fallback_causes"] == {"unanswered": 1}, nixl
    assert "readiness map was not done after 1.0 s" in nixl["last_error"], nixl


def test_an_offer_whose_words_do_not_fit_is_refused_naming_the_field(
        make_pub: Callable[..., WeightPublisher], closing: Callable[[Any], Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader READs a readiness map (and claims words) by the numbers the offer gives,
    so they are checked against the offer first (``offer_misfit``): one word per chunk,
    covering the version, outside the offered bytes, for the manifest's version. A bad
    one is refused as ``bad_offer`` naming the field, and frames serve the version."""
    import msgspec

    from weightpub_wire.nixl_link import NixlClaims, NixlExporter, NixlRegion

    def bad_ready(data: NixlRegion, claims: NixlClaims) -> dict[int, NixlClaims]:
        return {1: NixlClaims(claims.address, claims.length, 4096, 1),  # not per chunk
                2: NixlClaims(data.address, 4096, CHUNK, 2),  # over the data bytes
                3: NixlClaims(claims.address, 8, CHUNK, 3),  # one word, not one per chunk
                4: NixlClaims(claims.address, claims.length, CHUNK, 99)}  # another version

    offer = NixlExporter.offer

    def misfit(self: NixlExporter, regions: Any, mem_type: str = "DRAM",
               claims: NixlClaims | None = None, ready: NixlClaims | None = None) -> Any:
        made = offer(self, regions, mem_type, claims, ready)
        assert claims is not None
        return msgspec.structs.replace(made, ready=bad_ready(regions[0], claims)[claims.version])

    monkeypatch.setattr(NixlExporter, "offer", misfit)
    pub = make_pub(nixl=True, chunk_size=CHUNK)
    sub = closing(WeightSubscriber(pub.endpoint, request_timeout=10.0))
    for version, field in ((1, "ready.region"), (2, "ready.address"), (3, "ready.length"),
                           (4, "ready.version")):
        pub.publish(det_weights(SEED, version, SPEC), version=version)
        staged = sub.wait_for_version(version, timeout=60)
        nixl = sub.status()["nixl"]
        assert _exact(staged, version) and staged.data_path == "zmq", nixl
        assert f"the offer's {field} " in nixl["last_error"], nixl
        staged.release()
    assert sub.status()["nixl"]["fallback_causes"] == {"bad_offer": 4}
    assert sub.status()["nixl"]["bytes_read"] == 0
    # claims words are held to the offer the same way
    from subscriber_ext.transport.client.nixl_source import offer_misfit

    good = pub.manifest(4).nixl
    assert good is not None and good.claims is not None
    data, claims = good.regions[0], good.claims
    fit = msgspec.structs.replace(good, ready=None)
    assert offer_misfit(fit, data.length, CHUNK, 4) is None
    for bad, field in ((msgspec.structs.replace(claims, length=8), "claims.length"),
                       (msgspec.structs.replace(claims, version=3), "claims.version"),
                       (msgspec.structs.replace(claims, address=data.address + 64),
                        "claims.address")):
        assert offer_misfit(msgspec.structs.replace(fit, claims=bad), data.length, CHUNK,
                            4).startswith(field)  # type: ignore[union-attr]
