"""The snapshot and its store: one host copy of a version, claimed and overwritten by chunk.

``snapshot`` (tensors -> one buffer and a manifest), ``version_store`` (the versions held and
their buffers), ``buffer_claims`` (64 KiB regions a write claims before readers see them),
``host_budget`` (what the trainer's host may hold), ``chunk_sizing`` (the default chunk).
"""
