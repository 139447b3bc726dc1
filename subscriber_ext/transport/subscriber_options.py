"""The ``WeightSubscriber`` constructor's keywords, checked before anything starts.

Why apart: turning keyword overrides into one ``SyncOptions`` (unknown names,
peer-sharing keywords into ``PeerOptions``, ``max_version_bytes`` into the
limits) is pure validation with its own error messages; the worker extension
runs it on every rank before it builds a subscriber, so a bad option fails the
same way everywhere, and the subscriber module keeps only the thread and its API.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from subscriber_ext.transport.client.sync_client import SyncOptions
from subscriber_ext.transport.peers.peer_options import PeerOptions
from weightpub_wire.endpoints import parse_endpoint
from weightpub_wire.errors import ConfigError

__all__ = ["check_subscriber_options"]

_CONSTRUCTOR_KEYWORDS = ("on_version", "on_progress", "subscriber_id", "curve_server_key_file",
                         "curve_secret_key_file", "socket_hooks", "context", "allocator",
                         "chunk_listener")
#: keywords that turn on and shape peer sharing (``PeerOptions``)
_PEER_KEYWORDS = ("peer_share", "peer_bind", "insecure", "upload_mbit", "upload_cpu_share")


def check_subscriber_options(endpoint: str, options: SyncOptions | None = None,
                             staging_budget_bytes: int | None = None,
                             **option_overrides: Any) -> SyncOptions:
    """Validate the constructor's arguments without starting anything (``ConfigError``)."""
    parse_endpoint(endpoint)
    for keyword in _CONSTRUCTOR_KEYWORDS:  # checked where they are used
        option_overrides.pop(keyword, None)
    if staging_budget_bytes is not None and (
            isinstance(staging_budget_bytes, bool) or not isinstance(staging_budget_bytes, int)
            or staging_budget_bytes <= 0):
        raise ConfigError(f"staging_budget_bytes: {staging_budget_bytes!r} is not a "
                          "positive number of bytes")
    base = options or SyncOptions()
    peers = _peer_options({k: option_overrides.pop(k) for k in _PEER_KEYWORDS
                           if k in option_overrides})
    if peers is not None:
        option_overrides["peers"] = peers
    max_bytes = option_overrides.pop("max_version_bytes", None)
    if max_bytes is not None:
        limits = option_overrides.get("limits", base.limits)
        option_overrides["limits"] = dataclasses.replace(limits,
                                                         max_total_bytes=int(max_bytes))
    unknown = set(option_overrides) - set(SyncOptions.__slots__)
    if unknown:
        raise ConfigError(f"WeightSubscriber: unknown option(s) {sorted(unknown)} "
                          f"(known: {sorted(SyncOptions.__slots__)}, max_version_bytes, "
                          f"staging_budget_bytes, {', '.join(_PEER_KEYWORDS)})")
    if option_overrides:
        base = SyncOptions(**{**{f: getattr(base, f) for f in base.__slots__},
                              **option_overrides})
    return base


def _peer_options(given: dict[str, Any]) -> PeerOptions | None:
    """``PeerOptions`` from the constructor's peer keywords (None: peer sharing is off)."""
    share = given.pop("peer_share", False)
    if not isinstance(share, bool):
        raise ConfigError(f"peer_share: {share!r} is not true or false")
    if not share:
        if given:
            raise ConfigError(f"{', '.join(sorted(given))}: only with peer_share=True")
        return None
    mbit = given.get("upload_mbit")
    if mbit is not None and (isinstance(mbit, bool) or not isinstance(mbit, int | float)
                             or mbit <= 0):
        raise ConfigError(f"upload_mbit: {mbit!r} is not a positive number of Mbit/s")
    return PeerOptions(
        bind=given.get("peer_bind"), insecure=bool(given.get("insecure", False)),
        upload_bytes_per_s=None if mbit is None else mbit * 1e6 / 8,
        upload_cpu_share=given.get("upload_cpu_share", 0.25))
