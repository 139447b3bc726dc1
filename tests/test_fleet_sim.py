"""The fleet simulator runs real subscribers on simulated hosts and cleans up after itself."""

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


@pytest.mark.parametrize("mode", ["direct", "relay"])
def test_small_fleet_gets_every_version_bit_exact(mode: str) -> None:
    before = namespaces()
    result = run_scenario(Scenario(hosts=3, mode=mode, mib=4, rounds=2,
                                   link=Link(up_mbit=800, down_mbit=800)))
    # run_scenario checks every host's digest against the trainer's for every version
    assert len(result["seconds"]) == 2 and all(t > 0 for t in result["seconds"])
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
