"""Demos: the transport alone, and a trainer teaching a tiny model while vLLM follows it."""
