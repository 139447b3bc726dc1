"""The subscriber's YAML section (``subscriber:`` inside replica and relay files).

It is ``SubscriberOptions`` itself (each option declared once there, with its bound)
plus the file's own key, ``endpoint``. Sizes may be given in the file's units:
``window_mib`` (``window_bytes``), ``max_version_gib`` (``max_version_bytes``).
"""

from __future__ import annotations

from pydantic import field_validator

from subscriber_ext.transport.subscriber_options import SubscriberOptions
from weightpub_wire.config_file import check_endpoint
from weightpub_wire.option_set import YamlSection

__all__ = ["SubscriberConfig"]


class SubscriberConfig(YamlSection, SubscriberOptions):
    """Inference side transport options: ``SubscriberOptions`` and where to subscribe."""

    endpoint: str

    _endpoint = field_validator("endpoint")(check_endpoint)

    def subscriber_options(self) -> SubscriberOptions:
        """The ``WeightSubscriber``'s options (the endpoint is passed beside them)."""
        return SubscriberOptions(**self.given(SubscriberOptions.model_fields))
