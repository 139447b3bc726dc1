"""How a replica's ranks receive versions: each its own slices, or whole (node staging).

Why a choice: a rank's slices are about 1/TP of a version plus what every rank
replicates (norms, GQA's shared KV heads); where that is most of the version (TP=1,
a model whose tensors are all replicated) one staged copy per node moves fewer bytes.
``receive`` (``WorkerOptions``): ``slices`` (each rank its own receiver and plan),
``whole`` (node staging or one subscriber per rank, as ``node_staging`` says), or
``auto``: slices at more than one rank when every rank's plan needs less than
``AUTO_SLICES_BELOW`` of the version, recorded at start from the checkpoint's
layout; whole otherwise, and whole, with the cause counted, when the plan cannot be
recorded. Without a checkpoint layout at start (a hub name) ``auto`` decides at the
first version, once (``AUTO_PENDING`` until then: each rank fetches that version whole
on its own receiver while it records its plan for the version's layout; then slices,
or whole for good; later versions are not decided again). Each rank decides by its own
plan, without agreement (no collective can run off vLLM's step loop), so one rank may
slice while another stays whole. That breaks nothing: while pending no rank joins node
staging (each runs its own receiver, and staying whole keeps it), and the commit is
agreed on the versions every rank holds, whatever brought them: a rank late after its
replan holds it (``tests/unit/test_slice_receiver.py`` pins both). What was chosen and why is
in ``weight_status()["receive"]``, with what planning cost (``plan_seconds``: the
checkpoint's headers read and this rank's plan recorded through vLLM's loaders, at
start or at the first version; None when nothing was planned).
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

__all__ = ["AUTO_PENDING", "AUTO_SLICES_BELOW", "RECEIVE_MODES", "Layout", "ReceiveChoice",
           "ReceiveMode", "checkpoint_layout"]

logger = logging.getLogger("weightpub.slices")

#: a version's layout: (published name, dtype name, shape) per tensor, in manifest order
Layout = tuple[tuple[str, str, tuple[int, ...]], ...]
ReceiveMode = Literal["auto", "slices", "whole"]
RECEIVE_MODES: tuple[str, ...] = get_args(ReceiveMode)
#: auto fetches slices when every rank needs less than this share of a version
AUTO_SLICES_BELOW = 0.9
#: ``receive: auto``'s cause while it waits for the first version to decide
AUTO_PENDING = "no checkpoint layout: decides at the first version"
#: safetensors dtype names -> the wire's
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_MAX_HEADER = 100 << 20  # safetensors' own bound on a header


@dataclass
class ReceiveChoice:
    """What a rank receives with: ``slices``, ``node`` (node staging) or ``rank`` (whole,
    its own subscriber); ``cause``: why (``auto`` fell back, or was asked)."""

    mode: str
    cause: str
    needed_fraction: float | None = None  # this rank's plan, of the version (slices)
    fallbacks: dict[str, int] = field(default_factory=dict)  # auto chose whole, by cause
    plan_seconds: float | None = None  # reading the layout and recording the plan at start

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode, "cause": self.cause,
                "needed_fraction": self.needed_fraction, "fallbacks": dict(self.fallbacks),
                "plan_seconds": self.plan_seconds}


def checkpoint_layout(model: str) -> Layout | None:
    """The (name, dtype, shape) of every tensor in a local checkpoint's safetensors files,
    read from their headers only; None when ``model`` is no local directory of them."""
    root = Path(model)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        return None
    out = []
    try:
        for path in files:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > _MAX_HEADER:
                    raise ValueError(f"{path.name}: header of {size} bytes")
                header = json.loads(f.read(size))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype = _DTYPES.get(str(info["dtype"]))
                if dtype is None:
                    raise ValueError(f"{path.name}: {name}: dtype {info['dtype']!r}")
                out.append((str(name), dtype, tuple(int(n) for n in info["shape"])))
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        logger.info("weightpub: no checkpoint layout from %s (%s)", model, exc)
        return None
    return tuple(out)
