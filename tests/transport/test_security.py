"""Secure by default: refused binds, key hygiene, CURVE refusals named on both sides, revocation."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import zmq.auth

from publisher import ConfigError, WeightPublisher
from subscriber_ext import SubscriberConfig, WeightSubscriber
from tests.transport.procs import wait_until
from weightpub.cli import main as cli_main
from weightpub_wire.keys import create_key_pair

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def keys(tmp_path: Path) -> dict[str, Path]:
    allowed = tmp_path / "allowed"
    server_public, server_secret = create_key_pair(tmp_path, "server")
    client_public, client_secret = create_key_pair(allowed, "client")
    _, stranger_secret = create_key_pair(tmp_path / "strangers", "stranger")
    return {"server_public": server_public, "server_secret": server_secret, "allowed": allowed,
            "client_public": client_public, "client_secret": client_secret,
            "stranger_secret": stranger_secret}


# -- binds ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://[::]:0"])
def test_non_loopback_bind_without_curve_is_refused(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"insecure=True .*insecure: true"):
        WeightPublisher(endpoint)


def test_loopback_and_ipc_stay_easy_and_insecure_is_explicit(tmp_path: Path) -> None:
    for endpoint in ("tcp://127.0.0.1:0", "tcp://localhost:0", f"ipc://{tmp_path}/p"):
        WeightPublisher(endpoint).close()
    WeightPublisher("tcp://0.0.0.0:0", insecure=True).close()
    path = tmp_path / "publisher.yaml"
    path.write_text("publisher:\n  endpoint: tcp://0.0.0.0:0\n")
    with pytest.raises(ConfigError, match="insecure"):
        WeightPublisher.from_config(path)
    path.write_text("publisher:\n  endpoint: tcp://0.0.0.0:0\n  insecure: true\n")
    WeightPublisher.from_config(path).close()


def test_curve_on_a_network_address_needs_no_insecure_flag(keys: dict[str, Path]) -> None:
    WeightPublisher("tcp://0.0.0.0:0", curve_secret_key_file=str(keys["server_secret"])).close()


def test_allow_list_without_secret_key_is_an_error(keys: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="curve_allowed_clients_dir .* needs curve_secret"):
        WeightPublisher("tcp://127.0.0.1:0", curve_allowed_clients_dir=str(keys["allowed"]))


def test_client_key_without_server_key_is_an_error(keys: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="curve_secret_key_file: given without"):
        WeightSubscriber("tcp://127.0.0.1:1", curve_secret_key_file=str(keys["client_secret"]))
    with pytest.raises(ValueError, match="curve_secret_key_file: given without"):  # the same
        SubscriberConfig(endpoint="tcp://h:1", curve_secret_key_file=str(keys["client_secret"]))
    config = SubscriberConfig(endpoint="tcp://h:1",
                              curve_server_key_file=str(keys["server_public"]),
                              curve_secret_key_file=str(keys["client_secret"]))
    assert config.subscriber_kwargs()["curve_secret_key_file"] == str(keys["client_secret"])


# -- key files -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640, 0o604])
def test_secret_key_with_loose_permissions_is_refused_saying_how_to_fix(
    keys: dict[str, Path], mode: int,
) -> None:
    secret = keys["server_secret"]
    os.chmod(secret, mode)
    with pytest.raises(ConfigError, match=rf"permissions {mode:04o} .*chmod 600 {secret}"):
        WeightPublisher("tcp://127.0.0.1:0", curve_secret_key_file=str(secret))
    os.chmod(keys["client_secret"], mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        WeightSubscriber("tcp://127.0.0.1:1", curve_server_key_file=str(keys["server_public"]),
                         curve_secret_key_file=str(keys["client_secret"]))
    os.chmod(secret, 0o600)
    WeightPublisher("tcp://127.0.0.1:0", curve_secret_key_file=str(secret)).close()


def test_public_key_given_as_secret_is_named(keys: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="has no secret key"):
        WeightPublisher("tcp://127.0.0.1:0", curve_secret_key_file=str(keys["server_public"]))


def test_keys_create_cli_writes_a_usable_pair_with_safe_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    old = os.umask(0o000)  # even a permissive umask gives a 0600 secret
    try:
        assert cli_main(["keys", "create", "node1", "--dir", str(tmp_path / "k")]) == 0
    finally:
        os.umask(old)
    public, secret = tmp_path / "k" / "node1.key", tmp_path / "k" / "node1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pub_key, sec_key = zmq.auth.load_certificate(str(secret))
    assert zmq.auth.load_certificate(str(public)) == (pub_key, None)
    assert len(pub_key) == 40 and len(sec_key or b"") == 40
    assert "node1.key_secret" in capsys.readouterr().out
    assert cli_main(["keys", "create", "node1", "--dir", str(tmp_path / "k")]) == 2
    assert "already exists" in capsys.readouterr().err


# -- refusals are named on both sides --------------------------------------------------------------
def _refused(sub: WeightSubscriber, words: str) -> bool:
    return words in (sub.status()["last_error"] or "")


@pytest.mark.parametrize(("client", "words"), [
    ("stranger", "refused this client's CURVE key"),
    ("wrong_server_key", "closed during the handshake"),
    ("plaintext", "one side uses CURVE and the other does not"),
])
def test_curve_refusal_is_a_clear_error_on_the_client_and_a_warning_on_the_publisher(
    keys: dict[str, Path], make_sub: Callable[..., WeightSubscriber],
    caplog: pytest.LogCaptureFixture, client: str, words: str,
) -> None:
    caplog.set_level(logging.WARNING)
    kwargs: dict[str, str] = {
        "stranger": {"curve_server_key_file": str(keys["server_public"]),
                     "curve_secret_key_file": str(keys["stranger_secret"])},
        "wrong_server_key": {"curve_server_key_file": str(keys["client_public"]),
                             "curve_secret_key_file": str(keys["client_secret"])},
        "plaintext": {},
    }[client]
    with WeightPublisher("tcp://127.0.0.1:0", curve_secret_key_file=str(keys["server_secret"]),
                         curve_allowed_clients_dir=str(keys["allowed"]),
                         heartbeat_interval=0.2) as pub:
        pub.publish({"w": torch.arange(8)})
        sub = make_sub(pub.endpoint, request_timeout=2.0, **kwargs)
        # the handshake timeout is request_timeout (2 s); the refusal is named well before
        # the test's own bound, and nothing is staged
        wait_until(lambda: _refused(sub, words), 15, f"the client to report {words!r}")
        assert sub.status()["last_error"].startswith("TransportError: ")
        assert sub.status()["handshake_failures"] >= 1 and sub.latest() is None
        wait_until(lambda: any(r.levelno == logging.WARNING and "refused" in r.getMessage()
                               or "CURVE" in r.getMessage() and r.levelno == logging.WARNING
                               for r in caplog.records if r.name.startswith("weightpub")),
                   15, "a WARNING on the publisher")
        sub.close()


def test_a_key_removed_from_the_allow_list_stops_working(
    keys: dict[str, Path], make_sub: Callable[..., WeightSubscriber],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    with WeightPublisher("tcp://127.0.0.1:0", curve_secret_key_file=str(keys["server_secret"]),
                         curve_allowed_clients_dir=str(keys["allowed"]),
                         heartbeat_interval=0.2) as pub:
        client = {"curve_server_key_file": str(keys["server_public"]),
                  "curve_secret_key_file": str(keys["client_secret"])}
        sub = make_sub(pub.endpoint, request_timeout=1.0, **client)
        first = pub.publish({"w": torch.full((1000,), 1.0)})
        assert torch.equal(sub.wait_for_version(first, timeout=20).tensors["w"],
                           torch.full((1000,), 1.0))
        client_key = zmq.auth.load_certificate(str(keys["client_public"]))[0]
        keys["client_public"].unlink()  # revoke while its connection is open
        allow_list = pub._server.options.allow_list
        wait_until(lambda: not allow_list.allowed(client_key), 5,
                   "the allow-list to be re-read (at most every second)")
        second = pub.publish({"w": torch.full((1000,), 2.0)})
        wait_until(lambda: any("not in the allow-list" in r.getMessage()
                               for r in caplog.records), 15, "the revoked key's request refused")
        with pytest.raises(TimeoutError):
            sub.wait_for_version(second, timeout=3)
        assert sub.latest().version == first  # the live connection got nothing more
        late = make_sub(pub.endpoint, request_timeout=1.0, **client)
        wait_until(lambda: _refused(late, "refused this client's CURVE key"), 15,
                   "a new connection with the revoked key to be refused")
        assert late.latest() is None
