"""CurveZMQ: encrypted transfer works with keys; clients without allowed keys get nothing."""

from __future__ import annotations

import pytest
import torch

from publisher import WeightPublisher, WeightPubTimeout
from subscriber_ext import WeightSubscriber
from weightpub_wire.errors import ConfigError
from weightpub_wire.keys import create_key_pair


@pytest.fixture()
def keys(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_public, server_secret = create_key_pair(tmp_path, "server")
    _, client_secret = create_key_pair(allowed, "client")
    _, stranger_secret = create_key_pair(tmp_path, "stranger")
    return {"server_public": server_public, "server_secret": server_secret, "allowed": allowed,
            "client_secret": client_secret, "stranger_secret": stranger_secret}


@pytest.mark.timeout(60)
def test_curve_allows_listed_client_and_refuses_others(keys):
    weights = {"w": torch.randn(64, 64)}
    with WeightPublisher("tcp://127.0.0.1:0", curve_secret_key_file=keys["server_secret"],
                         curve_allowed_clients_dir=keys["allowed"]) as pub:
        version = pub.publish(weights)
        with WeightSubscriber(pub.endpoint, curve_server_key_file=keys["server_public"],
                              curve_secret_key_file=keys["client_secret"]) as sub:
            staged = sub.wait_for_version(version, timeout=20)
            assert torch.equal(staged.tensors["w"], weights["w"])
        for extra in ({"curve_server_key_file": keys["server_public"],
                       "curve_secret_key_file": keys["stranger_secret"]}, {}):
            with WeightSubscriber(pub.endpoint, **extra) as outsider:
                with pytest.raises(WeightPubTimeout):
                    outsider.wait_for_version(version, timeout=2)


def test_curve_bad_key_file_is_a_config_error(tmp_path):
    bogus = tmp_path / "nope.key"
    bogus.write_text("not a certificate")
    with pytest.raises(ConfigError, match="nope.key"):
        WeightPublisher("tcp://127.0.0.1:0", curve_secret_key_file=str(bogus))
