"""Which CURVE clients may talk to a publisher, re-read while it runs.

``AllowList`` holds the public keys found in a directory of certificate files
and re-reads the directory when it changes (checked at most every
``refresh_interval`` seconds), so removing a file revokes that key without a
restart. It is asked twice: by ZeroMQ's ZAP handler when a client connects,
and by the serving thread for every request (the connection's ``User-Id`` is
the client's z85 public key), so a revoked key stops working on connections
that are already open, too.

``start_authenticator`` runs pyzmq's ``ThreadAuthenticator`` with this list as
its credentials callback (or allowing any key when there is no list: the
``User-Id`` then still names each client's key, which binds its reports to it).
Refusals are logged at WARNING, rate-limited. ``only_keys`` gives a ZAP domain
(a socket's ``zap_domain``) a fixed set of keys of its own instead: a sharded
trainer's collect socket admits only the trainer's key pair
(``publisher.sharding.shard_coordinator``), whatever the subscribers' allow-list says.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from weightpub_wire.errors import ConfigError
from weightpub_wire.ratelog import RateLimitedLog

__all__ = ["AllowList", "KeySet", "start_authenticator"]

log = logging.getLogger("weightpub.security")


class AllowList:
    """Public keys (z85) of the certificate files in ``directory``; thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], refresh_interval: float = 1.0) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConfigError(f"curve_allowed_clients_dir {self.directory}: not a directory")
        self.refresh_interval = refresh_interval
        self._lock = threading.Lock()
        self._keys: frozenset[bytes] = frozenset()
        self._stamp: tuple[tuple[str, int, int], ...] | None = None
        self._checked = -1e18
        self._refusals = RateLimitedLog(log)
        self.refresh(force=True)

    def _listing(self) -> tuple[tuple[str, int, int], ...]:
        entries = []
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(".key") and entry.is_file():
                    st = entry.stat()
                    entries.append((entry.name, st.st_mtime_ns, st.st_size))
        return tuple(sorted(entries))

    def refresh(self, *, force: bool = False) -> None:
        """Re-read the directory if it changed (and the last check is old enough)."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._checked < self.refresh_interval:
                return
            self._checked = now
            try:
                stamp = self._listing()
            except OSError as exc:
                log.warning("cannot read curve_allowed_clients_dir %s (%s); keeping %d keys",
                            self.directory, exc.strerror, len(self._keys))
                return
            if stamp == self._stamp:
                return
            try:
                keys = frozenset(zmq.auth.load_certificates(str(self.directory)))
            except (OSError, ValueError) as exc:
                log.warning("cannot load keys from %s (%s); keeping %d keys", self.directory,
                            exc, len(self._keys))
                return
            if self._stamp is not None:
                log.warning("allow-list %s changed: %d client keys (was %d)", self.directory,
                            len(keys), len(self._keys))
            self._keys, self._stamp = keys, stamp

    def allowed(self, z85_key: bytes) -> bool:
        self.refresh()
        return z85_key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    # pyzmq's credentials provider protocol (``configure_curve_callback``)
    def callback(self, domain: str, key: bytes) -> bool:
        ok = self.allowed(key)
        if not ok:
            self._refusals.warning(
                "zap", f"refused a CURVE client: key {key.decode(errors='replace')} is not in "
                       f"the allow-list {self.directory}")
        return ok


class KeySet:
    """A fixed set of public keys (z85), as a ZAP credentials provider for one domain.

    ``what`` names who holds them (for the refusal's words); ``on_refused(why)`` is
    called on the ZAP thread for every refusal (a counter, a ``last_error``)."""

    def __init__(self, keys: Iterable[bytes], what: str,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.keys = frozenset(keys)
        self.what = what
        self._on_refused = on_refused
        self._refusals = RateLimitedLog(log)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            why = (f"refused a CURVE client on {domain}: key {key.decode(errors='replace')} "
                   f"is not {self.what}")
            self._refusals.warning("zap", why)
            if self._on_refused is not None:
                self._on_refused(why)
        return ok


class _AnyKey:
    """Every key (CURVE without an allow-list), as a provider: pyzmq's ``allow_any``
    would cover every domain, ``KeySet`` domains included."""

    @staticmethod
    def callback(domain: str, key: bytes) -> bool:
        return True


def start_authenticator(ctx: zmq.Context, allow_list: AllowList | None,
                        only_keys: Mapping[str, KeySet] | None = None) -> ThreadAuthenticator:
    """ZAP handler for ``ctx``: only keys in ``allow_list`` (or any key when it is None);
    a socket whose ``zap_domain`` is in ``only_keys`` admits only those keys."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("weightpub.zap"))
    auth.start()
    if allow_list is None and not only_keys:
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    else:
        auth.configure_curve_callback(domain="*", credentials_provider=allow_list or _AnyKey())
    for domain, keys in (only_keys or {}).items():
        auth.configure_curve_callback(domain=domain, credentials_provider=keys)
    return auth
