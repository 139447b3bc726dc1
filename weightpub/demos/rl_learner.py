"""The RL demo's learner side: rollouts tagged with versions, the staleness gate, GRPO.

A ``Rollout`` is one sampled answer with the ``VersionRange`` of the weights that
produced it (from vLLM's ``weight_versions`` spans). ``take_step_batch`` pulls
actor batches oldest first, drops every rollout more than ``max_staleness``
versions behind the learner (``subscriber_ext.keep_fresh``) and counts it, until
it has enough groups for one step. ``grpo_loss`` is GRPO with a per-token
baseline: each answer token's reward minus the mean reward of the same position
over the group's other samples, with the PPO-clipped importance ratio against
the sampler's own logprobs (the behaviour policy of a stale sample is an older
version, so the ratio is not 1).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from subscriber_ext import VersionRange, keep_fresh, version_range
from weightpub.demos import rl_messages as msg
from weightpub.demos.rl_task import token_rewards

__all__ = ["Rollout", "StalenessLedger", "grpo_loss", "rollouts_of", "take_step_batch"]


@dataclass(frozen=True, slots=True)
class Rollout:
    actor: int
    group: tuple[int, int, int]  # (actor, batch seq, prompt index): samples of one prompt
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]  # the sampler's, per token
    versions: VersionRange
    rewards: list[float]

    @property
    def reward(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0


def rollouts_of(batch: msg.Batch) -> list[Rollout]:
    out = []
    for g, group in enumerate(batch.groups):
        for sample in group.samples:
            if len(sample.logprobs) != len(sample.tokens):
                raise ValueError(f"actor {batch.actor} batch {batch.seq}: {len(sample.tokens)} "
                                 f"tokens but {len(sample.logprobs)} logprobs")
            out.append(Rollout(
                actor=batch.actor, group=(batch.actor, batch.seq, g), prompt=list(group.prompt),
                tokens=list(sample.tokens), logprobs=list(sample.logprobs),
                versions=version_range(sample.spans),
                rewards=token_rewards(group.prompt, sample.tokens)))
    return out


@dataclass
class StalenessLedger:
    """What the staleness gate saw: every rollout's staleness, kept or dropped."""

    kept: collections.Counter[int] = field(default_factory=collections.Counter)
    dropped: collections.Counter[int] = field(default_factory=collections.Counter)
    mixed: int = 0  # rollouts generated across a commit (more than one version)
    versions: set[int] = field(default_factory=set)

    def record(self, kept: Iterable[Rollout], dropped: Iterable[Rollout], current: int) -> None:
        for counter, rollouts in ((self.kept, kept), (self.dropped, dropped)):
            for r in rollouts:
                counter[r.versions.staleness(current)] += 1
                self.mixed += r.versions.mixed
                self.versions.update((r.versions.oldest, r.versions.newest))

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def seen(self) -> collections.Counter[int]:
        return self.kept + self.dropped


def take_step_batch(next_batch: Callable[[], msg.Batch], current_version: int,
                    max_staleness: int, groups_needed: int,
                    ledger: StalenessLedger) -> list[Rollout]:
    """Consume batches (``next_batch`` blocks, acks) until ``groups_needed`` groups are fresh.

    A group counts when at least two of its samples survive the gate (one sample
    alone has no group to be compared with).
    """
    kept_all: list[Rollout] = []
    groups: collections.Counter[tuple[int, int, int]] = collections.Counter()
    while sum(1 for n in groups.values() if n >= 2) < groups_needed:
        kept, dropped = keep_fresh(rollouts_of(next_batch()), current_version, max_staleness)
        ledger.record(kept, dropped, current_version)
        kept_all.extend(kept)
        groups.update(r.group for r in kept)
    return [r for r in kept_all if groups[r.group] >= 2]


def _advantages(rollouts: list[Rollout]) -> torch.Tensor:
    """Per token: reward minus the group's mean reward at that position."""
    rewards = torch.tensor([r.rewards for r in rollouts], dtype=torch.float32)
    advantages = torch.zeros_like(rewards)
    members: dict[tuple[int, int, int], list[int]] = collections.defaultdict(list)
    for i, r in enumerate(rollouts):
        members[r.group].append(i)
    for idx in members.values():
        group = rewards[idx]
        advantages[idx] = group - group.mean(0, keepdim=True)
    return advantages


def grpo_loss(model: torch.nn.Module, rollouts: list[Rollout], clip: float = 0.2,
              ) -> torch.Tensor:
    """Clipped policy-gradient loss over every answer token of ``rollouts``."""
    prompt_len = len(rollouts[0].prompt)
    if any(len(r.prompt) != prompt_len or len(r.tokens) != len(rollouts[0].tokens)
           for r in rollouts):
        raise ValueError("grpo_loss: prompts and answers must have one length each")
    sequences = torch.tensor([r.prompt + r.tokens for r in rollouts])
    answers = sequences[:, prompt_len:]
    logits = model(input_ids=sequences[:, :-1]).logits[:, prompt_len - 1:]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, answers.unsqueeze(-1)).squeeze(-1)
    behaviour = torch.tensor([r.logprobs for r in rollouts], dtype=torch.float32)
    ratio = torch.exp(logp - behaviour)
    advantages = _advantages(rollouts)
    surrogate = torch.minimum(ratio * advantages,
                              ratio.clamp(1 - clip, 1 + clip) * advantages)
    return -surrogate.mean()
