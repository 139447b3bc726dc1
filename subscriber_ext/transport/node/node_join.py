"""One staging per node: the local ranks of a replica share one subscription.

``join_node_staging`` is called by every local rank with the same ``key``
(the replica's identity plus the endpoint). The first rank to bind the node
channel's abstract socket becomes the owner (``node_owner.py``): it runs the
only ``WeightSubscriber`` of the node, staging into shared memory. Every other
rank becomes a follower (``node_follower.py``) and maps the owner's buffers.
Either way the caller gets a ``VersionSource`` that offers complete, verified
versions to ``on_version``: the publisher serves each version once per node,
and the node holds one staged copy whatever the TP size.

No vLLM here: the worker extension supplies the key and the rank.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from subscriber_ext.transport.node.node_channel import bind_node, connect_node, node_address
from subscriber_ext.transport.node.node_follower import NodeStagingFollower
from subscriber_ext.transport.node.node_owner import NodeStagingOwner, Subscribe
from subscriber_ext.transport.staging.assembly import SharedView
from subscriber_ext.transport.staging.progress import PartialVersion
from weightpub_wire.errors import TransportError

__all__ = ["NodeStagingFollower", "NodeStagingOwner", "join_node_staging", "node_label"]


def node_label(key: str) -> str:
    """The tag in the names of a replica's shared staging memory
    (``/memfd:weightpub-stage-<label>`` in ``/proc/<pid>/maps``)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def join_node_staging(key: str, *, rank: int, on_version: Callable[[SharedView], None],
                      subscribe: Subscribe, timeout: float = 30.0,
                      on_progress: Callable[[PartialVersion], None] | None = None,
                      ) -> NodeStagingOwner | NodeStagingFollower:
    """Own the node's subscription (first local rank to arrive) or follow its owner.

    ``on_progress``: this rank also sees each version while it arrives (every rank
    of the node, through the owner; ``transport/staging/progress.py``).
    """
    address = node_address(key)
    label = node_label(key)
    deadline = time.monotonic() + timeout
    while True:
        listener = bind_node(address)
        if listener is not None:
            return NodeStagingOwner(listener, rank=rank, on_version=on_version,
                                    subscribe=subscribe, label=label, on_progress=on_progress)
        sock = connect_node(address, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        if sock is not None:
            return NodeStagingFollower(sock, address, rank=rank, on_version=on_version,
                                       on_progress=on_progress)
        if time.monotonic() >= deadline:  # bound by someone who never accepts
            raise TransportError(f"node staging: could neither own nor reach the node channel "
                                 f"for rank {rank} within {timeout}s")
        time.sleep(0.05)  # the owner was closing between our bind and connect: try again
