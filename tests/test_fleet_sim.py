"""The fleet simulator runs real subscribers on simulated hosts and cleans up after itself.

Every mode the benchmark reports runs here on a small case (3 hosts, 4 MiB): direct,
cut-through relays, store-and-forward relays, and peer sharing, where the trainer's
uplink must carry each version exactly once (direct: once per host). Nodes are forked
from a zygote with torch loaded (``forked_nodes``: milliseconds, not an interpreter
start each) except in the outside harness's shape, which starts real interpreters.
"""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from benchmarks.fleet import Scenario, run_scenario
from benchmarks.netsim import Link, Network, available, tbf_burst

OK, WHY = available()
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not OK, reason=f"fleet simulator needs network namespaces: {WHY}"),
]


def namespaces(prefix: str) -> set[str]:
    """This test's namespaces (a benchmark may run beside it with namespaces of its own)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in listed.stdout.splitlines()
            if line.strip() and line.startswith(prefix)}


def unique_prefix() -> str:
    return f"wpt{uuid.uuid4().hex[:4]}"


@pytest.mark.parametrize("mode", ["direct", "relay", "relay-sf", "peers"])
def test_small_fleet_gets_every_version_bit_exact(mode: str) -> None:
    prefix = unique_prefix()
    result = run_scenario(Scenario(hosts=3, mode=mode, mib=4, rounds=2,
                                   link=Link(up_mbit=800, down_mbit=800), prefix=prefix,
                                   forked_nodes=True))
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
    assert not namespaces(prefix), "namespaces left behind"


@pytest.mark.parametrize("mode", ["direct", "peers"])
def test_a_sharded_trainer_on_two_hosts_delivers_bit_exact(mode: str) -> None:
    """Issue 20: two trainer ranks, each on a host of its own, each serving half; with
    peers the coordinator's tracker stripes the union over the hosts."""
    prefix = unique_prefix()
    result = run_scenario(Scenario(hosts=3, mode=mode, mib=4, rounds=2,
                                   link=Link(up_mbit=800, down_mbit=800), prefix=prefix,
                                   trainer_ranks=2, forked_nodes=True))
    assert len(result["seconds"]) == 2 and all(t > 0 for t in result["seconds"])
    if mode == "direct":
        assert result["trainer_versions_sent"] == [3.0, 3.0]  # the two ranks together
    else:  # each chunk left its rank once
        assert result["trainer_versions_sent"] == [1.0, 1.0], result
        assert result["peers"]["from_peers_fraction"] == pytest.approx(2 / 3, abs=0.01)
    assert not namespaces(prefix), "namespaces left behind"


def test_network_is_torn_down_after_an_error() -> None:
    prefix = unique_prefix()
    with pytest.raises(RuntimeError, match="boom"):
        with Network(prefix) as net:
            host = net.add_host(Link(up_mbit=100, down_mbit=100))
            proc = host.popen(["sleep", "60"])
            made = namespaces(prefix)
            raise RuntimeError("boom")
    assert made, "the network was never made"  # so the check below could fail
    assert proc.poll() is not None, "a process started in the network survived"
    assert not namespaces(prefix)


def root_links(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True)
    return [line.split()[0] for line in listed.stdout.splitlines()
            if line.startswith(prefix)]


def test_a_trainer_in_the_machines_namespace_with_the_application_waiting() -> None:
    """The outside harness's shape (issue 22.5): the publisher outside any namespace behind
    a shaped link of its own, its default chunk size, subscribers taking versions with
    ``wait_for_version`` then ``release()``, versions spaced; the link is gone afterwards."""
    prefix = unique_prefix()
    result = run_scenario(Scenario(hosts=2, mode="peers", mib=8, rounds=2,
                                   link=Link(up_mbit=800, down_mbit=800), chunk_mib=0,
                                   publisher_root=True, consumer="wait", spacing=0.2,
                                   dtype="bf16", torch_threads=0, prefix=prefix))
    assert result["trainer_versions_sent"] == [1.0, 1.0], result  # 2 chunks per stripe root
    assert result["first_s"] > 0 and result["steady_s"] > 0
    assert not namespaces(prefix) and not root_links(prefix), "left behind"


def tbf_options(ns: str, dev: str) -> dict[str, int]:
    at = ["-n", ns] if ns else []
    shown = subprocess.run(["tc", *at, "-j", "qdisc", "show", "dev", dev], capture_output=True,
                           text=True, check=True).stdout
    return next(q["options"] for q in json.loads(shown) if q["kind"] == "tbf")


def gso_max_size(ns: str, dev: str) -> int:
    at = ["-n", ns] if ns else []
    shown = subprocess.run(["ip", *at, "-j", "-d", "link", "show", "dev", dev],
                           capture_output=True, text=True, check=True).stdout
    return int(json.loads(shown)[0]["gso_max_size"])


@pytest.mark.parametrize("mbit", [100, 200])
def test_a_slow_links_bucket_holds_whole_gso_packets(mbit: int) -> None:
    """tbf cuts a packet longer than its bucket into MTU segments in software: at 200 Mbit/s
    the 2 ms bucket (50 KB) was under the veth's 64 KiB GSO packets, and the 16-host fleet
    spent its two cores segmenting (issue 22.5: 3-4x one host instead of 1.5-1.7x)."""
    prefix = unique_prefix()
    with Network(prefix) as net:
        host = net.add_host(Link(up_mbit=mbit, down_mbit=mbit))
        ends = [(host.name, "eth1"), (net.switch, f"{net.prefix[-4:]}p1")]
        for ns, dev in ends:
            gso = gso_max_size(ns, dev)
            assert gso >= 64 << 10, (ns, dev, gso)  # so the check below could fail
            options = tbf_options(ns, dev)
            assert options["rate"] == mbit * 1_000_000 // 8, options
            # a whole GSO packet and its segments' headers (tbf counts them); tc rounds the
            # bucket to its clock, a few bytes under what was asked
            assert options["burst"] > gso + (8 << 10), (ns, dev, options, gso)
    assert not namespaces(prefix)
    assert tbf_burst(400, 64 << 10) == 100_000  # faster links keep ~2 ms at line rate


def test_reap_removes_only_the_namespaces_of_the_prefix_it_is_given() -> None:
    mine, other = unique_prefix(), unique_prefix()
    with Network(other) as parallel_run:
        net = Network(mine)
        net.__enter__()  # a run killed outright: never closed
        try:
            assert namespaces(mine) and namespaces(other)
            gone = Network.reap(mine)
            assert set(gone) >= {net.switch} and not namespaces(mine)
            assert parallel_run.switch in namespaces(other)  # the parallel run is left alone
        finally:
            net.close()
