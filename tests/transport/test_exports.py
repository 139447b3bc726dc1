"""The public surface is pinned: changing it must be a deliberate edit of this file.

(The idea of httpx's ``tests/test_exported_members.py``: ``__all__`` lists exactly the
public members of the package.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
import typing

import pytest

import publisher
import subscriber_ext
import weightpub_wire
from tests.transport.procs import REPO

pytestmark = pytest.mark.timeout(60)

PUBLISHER_ALL = [
    "PROTOCOL_VERSION",
    "AdapterSpec",
    "ApplyError",
    "ChecksumError",
    "ClosedError",
    "ConfigError",
    "Manifest",
    "ProtocolError",
    "PublishCallback",
    "PublisherConfig",
    "Report",
    "ServerLimits",
    "ShardedPublisher",
    "StagingBudgetError",
    "TensorEntry",
    "TransportError",
    "VersionUnavailable",
    "WeightPubError",
    "WeightPubTimeout",
    "WeightPublisher",
    "gather_full_tensors",
]

SUBSCRIBER_ALL = ["WORKER_EXTENSION", "BatchWeightSyncWorkerExtension", "StagedVersion",
                  "SubscriberConfig", "SyncOptions", "VersionRange", "WeightSubscriber",
                  "adapter_request", "keep_fresh", "replica_status", "request_version_range",
                  "version_range", "wait_until_applied"]

WIRE_ALL = ["PROTOCOL_VERSION", "ApplyError", "ChecksumError", "ClosedError", "ConfigError",
            "Manifest", "ProtocolError", "Report", "StagingBudgetError", "TensorEntry",
            "TransportError", "VersionUnavailable", "WeightPubError", "WeightPubTimeout"]
LAZY = {"BatchWeightSyncWorkerExtension"}  # resolved by module __getattr__, pulls in vLLM
PUBLISHER_LAZY = {"PublishCallback"}  # resolved by module __getattr__, pulls in transformers


def public_members(module: types.ModuleType) -> set[str]:
    """Public names bound in the module, minus submodules and typing helpers."""
    return {
        name for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", None) != "typing"
        and value is not typing.Any
    }


def test_publisher_all_is_pinned() -> None:
    assert publisher.__all__ == PUBLISHER_ALL
    assert public_members(publisher) | PUBLISHER_LAZY == set(publisher.__all__)
    for name in publisher.__all__:
        assert getattr(publisher, name) is not None
    with pytest.raises(AttributeError):
        publisher.NoSuchName  # noqa: B018


def test_publish_callback_is_a_trainer_callback() -> None:
    from transformers import TrainerCallback

    assert issubclass(publisher.PublishCallback, TrainerCallback)
    from publisher import PublishCallback

    assert PublishCallback is publisher.PublishCallback


def test_subscriber_ext_all_is_pinned() -> None:
    assert subscriber_ext.__all__ == SUBSCRIBER_ALL
    assert public_members(subscriber_ext) | LAZY == set(subscriber_ext.__all__)
    for name in set(subscriber_ext.__all__) - LAZY:
        assert getattr(subscriber_ext, name) is not None
    with pytest.raises(AttributeError):
        subscriber_ext.NoSuchName  # noqa: B018


def test_wire_all_is_pinned_and_shared() -> None:
    assert weightpub_wire.__all__ == WIRE_ALL
    assert public_members(weightpub_wire) == set(WIRE_ALL)
    for name in WIRE_ALL:  # the trainer side re-exports the same objects
        assert getattr(publisher, name) is getattr(weightpub_wire, name)


def test_worker_extension_path_resolves_to_the_class() -> None:
    """The public string users put in configs stays, and names the class in ``vllm_ext``."""
    module, _, name = subscriber_ext.WORKER_EXTENSION.rpartition(".")
    assert module == "subscriber_ext.worker_extension"
    assert name == "BatchWeightSyncWorkerExtension"
    import importlib

    from subscriber_ext.vllm_ext import worker_extension
    assert getattr(importlib.import_module(module), name) is \
        worker_extension.BatchWeightSyncWorkerExtension


#: one fresh interpreter for both import checks (a start imports torch: seconds of CPU):
#: what importing the three packages loaded, then what the transport side added to it
_IMPORTS = """
import json, sys
def bad(extra=()):
    return sorted(m for m in sys.modules
                  if m.split('.')[0] in ('vllm', 'transformers') or m in extra)
import weightpub_wire, publisher, subscriber_ext
packages = bad(('subscriber_ext.vllm_ext.worker_extension', 'publisher.callback'))
import subscriber_ext.transport.subscriber, subscriber_ext.transport.node.node_owner
import subscriber_ext.staleness, subscriber_ext.observe.replica_metrics
print(json.dumps({"packages": packages, "transport": bad()}))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, list[str]]:
    """The modules ``_IMPORTS`` found loaded (vLLM, transformers, the vLLM-only modules)."""
    result = subprocess.run([sys.executable, "-c", _IMPORTS], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    found: dict[str, list[str]] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def test_the_transport_side_loads_no_vllm(fresh_imports: dict[str, list[str]]) -> None:
    """A non-vLLM consumer (``WeightSubscriber``, the staleness helpers) never imports vLLM."""
    assert fresh_imports["transport"] == []


def test_all_entries_are_unique_and_errors_share_one_base() -> None:
    for names in (PUBLISHER_ALL, SUBSCRIBER_ALL, WIRE_ALL):
        assert len(names) == len(set(names))
    errors = [getattr(publisher, n) for n in PUBLISHER_ALL if n.endswith("Error")]
    errors.append(publisher.WeightPubTimeout)
    errors.append(publisher.VersionUnavailable)
    assert all(issubclass(e, publisher.WeightPubError) for e in errors)
    assert issubclass(publisher.WeightPubTimeout, TimeoutError)


def test_importing_the_packages_does_not_import_vllm_or_transformers(
        fresh_imports: dict[str, list[str]]) -> None:
    assert fresh_imports["packages"] == []
