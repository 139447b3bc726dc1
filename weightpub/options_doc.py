"""``docs/options.md``: every option as declared, rendered (``weightpub options`` prints it).

Why generated: an option's name, type, default, bound, unit and doc are written once,
in its ``OptionSet`` (``weightpub_wire/option_set.py``); the page is that declaration
printed, and a test holds the file equal to it, so the docs cannot drift either.
"""

from __future__ import annotations

from publisher.publisher_options import PublisherOptions, ShardingOptions
from subscriber_ext.transport.client.sync_options import SyncSettings
from subscriber_ext.transport.peers.peer_options import PeerSettings
from subscriber_ext.transport.subscriber_options import SubscriberOptions
from subscriber_ext.vllm_ext.worker_options import WorkerOptions
from weightpub_wire.option_set import OptionSet

__all__ = ["render"]

HEADER = """# Options

Generated from the declarations by `python -m weightpub options > docs/options.md`
(`tests/unit/test_options.py` checks this file is current); do not edit by hand.

## Where the declarations live

Each option is declared once, as a field of an `OptionSet` (pydantic, strict, frozen;
`weightpub_wire/option_set.py`): name, type, default, bound, unit and doc. Every door
reads that declaration, so a bound is one bound and a bad value one error
(`ConfigError: request_timeout: Input should be greater than 0 (got 0)`):

- `WeightPublisher`: `PublisherOptions` in `publisher/publisher_options.py`. Doors:
  keywords (typed by `PublisherKeywords`), `options=`, the YAML `publisher:` section
  (`publisher/publisher_config.py`: the same model plus `endpoint` and `sharding`).
- `ShardedPublisher`: the publisher's options plus `ShardingOptions` (same module).
  Doors: keywords (`ShardedKeywords`), `options=` and `sharding=`, YAML
  `publisher.sharding:`.
- `WeightSubscriber`: `SubscriberOptions` in `subscriber_ext/transport/subscriber_options.py`,
  made of `SyncSettings` (`transport/client/sync_options.py`; `SyncOptions`, what the
  client runs with, adds the Python-only objects), `PeerSettings`
  (`transport/peers/peer_options.py`) and its own fields. Doors: keywords
  (`SubscriberKeywords`), `options=`, the YAML `subscriber:` section
  (`transport/subscriber_config.py`), and the worker's doors below.
- `start_weight_subscriber`: `WorkerOptions` in `subscriber_ext/vllm_ext/worker_options.py`,
  the subscriber's options plus the extension's. Doors: keywords (`WorkerKeywords`, e.g.
  through `collective_rpc`), vLLM's `init_info.options` and
  `--additional-config '{"weightpub": {...}}'` (both `WorkerOptions.from_wire`), the YAML
  `replica:` file (`apply_mode`, `node_staging`, `prepare_budget_bytes`, declared by
  `WorkerOptions` and reused in `weightpub/deployment_config.py`).

YAML may spell a byte count in a larger unit (`chunk_mib`, `collective_bucket_mib`,
`window_mib`, `max_version_gib`: the "YAML" note below); it is converted, then checked
by the same bound, and an error names the key as the file spelt it. Options marked
"Python only" (objects, and `subscriber_cls`, which names code to import) are refused
from files and from the network.
"""

SECTIONS: list[tuple[str, type[OptionSet], type[OptionSet] | None]] = [
    ("WeightPublisher (`PublisherOptions`)", PublisherOptions, None),
    ("ShardedPublisher (`ShardingOptions`, beside the publisher's)", ShardingOptions, None),
    ("WeightSubscriber: fetching (`SyncSettings`)", SyncSettings, None),
    ("WeightSubscriber: peer sharing (`PeerSettings`)", PeerSettings, None),
    ("WeightSubscriber: the rest (`SubscriberOptions`)", SubscriberOptions, SyncSettings),
    ("start_weight_subscriber: the extension's (`WorkerOptions`)", WorkerOptions,
     SubscriberOptions),
]


def render() -> str:
    """The page, from the declarations."""
    parts = [HEADER]
    for title, model, without in SECTIONS:
        skip = set(without.model_fields) if without is not None else set()
        if model is SubscriberOptions:
            skip |= set(PeerSettings.model_fields)
        rows = [row for name, row in zip(model.model_fields, model.describe(), strict=True)
                if name not in skip]
        parts.append(f"\n## {title}\n\n| option | type | default | bound | unit | what |\n"
                     "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    return "".join(parts)
