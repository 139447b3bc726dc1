"""The RL demo's task and policy: count on from a digit, checked token by token.

The prompt is ``[BOS, d]`` for a digit ``d``; the answer is the next
``ANSWER_LEN`` numbers, each the previous one plus one, modulo 10
(``7 -> 8 9 0 1``). The reward is verifiable (no model judges it) and dense: one
point per answer token that is its predecessor plus one (the first token's
predecessor is ``d``), averaged over the answer. A freshly initialised policy
samples uniformly over 16 tokens, so it starts near 1/16; the rule is a
ten-entry table, which a two-layer model learns from a few thousand samples.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = [
    "ANSWER_LEN",
    "BOS",
    "PROMPT_LEN",
    "VOCAB_SIZE",
    "policy_model",
    "sample_prompts",
    "sequence_reward",
    "token_rewards",
]

VOCAB_SIZE = 16  # tokens 0-9 are digits, 10 is BOS, 11-15 are never right
BOS = 10
DIGITS = 10
PROMPT_LEN = 2
ANSWER_LEN = 4


def policy_model(seed: int) -> Any:
    """A tiny Qwen2 (about 0.2 M parameters, fp32): 2 layers, one 64-wide head.

    64 is the smallest head size vLLM's CPU attention takes; ties are off so the
    published state dict has the same names vLLM loads.
    """
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, vocab_size=VOCAB_SIZE, max_position_embeddings=32,
        tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def sample_prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[BOS, rng.randrange(DIGITS)] for _ in range(count)]


def token_rewards(prompt: list[int], answer: list[int]) -> list[float]:
    """1.0 for each answer token that is its predecessor plus one (mod 10), else 0.0."""
    previous = prompt[-1]
    rewards = []
    for token in answer:
        rewards.append(1.0 if previous < DIGITS and token == (previous + 1) % DIGITS else 0.0)
        previous = token
    return rewards


def sequence_reward(prompt: list[int], answer: list[int]) -> float:
    rewards = token_rewards(prompt, answer)
    return sum(rewards) / len(rewards) if rewards else 0.0
