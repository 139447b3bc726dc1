"""The fleet simulator runs real subscribers on simulated hosts and cleans up after itself.

Every mode the benchmark reports runs here on a small case (3 hosts, 4 MiB): direct,
cut-through relays, store-and-forward relays, and peer sharing, where the trainer's
uplink must carry each version exactly once (direct: once per host).
"""

from __future__ import annotations

import subprocess

import pytest

from benchmarks.fleet import Scenario, run_scenario
from benchmarks.netsim import Link, Network, available

OK, WHY = available()
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not OK, reason=f"fleet simulator needs network namespaces: {WHY}"),
]


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


@pytest.mark.parametrize("mode", ["direct", "relay", "relay-sf", "peers"])
def test_small_fleet_gets_every_version_bit_exact(mode: str) -> None:
    before = namespaces()
    result = run_scenario(Scenario(hosts=3, mode=mode, mib=4, rounds=2,
                                   link=Link(up_mbit=800, down_mbit=800)))
    # run_scenario checks every host's digest against the trainer's for every version
    assert len(result["seconds"]) == 2 and all(t > 0 for t in result["seconds"])
    sent = result["trainer_versions_sent"]
    if mode == "direct":
        assert sent == [3.0, 3.0]
    elif mode == "peers":
        assert sent == [1.0, 1.0], result  # each chunk left the trainer once
        assert result["peers"]["from_peers_fraction"] == pytest.approx(2 / 3, abs=0.01)
    else:
        assert sent == [2.0, 2.0]  # round(sqrt(3)) = 2 relays
    assert namespaces() == before, "namespaces left behind"


def test_network_is_torn_down_after_an_error() -> None:
    before = namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with Network() as net:
            host = net.add_host(Link(up_mbit=100, down_mbit=100))
            proc = host.popen(["sleep", "60"])
            raise RuntimeError("boom")
    assert proc.poll() is not None, "a process started in the network survived"
    assert namespaces() == before
