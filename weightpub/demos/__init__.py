"""Demos: the transport alone, a trainer teaching a tiny model while vLLM follows it, and
asynchronous RL (a GRPO learner and vLLM actors, ``rl*.py``)."""
