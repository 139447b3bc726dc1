"""What the data-path tests share (``test_nixl_path``, ``test_stream_path``): one small
three-tensor version served by a publisher child process, and a subscriber here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from subscriber_ext import WeightSubscriber
from tests.transport.procs import Child, det_weights, digests

SPEC = [("w", "float32", [1024, 1024]), ("b", "int32", [300_000]), ("e", "uint8", [12_345])]
CHUNK = 1 << 20


def start_publisher(spawn: Callable[..., Child], **args: Any) -> tuple[Child, str]:
    """A publisher child (seed 7, 1 MiB chunks) and its endpoint."""
    child = spawn("publisher", endpoint="tcp://127.0.0.1:0", seed=7, chunk_size=CHUNK, **args)
    return child, child.event("ready", timeout=60)["endpoint"]


def publish(child: Child, version: int) -> None:
    child.request("publish", timeout=60, version=version, spec=SPEC)


def child_stats(child: Child) -> dict[str, Any]:
    return child.request("stats")


def subscriber(closing: Callable[[Any], Any], endpoint: str, **options: Any
               ) -> WeightSubscriber:
    """A subscriber closed at the test's end, with a 3 s request timeout unless given."""
    return closing(WeightSubscriber(endpoint, **{"request_timeout": 3.0, **options}))


def exact(staged: Any, version: int) -> bool:
    """Whether ``staged`` holds version ``version`` of ``SPEC`` bit for bit."""
    return digests(staged.items()) == digests(det_weights(7, version, SPEC).items())
