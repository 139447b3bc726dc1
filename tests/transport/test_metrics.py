"""The publisher's Prometheus endpoint, scraped from outside a real publisher process."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.transport.procs import Child, det_weights, wait_until

pytestmark = pytest.mark.timeout(60)

SPEC = [("w", "float32", [256, 256])]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_publisher_process_serves_metrics(spawn: Callable[..., Child], make_sub) -> None:
    pub = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=3, metrics_port=0)
    ready = pub.event("ready", 30)
    url = ready["metrics_url"]
    samples = scrape(url)
    assert samples[("weightpub_publisher_latest_version", ())] == 0
    assert samples[("weightpub_publisher_subscribers", (("state", "current"),))] == 0

    sub = make_sub(ready["endpoint"])
    for version in (1, 2):
        pub.send(cmd="publish", version=version, spec=SPEC)
        pub.event("published", 30, version=version)
        staged = sub.wait_for_version(version, timeout=30)
        sub.mark_applied(staged.version)
    size = sum(t.numel() * t.element_size() for t in det_weights(3, 1, SPEC).values())

    def settled() -> bool:
        got = scrape(url)
        return got.get(("weightpub_publisher_subscribers", (("state", "current"),))) == 1
    wait_until(settled, 20, "the subscriber's report to reach the publisher")
    samples = scrape(url)
    assert samples[("weightpub_publisher_latest_version", ())] == 2
    assert samples[("weightpub_publisher_versions_published_total", ())] == 2
    assert samples[("weightpub_publisher_served_bytes_total", ())] >= 2 * size
    assert samples[("weightpub_publisher_slowest_subscriber_lag_versions", ())] == 0
    assert samples[("weightpub_publisher_subscribers", (("state", "behind"),))] == 0
