"""The ``publisher:`` YAML section: the trainer side's options, validated at load.

It is ``PublisherOptions`` itself (each option declared once there, with its bound)
plus the file's own keys: ``endpoint`` and the ``sharding:`` section
(``ShardingOptions``). Sizes may be given in MiB: ``chunk_mib`` (``chunk_size``; 0:
chosen per version), ``collective_bucket_mib`` (``collective_bucket_bytes``).
"""

from __future__ import annotations

import os
from typing import Any, Self

from pydantic import ValidationError, field_validator, model_validator

from publisher.publisher_options import PublisherOptions, ShardingOptions
from weightpub_wire.config_file import check_endpoint, load_yaml_as
from weightpub_wire.option_set import YamlSection

__all__ = ["PublisherConfig", "ShardingConfig", "load_publisher_config"]


class ShardingConfig(YamlSection, ShardingOptions):
    """A sharded trainer (``ShardedPublisher.from_config``): every rank reads the same file,
    so ``announce_endpoint`` is required here (rank 0 uses it)."""

    @model_validator(mode="wrap")
    @classmethod
    def _announce_endpoint_given(cls, body: Any, handler: Any) -> Self:
        config = handler(body)
        if config.announce_endpoint is None:
            raise ValidationError.from_exception_data(cls.__name__, [
                {"type": "missing", "loc": ("announce_endpoint",), "input": body}])
        return config

    def options(self, rank: int) -> ShardingOptions:
        """This rank's sharding options (only rank 0 announces)."""
        given = self.given(ShardingOptions.model_fields)
        if rank != 0:
            given["announce_endpoint"] = None
        return ShardingOptions(**given)


class PublisherConfig(YamlSection, PublisherOptions):
    """Trainer side: where to serve, and the publisher's options."""

    endpoint: str
    # every trainer rank publishes its own shard (ShardedPublisher.from_config; None: off)
    sharding: ShardingConfig | None = None

    _endpoint = field_validator("endpoint")(check_endpoint)

    def options(self) -> PublisherOptions:
        """The ``WeightPublisher``'s options (the endpoint is passed beside them)."""
        return PublisherOptions(**self.given(PublisherOptions.model_fields))


def load_publisher_config(path: str | os.PathLike[str]) -> PublisherConfig:
    """Read a file whose top-level key is ``publisher:``."""
    return load_yaml_as(path, "publisher", PublisherConfig)
