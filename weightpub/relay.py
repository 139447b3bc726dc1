"""A relay: subscribe upstream, re-publish each version downstream with the same number.

Fan-out tier for large fleets: one relay per node (or rack) pulls each version
from the trainer once and serves the local replicas, so the trainer's NIC
carries one copy per relay instead of one per replica.

Cut-through (the default): the relay announces an upstream version downstream
the moment its upstream fetch starts, and forwards each chunk as soon as it has
verified it (``WeightPublisher.relay_version``: same tensors, chunking and
checksums, so nothing is re-hashed, and downstream subscribers check every
chunk as always). The time through a relay is about one transfer plus a few
chunk times, not two transfers. ``cut_through: false`` keeps the old
store-and-forward (receive the whole version, then ``publish()`` it again).

NIXL (``nixl: true`` downstream): the relay's pool buffers are registered once with
its own agent and its downstream subscribers READ its copy one-sided; a cut-through
relay adds the offer to a version's manifest only once its copy is complete
(``WeightPublisher.relay_version``), before that downstream gets frames; with
``nixl_cut_through: true`` downstream it offers each version at once with a per-chunk
readiness map, so downstream READs overlap its upstream copy. Why a version went out
unoffered: ``publisher.nixl_status()["unoffered"]``.

Stream (``stream: true``, issue 29): upstream, the relay receives on the trainer's
plain-TCP stream port (chunks still reach the cut-through as they verify); downstream,
it serves its copy on a stream port of its own, announced in every manifest it makes
(a cut-through version's chunks are sent there once written in). Each hop falls back
to frames by itself.
"""

from __future__ import annotations

import logging
import threading

from publisher import WeightPublisher
from publisher.serving.relayed import RelayedVersion
from subscriber_ext import StagedVersion, WeightSubscriber
from weightpub.deployment_config import RelayConfig
from weightpub_wire.buffers import byte_view
from weightpub_wire.protocol import Manifest

__all__ = ["Relay", "run_relay"]

log = logging.getLogger("weightpub.relay")


class Relay:
    """Runs until ``close()``; versions keep the upstream numbering."""

    def __init__(self, config: RelayConfig) -> None:
        down = config.downstream
        self.cut_through = config.cut_through
        self.publisher = WeightPublisher(down.endpoint, options=down.options())
        self._last = 0
        self._lock = threading.Lock()
        self._open: RelayedVersion | None = None
        self.subscriber = WeightSubscriber(
            config.upstream.endpoint, on_version=self._staged,
            chunk_listener=self if self.cut_through else None,
            options=config.upstream.subscriber_options(),
        )

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    def _number(self, upstream_version: int) -> int:
        if upstream_version <= self._last:
            log.warning("upstream restarted at version %d; relay keeps numbering above %d",
                        upstream_version, self._last)
        return max(upstream_version, self._last + 1)

    # -- store and forward -----------------------------------------------------------------------
    def _staged(self, staged: StagedVersion) -> None:
        if self.cut_through:
            current = self._open
            if current is None or current.upstream != (staged.publisher_id, staged.version):
                self._forward(staged.manifest)  # its sums followed it: announced complete
            self._fill(staged)
        else:
            with self._lock:
                number = self._number(staged.version)
                self.publisher.publish(staged.items(), version=number)
                self._last = number
        staged.release()

    # -- cut-through (ChunkListener: the upstream subscriber's thread) ---------------------------
    def target_started(self, manifest: Manifest) -> None:
        current = self._open
        if current is not None and not current.failed and \
                current.upstream == (manifest.publisher_id, manifest.version):
            return  # the same version again (a delta fell back to a full fetch)
        if manifest.sums_follow:  # announced before its checksums (announce_early upstream):
            return  # forwarded once staged, with every sum (``_staged``)
        self._forward(manifest)

    def _forward(self, manifest: Manifest) -> None:
        """Announce ``manifest`` downstream; its chunks follow as they verify."""
        with self._lock:
            if self._open is not None and not self._open.complete:
                self._open.fail()  # superseded upstream: downstream moves on too
            number = self._number(manifest.version)
            self._open = self.publisher.relay_version(manifest, version=number)
            self._last = number

    def chunk_verified(self, manifest: Manifest, chunk: int, data: memoryview) -> None:
        current = self._open
        if current is not None and current.upstream == (manifest.publisher_id, manifest.version):
            current.write_chunk(chunk, data)

    def target_completed(self, manifest: Manifest) -> None:
        return None  # complete once its last chunk is written; ``_fill`` makes sure

    def target_dropped(self, manifest: Manifest) -> None:
        return None  # kept until a newer version supersedes it (the upstream may retry)

    def _fill(self, staged: StagedVersion) -> None:
        """Write any chunk the relay did not hear about (never expected) from the staged copy."""
        current = self._open
        if current is None or current.complete or \
                current.upstream != (staged.publisher_id, staged.version):
            return
        view = byte_view(staged.buffer, staged.total_bytes)
        for chunk in range(staged.manifest.num_chunks):
            if not current.is_ready(chunk):
                start, size = staged.manifest.chunk_span(chunk)
                current.write_chunk(chunk, view[start: start + size])

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
