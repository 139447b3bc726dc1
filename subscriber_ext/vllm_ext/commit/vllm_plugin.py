"""The one switch: does this vLLM process ask for weightpub, and vLLM's backend registry.

Why: the plugin entry point (``vllm.general_plugins: weightpub``) runs in *every*
vLLM process of a machine where weightpub is installed. weightpub must change a
process only when that process asks for it; any other engine runs untouched. A
process asks when its configuration names weightpub in one of three places:

* ``--weight-transfer-config '{"backend": "weightpub"}'`` (vLLM's own framework),
* ``--additional-config '{"weightpub": {...}}'`` (our autostart),
* ``--worker-extension-cls`` naming our extension (``subscriber_ext...``),

or when ``WEIGHTPUB_VLLM_PATCHES=1`` forces it (``0`` refuses it). vLLM calls the
plugin once per process with no argument, so ``asked_here`` looks for the
configuration it is loaded for: the ``EngineArgs`` being built (front end), the
``VllmConfig`` of the engine core or worker being constructed, or, in the
``vllm serve`` front end (plugins load while the CLI parser is built), the
command line.

A process decides once: vLLM loads plugins once per process, and a forked
engine core or worker inherits its parent's decision. A process whose *first*
vLLM configuration did not ask stays untouched even if it later builds an
engine that does (a forked engine core then lacks our hooks; the backend says
so): set ``WEIGHTPUB_VLLM_PATCHES=1`` there, or ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
(a spawned engine core decides from its own configuration). Where a process is
patched, an engine that does not ask still runs untouched (``vllm_patches._setup``).

The weight-transfer backends are registered by module path (nothing is
imported until vLLM creates one), so registering them is free and does not
count as changing the process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from weightpub_wire.errors import ConfigError

__all__ = [
    "BACKEND",
    "FORCE_ENV",
    "RECEIVER",
    "TRAINER",
    "asked_here",
    "ensure_backends",
    "register_backends",
    "uses_backend",
    "wants_weightpub",
]

#: the name in ``--weight-transfer-config '{"backend": "weightpub"}'``
BACKEND = "weightpub"
#: (module, class) vLLM's factories load lazily, on first use
RECEIVER = ("subscriber_ext.vllm_ext.weight_transfer_backend", "WeightpubWeightTransferEngine")
TRAINER = ("weightpub.vllm_trainer", "WeightpubTrainerEngine")
FORCE_ENV = "WEIGHTPUB_VLLM_PATCHES"
_EXTENSION_MARK = "subscriber_ext."
_FLAGS = ("--weight-transfer-config", "--additional-config", "--worker-extension-cls")


# ------------------------------------------------------------------ the switch
def uses_backend(config: Any) -> bool:
    """``config`` (``VllmConfig`` or ``EngineArgs``) selects the weightpub transfer backend."""
    wt = getattr(config, "weight_transfer_config", None)
    backend = wt.get("backend") if isinstance(wt, dict) else getattr(wt, "backend", None)
    return backend == BACKEND


def wants_weightpub(config: Any) -> bool:
    """``config`` (``VllmConfig`` or ``EngineArgs``) asks for weightpub in any of the three ways."""
    if uses_backend(config):
        return True
    extra = getattr(config, "additional_config", None)
    if isinstance(extra, dict) and BACKEND in extra:
        return True
    par = getattr(config, "parallel_config", None)
    ext = getattr(par if par is not None else config, "worker_extension_cls", "") or ""
    return isinstance(ext, str) and ext.startswith(_EXTENSION_MARK)


def _argv_asks(argv: Sequence[str]) -> bool:
    """A ``vllm serve`` command line names weightpub in one of the three flags."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in _FLAGS:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if BACKEND in value or _EXTENSION_MARK in value:
            return True
    return False


def _config_in_frames(depth: int = 48) -> Any | None:
    """The ``VllmConfig`` or ``EngineArgs`` whose construction is loading plugins now."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        loc = frame.f_locals
        cfg = loc.get("vllm_config")
        if cfg is not None and hasattr(cfg, "parallel_config"):
            return cfg
        this = loc.get("self")
        if this is not None and type(this).__name__.endswith("EngineArgs") \
                and hasattr(this, "weight_transfer_config"):
            return this
        frame = frame.f_back  # type: ignore[assignment]
    return None


def asked_here(argv: Sequence[str] | None = None) -> bool:
    """Does the process loading the plugin now ask for weightpub? (see the module doc)"""
    forced = os.environ.get(FORCE_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    config = _config_in_frames()
    if config is not None:
        return wants_weightpub(config)
    return _argv_asks(sys.argv[1:] if argv is None else argv)


# ------------------------------------------------------------------ the registry
def _factories() -> tuple[Any, Any]:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    return WeightTransferEngineFactory, WeightTransferTrainerFactory


def register_backends() -> None:
    """Register ``weightpub`` in vLLM's receiver and trainer factories.

    Raises ``ConfigError`` if either already holds the name: a second registration
    would silently replace the first (vLLM itself raises a bare ``ValueError``).
    The plugin calls ``ensure_backends``, which registers once per process.
    """
    receiver, trainer = _factories()
    for factory in (receiver, trainer):
        if BACKEND in factory._registry:
            raise ConfigError(
                f"weight transfer backend {BACKEND!r} is already registered in "
                f"{factory.__name__}; weightpub's vLLM plugin registers it once per process "
                "(call subscriber_ext.vllm_ext.commit.vllm_plugin.ensure_backends() instead)")
    receiver.register_engine(BACKEND, *RECEIVER)
    trainer.register_engine(BACKEND, *TRAINER)


def ensure_backends() -> bool:
    """Register the backends unless this process already has them; True if it did now."""
    receiver, trainer = _factories()
    have = [BACKEND in f._registry for f in (receiver, trainer)]
    if all(have):
        return False
    if any(have):
        raise ConfigError(f"weight transfer backend {BACKEND!r} is registered in only one of "
                          "vLLM's two factories (by someone else?)")
    register_backends()
    return True
