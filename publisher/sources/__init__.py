"""Where a version's tensors come from: plain tensors, FSDP/DTensor shards, vLLM weight sources.

Read one layer group at a time, so no process holds more than a group beyond its snapshot.
Bottom up: ``layer_grouping`` (the groups), ``shard_owners`` (which rank keeps a tensor),
``owner_gather`` (a tensor whole to its owner only), ``streamed_plan`` (the layout from
global shapes and the pass over the groups), ``streamed_copy`` (into the snapshot).
"""
