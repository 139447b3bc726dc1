"""weightpub as a backend of vLLM's own weight-transfer API (trainer side).

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from weightpub.vllm_trainer import WeightpubTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightpubTrainerInitInfo(rank=0, endpoint="tcp://127.0.0.1:5555", wait_replicas=2),
        client=LLMClient(llm),            # or HTTPVLLMWeightSyncClient(url), or None
        source=ModuleSource(model))
    engine.send_weights()                 # publish, wait for 2 replicas, then the client's
    engine.last_version                   # start / update_weights(version) / finish

Why it lives in ``weightpub`` (the application layer): it subclasses vLLM's
``TrainerWeightTransferEngine`` *and* drives ``publisher.WeightPublisher``;
``publisher`` must never import vLLM and ``subscriber_ext`` never imports
``publisher`` (``tests/test_layers.py``). Importing this module registers the
backend in vLLM's trainer factory if the plugin has not (a trainer process
need not start any vLLM engine, so the plugin may never have run there).

Push or pull: ``send_weights`` only snapshots and announces (the trainer may
train on at once); replicas pull, verify and commit on their own. ``client``
adds vLLM's control plane for *one* replica (or one server): its
``update_weights`` returns once that replica runs the version. Any number of
replicas, joining at any time, follow the same endpoint; ``wait_replicas``
counts them through the publisher's back-channel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from publisher import WeightPublisher, gather_full_tensors
from publisher.sources.vllm_sources import as_grouped
from subscriber_ext.vllm_ext.commit.vllm_plugin import BACKEND, ensure_backends
from weightpub_wire.errors import ConfigError

__all__ = ["LLMClient", "WeightpubTrainerEngine", "WeightpubTrainerInitInfo"]

logger = logging.getLogger("weightpub.trainer")


@dataclass
class WeightpubTrainerInitInfo(TrainerInitInfo):
    """The trainer side's settings (every field has a default but ``rank``).

    ``endpoint``: where rank 0's publisher binds (port 0: any free port).
    ``connect_endpoint``: what replicas are told to connect to (default: the bound
    address; set it when binding ``0.0.0.0``). ``wait_replicas``: after each
    publish, wait until that many subscribers report the version (``applied``, or
    only staged) within ``timeout`` seconds. ``init_client``: send the replica
    behind ``client`` the endpoint at ``trainer_init`` (``init_weight_transfer_engine``).
    ``publisher_options`` go to ``WeightPublisher``; ``subscriber_options`` to the
    replicas' ``start_weight_subscriber``.
    """

    backend: ClassVar[str] = BACKEND
    endpoint: str = "tcp://127.0.0.1:0"
    connect_endpoint: str | None = None
    wait_replicas: int = 0
    wait_applied: bool = True
    timeout: float = 120.0
    init_client: bool = True
    publisher_options: dict[str, Any] = field(default_factory=dict)
    subscriber_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.wait_replicas < 0:
            raise ConfigError(f"wait_replicas: {self.wait_replicas} < 0")
        if not 0 < self.timeout <= 86400:
            raise ConfigError(f"timeout: {self.timeout} is outside (0, 86400]")


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` over an in-process ``vllm.LLM``.

    Why: ``LLM``'s own methods take the *request* shapes (``{"init_info": ...}``,
    ``{"update_info": ...}``) while the protocol passes the bare infos; vLLM 0.32
    ships only HTTP and Ray clients.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class WeightpubTrainerEngine(TrainerWeightTransferEngine[WeightpubTrainerInitInfo]):
    """vLLM's trainer interface over ``WeightPublisher`` (rank 0 publishes)."""

    init_info_cls = WeightpubTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient | None,
                 source: WeightSource | None = None, is_sender: bool = True,
                 info: WeightpubTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.rank = info.rank  # vLLM 0.33's base takes it as a keyword, 0.32's not at all
        self.info = info
        self.publisher: WeightPublisher | None = None
        self.last_version = 0

    @classmethod
    def trainer_init(cls, init_info: WeightpubTrainerInitInfo, *,
                     client: VLLMWeightSyncClient | None,
                     source: WeightSource | None = None) -> Self:
        """Rank 0 binds the publisher and tells ``client``'s replica where it is."""
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     info=init_info)
        if engine.is_sender:
            engine.publisher = WeightPublisher(init_info.endpoint,
                                               **init_info.publisher_options)
            if client is not None and init_info.init_client:
                client.init_weight_transfer_engine(
                    {"endpoint": engine.replica_endpoint,
                     "options": dict(init_info.subscriber_options)})
        return engine

    @property
    def replica_endpoint(self) -> str:
        """The endpoint replicas subscribe to (``--additional-config`` / init info)."""
        if self.info.connect_endpoint:
            return self.info.connect_endpoint
        if self.publisher is None:
            raise ConfigError("only the sender (rank 0) has a publisher")
        return self.publisher.endpoint

    def send_weights(self, source: WeightSource | None = None) -> None:
        """Publish ``source`` (default: the one given at init) as the next version.

        Every rank iterates the source group by group (materializing is a collective
        for FSDP); rank 0 copies each group into one version's snapshot and drops it,
        so no rank holds more than a group beyond its shards. Then,
        if asked, wait for ``wait_replicas`` subscribers, and drive ``client``'s
        start / update_weights(version) / finish round trip.
        """
        source = source if source is not None else self.source
        if source is None:
            raise ConfigError("weightpub send_weights: no WeightSource (pass one to "
                              "trainer_init or send_weights)")
        if not self.is_sender:
            gather_full_tensors(source)  # the same per-group gathers, each dropped at once
            return
        pub = self.publisher
        assert pub is not None
        version = pub.publish(source)  # gathered, copied and dropped group by group
        count = len(as_grouped(source).metadata())
        pub.wait_announced(version, timeout=self.info.timeout)
        self.last_version = version
        if self.info.wait_replicas:
            pub.wait_for_subscribers(version, self.info.wait_replicas,
                                     applied=self.info.wait_applied, timeout=self.info.timeout)
        if self.client is not None:
            self.client.start_weight_update()
            self.client.update_weights({"version": version, "publisher_id": pub.publisher_id,
                                        "timeout": self.info.timeout})
            self.client.finish_weight_update()
        logger.info("weightpub: published version %d (%d tensors)", version, count)

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


ensure_backends()
