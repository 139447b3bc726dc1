"""A relay: subscribe upstream, re-publish each version downstream with the same number.

Fan-out tier for large fleets: one relay per node (or rack) pulls each version
from the trainer once and serves the local replicas, so the trainer's NIC
carries one copy per relay instead of one per replica.
"""

from __future__ import annotations

import logging
import threading

from publisher import WeightPublisher
from subscriber_ext import StagedVersion, WeightSubscriber
from weightpub.config import RelayConfig

__all__ = ["Relay", "run_relay"]

log = logging.getLogger("weightpub.relay")


class Relay:
    """Runs until ``close()``; versions keep the upstream numbering."""

    def __init__(self, config: RelayConfig) -> None:
        down = config.downstream
        self.publisher = WeightPublisher(down.endpoint, **down.publisher_kwargs())
        self._last = 0
        self._lock = threading.Lock()
        self.subscriber = WeightSubscriber(
            config.upstream.endpoint, on_version=self._forward,
            **config.upstream.subscriber_kwargs(),
        )

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    def _forward(self, staged: StagedVersion) -> None:
        with self._lock:
            if staged.version <= self._last:
                log.warning("upstream restarted at version %d; relay keeps numbering above %d",
                            staged.version, self._last)
            number = max(staged.version, self._last + 1)
            self.publisher.publish(staged.items(), version=number)
            self._last = number
        staged.release()

    def close(self) -> None:
        self.subscriber.close()
        self.publisher.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_relay(config: RelayConfig) -> None:
    with Relay(config) as relay:
        print(f"relay: {config.upstream.endpoint} -> {relay.endpoint} (Ctrl-C to stop)",
              flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
