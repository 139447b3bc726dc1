"""The collective backends' registry: what each backend needs, and a wrong name's error.

Both sides ask these objects instead of comparing backend names; a wrong name
(in a publisher's options or on the wire) is refused with every known name.
"""

from __future__ import annotations

import msgspec
import pytest

from publisher.collective.collective_sender import CollectiveOptions, check_options
from weightpub_wire import collective_backends
from weightpub_wire import protocol as wire
from weightpub_wire.collective_backends import (
    CollectiveBackend,
    collective_backend,
    known_backends,
    register_backend,
)
from weightpub_wire.collective_layout import BACKENDS, DATA_PATHS, CollectiveAnnounce
from weightpub_wire.errors import ConfigError, ProtocolError

pytestmark = pytest.mark.timeout(10)


def test_what_each_backend_needs() -> None:
    assert known_backends() == BACKENDS == ("gloo", "nccl", "cuda_ipc")
    assert DATA_PATHS == ("zmq", *BACKENDS)
    gloo, nccl, ipc = (collective_backend(name) for name in BACKENDS)
    assert (gloo.needs_cuda, gloo.has_group, gloo.device_group, gloo.same_gpu) == \
        (False, True, False, False)
    assert (nccl.needs_cuda, nccl.has_group, nccl.device_group, nccl.same_gpu) == \
        (True, True, True, False)
    assert (ipc.needs_cuda, ipc.has_group, ipc.device_group, ipc.same_gpu) == \
        (True, False, False, True)
    assert collective_backend("gloo") is gloo  # built once, on the first look-up
    assert str(gloo.device()) == "cpu" and str(gloo.device("cpu")) == "cpu"


def test_a_wrong_name_lists_every_known_backend() -> None:
    with pytest.raises(ConfigError) as error:
        collective_backend("mpi")
    assert str(error.value) == "unknown collective backend 'mpi' (known: gloo, nccl, cuda_ipc)"
    with pytest.raises(ConfigError, match=r"collective: unknown collective backend 'ucx' "
                                          r"\(known: gloo, nccl, cuda_ipc\); None"):
        check_options(CollectiveOptions(backend="ucx"), chunk_size=None)


def test_a_wrong_name_on_the_wire_names_the_field_and_the_known_ones() -> None:
    announce = msgspec.msgpack.encode({"backend": "mpi", "store_port": 1, "epoch": 0,
                                       "bucket_bytes": 1 << 20, "timeout": 5.0})
    with pytest.raises(msgspec.ValidationError,
                       match=r"backend: unknown collective backend 'mpi' \(known: gloo, nccl, "
                             r"cuda_ipc\)"):
        msgspec.msgpack.decode(announce, type=CollectiveAnnounce)
    poll = wire.CollectivePoll(req=1, subscriber_id="s", state="free", epoch=0,
                               backend="gloo")
    fields = msgspec.msgpack.decode(wire.encode(poll))
    bad = msgspec.msgpack.encode({**fields, "backend": "mpi"})
    with pytest.raises(ProtocolError, match=r"unknown collective backend 'mpi' \(known: "):
        wire.decode(bad)


def test_a_group_backend_needs_a_rendezvous_port_and_ipc_does_not() -> None:
    with pytest.raises(ValueError, match="store_port: gloo needs a rendezvous port"):
        CollectiveAnnounce(backend="gloo", store_port=0, epoch=0, bucket_bytes=1 << 20,
                           timeout=5.0)
    CollectiveAnnounce(backend="cuda_ipc", store_port=0, epoch=0, bucket_bytes=1 << 20,
                       timeout=5.0)


def test_a_name_is_registered_once_and_its_loader_must_build_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="'gloo' is already registered"):
        register_backend("gloo", lambda: CollectiveBackend("gloo", needs_cuda=False,
                                                           group="gloo"))
    # a registration of this test only (the registry is process-wide)
    monkeypatch.setitem(collective_backends._LOADERS, "test_misnamed",
                        lambda: CollectiveBackend("other", needs_cuda=False, group=None))
    with pytest.raises(ConfigError, match="its loader built 'other'"):
        collective_backend("test_misnamed")
