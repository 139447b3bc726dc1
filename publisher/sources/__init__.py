"""Where a version's tensors come from: plain tensors, FSDP/DTensor shards, vLLM weight sources.

Read one layer group at a time, so no process holds more than a group beyond its snapshot.
"""
