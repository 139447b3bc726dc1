"""Small real manifests and counting stand-ins for the sync client's policy tests.

No sockets and no engine: a stand-in records what it was given (messages sent,
targets started, dropped, completed) and what it released (assemblies abandoned),
so a test can assert on the policy's decisions alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightpub_wire import protocol as wire

OLD, NEW = "a" * 32, "b" * 32  # two publisher instances
CHUNK = 4096


def manifest(version: int, publisher_id: str = OLD, *, chunks: int = 4,
             total_bytes: int | None = None) -> wire.Manifest:
    """A valid manifest of one uint8 tensor (checksums are never checked here)."""
    size = chunks * CHUNK if total_bytes is None else total_bytes
    count = -(-size // CHUNK)
    return wire.Manifest(publisher_id=publisher_id, started_at=1700000000.0, version=version,
                         created_at=1700000001.0, chunk_size=CHUNK, total_bytes=size,
                         tensors=(wire.TensorEntry("w", "uint8", (size,), 0, size),),
                         checksums=(0,) * count)


@dataclass
class FakeAssembly:
    """A version being received (or handed over): how far along, and whether released."""

    manifest: wire.Manifest
    done_fraction: float = 0.0
    abandoned: int = 0

    def abandon(self) -> None:
        self.abandoned += 1


@dataclass
class FakeLife:
    """``TargetLife``: the client's target, with every start, drop and completion recorded."""

    target: FakeAssembly | None = None
    started: list[int] = field(default_factory=list)  # versions started
    dropped: list[int] = field(default_factory=list)  # versions dropped
    completed: list[Any] = field(default_factory=list)  # assemblies completed

    def start_target(self, manifest: wire.Manifest) -> None:
        self.started.append(manifest.version)
        self.target = FakeAssembly(manifest)

    def drop_target(self) -> None:
        if self.target is not None:
            self.dropped.append(self.target.manifest.version)
            self.target.abandon()
        self.target = None

    def complete_target(self, target: Any) -> None:
        self.completed.append(target)
        if self.target is target:
            self.target = None


@dataclass
class FakeSockets:
    """``ClientSockets`` without sockets: what was sent and where the SUB would connect."""

    endpoint: str = "tcp://127.0.0.1:5555"
    sent: list[Any] = field(default_factory=list)
    connected: bool = True
    pub_endpoint: str = ""
    sub_redials: int = 0

    def send(self, message: Any) -> bool:
        if not self.connected:
            return False
        self.sent.append(message)
        return True

    def follow_pub(self, pub: str) -> None:
        self.pub_endpoint = pub

    def redial_sub(self) -> None:
        self.sub_redials += 1
