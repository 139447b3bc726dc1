"""Which bytes of a version travel first: the largest tensors, then the rest in layout order.

Why: a replica prepares each layer as soon as its tensors are final (apply while
the bytes arrive), so what arrives last decides how long the commit waits after
the last byte. In layout order the last tensor is usually the largest single
one (an untied ``lm_head``, a fifth of a small model), whose preparation then
runs after the transfer. Sending the largest tensors first leaves only small
ones (norms, the last layer) for the end. The publisher copies its snapshot in
the same order (so what is asked for first is copied first); a subscriber
fetches in it. Either side using another order stays correct, only slower.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightpub_wire.manifest import chunks_of
from weightpub_wire.protocol import Manifest, TensorEntry

__all__ = ["BIG_FRACTION", "priority_chunk_ids", "priority_chunks", "priority_tensors"]

BIG_FRACTION = 16  # a tensor of at least 1/16 of the version goes first


def priority_tensors(entries: Sequence[TensorEntry], total_bytes: int) -> list[int]:
    """Tensor indices: the big ones in layout order, then every other one in layout order."""
    big = [i for i, e in enumerate(entries) if e.nbytes and e.nbytes * BIG_FRACTION >= total_bytes]
    chosen = set(big)
    return big + [i for i in range(len(entries)) if i not in chosen]


def priority_chunks(manifest: Manifest) -> list[int]:
    """Chunk ids in the order of ``priority_tensors`` (each chunk once)."""
    return priority_chunk_ids(manifest.tensors, manifest.total_bytes, manifest.chunk_size)


def priority_chunk_ids(entries: Sequence[TensorEntry], total_bytes: int,
                       chunk_size: int) -> list[int]:
    """``priority_chunks`` from a layout (the publisher hashes early sums in this order)."""
    seen: set[int] = set()
    order: list[int] = []
    for index in priority_tensors(entries, total_bytes):
        for chunk in chunks_of(entries[index], chunk_size):
            if chunk not in seen:
                seen.add(chunk)
                order.append(chunk)
    num_chunks = -(-total_bytes // chunk_size)
    order += [c for c in range(num_chunks) if c not in seen]  # padding-only chunks
    return order
