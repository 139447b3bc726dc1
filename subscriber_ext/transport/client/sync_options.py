"""``SyncOptions``: how the sync client fetches, declared once (bound, default, unit, doc).

``SyncSettings`` holds the options a user may give from anywhere (keywords, the
``subscriber:`` YAML section, vLLM's ``init_info``); ``SyncOptions`` adds the
Python-only objects (receiver ``Limits``, the built ``PeerOptions``) and is what
``SyncClient`` runs with. Both are ``OptionSet``s (``weightpub_wire/option_set.py``):
``SyncOptions(chunks_per_request=0)`` is the same ``ConfigError`` as the keyword or
the YAML key.
"""

from __future__ import annotations

from pydantic import Field, InstanceOf

from subscriber_ext.transport.peers.peer_options import PeerOptions
from weightpub_wire import protocol as wire
from weightpub_wire.option_set import OptionSet, unit

__all__ = ["SyncOptions", "SyncSettings"]


class SyncSettings(OptionSet):
    """The sync client's options a user gives (``WeightSubscriber`` keywords)."""

    request_timeout: float = Field(
        5.0, gt=0, le=600, json_schema_extra=unit("s"),
        description="a request unanswered this long is asked again (one try of "
                    "max_chunk_retries); a silent publisher or rank costs the version after it")
    window_bytes: int = Field(
        64 << 20, ge=1, json_schema_extra=unit("bytes", yaml="window_mib"),
        description="bytes in flight to the publisher (at least one chunk, at most "
                    f"{wire.MAX_CHUNKS_IN_FLIGHT} chunks)")
    chunks_per_request: int = Field(
        4, ge=1, le=wire.MAX_CHUNKS_PER_FETCH, json_schema_extra=unit("chunks"),
        description="chunks asked for in one request")
    max_chunk_retries: int = Field(
        5, ge=0, le=1000, json_schema_extra=unit("tries"),
        description="a chunk that failed (timeout, checksum) this many times gives the "
                    "version up (last_error says why)")
    switch_below_fraction: float = Field(
        0.5, ge=0, le=1, json_schema_extra=unit("fraction"),
        description="a newer manifest replaces the version being fetched while less than "
                    "this fraction of it has arrived")
    report_interval: float = Field(
        2.0, gt=0, le=3600, json_schema_extra=unit("s"),
        description="how often the subscriber reports its state to the publisher")
    collective: bool = Field(
        False, description="join the publisher's collective data path when its manifests "
                           "announce one (same fabric only)")
    collective_device: str | None = Field(
        None, description="nccl / cuda_ipc: this node's GPU, e.g. 'cuda:0'")
    nixl: bool | None = Field(
        None, description="read versions one-sided with NIXL when the manifests offer it "
                          "(None: where NIXL imports; False: never, counted as a fallback); "
                          "True also READs from peers (peer_share) and offers them what "
                          "came over NIXL")
    stream: bool = Field(
        False, description="fetch chunks on the publisher's plain TCP stream port when the "
                           "manifests announce one (a one-time token asked over the DEALER, "
                           "bytes received straight into staging; NOT encrypted; a sliced "
                           "subscriber's slices too, where the publisher serves them); any "
                           "failure falls back to ZeroMQ frames, counted by cause")


class SyncOptions(SyncSettings):
    """What ``SyncClient`` runs with: the settings plus Python-only objects."""

    limits: InstanceOf[wire.Limits] = Field(
        default_factory=wire.Limits, json_schema_extra=unit("", python_only=True),
        description="receiver bounds checked before anything a peer asked for is allocated "
                    "(weightpub_wire Limits; max_version_bytes sets its max_total_bytes)")
    peers: InstanceOf[PeerOptions] | None = Field(
        None, json_schema_extra=unit("", python_only=True),
        description="peer sharing, built from the peer_* keywords (peer_share=True)")
