"""LoRA adapter versions at the replica: served by name (``served.py``) or merged into
the base weights (``merged.py``); ``adapter_request`` names a published adapter in a
request."""

from subscriber_ext.vllm_ext.lora.adapter_versions import AdapterVersion, adapter_version
from subscriber_ext.vllm_ext.lora.requests import PLACEHOLDER_SCHEME, adapter_request

__all__ = ["PLACEHOLDER_SCHEME", "AdapterVersion", "adapter_request", "adapter_version"]
