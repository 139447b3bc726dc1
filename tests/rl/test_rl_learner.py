"""The RL demo's learner pieces without engines: reward, messages, the staleness gate, GRPO."""

from __future__ import annotations

import msgspec
import pytest
import torch

from weightpub.demos import rl_messages as msg
from weightpub.demos.rl_learner import StalenessLedger, grpo_loss, rollouts_of, take_step_batch
from weightpub.demos.rl_task import BOS, policy_model, sequence_reward, token_rewards


def test_reward_counts_each_token_that_counts_on() -> None:
    assert token_rewards([BOS, 7], [8, 9, 0, 1]) == [1.0, 1.0, 1.0, 1.0]
    assert token_rewards([BOS, 7], [8, 8, 9, 12]) == [1.0, 0.0, 1.0, 0.0]
    assert token_rewards([BOS, 3], [12, 13, 14, 15]) == [0.0, 0.0, 0.0, 0.0]  # not digits
    assert sequence_reward([BOS, 0], [1, 2, 5, 6]) == 0.75


def batch(actor: int, seq: int, versions: list[str], *, group_size: int = 2) -> msg.Batch:
    """One group per entry of ``versions``, every sample generated under that label."""
    groups = [msg.Group(prompt=[BOS, 1],
                        samples=[msg.Sample(tokens=[2, 3, 4, 5], logprobs=[-1.0] * 4,
                                            spans=[(v, 0, 4)]) for _ in range(group_size)])
              for v in versions]
    return msg.Batch(actor=actor, seq=seq, groups=groups, generate_s=0.01, idle_s=0.0)


def test_messages_roundtrip_and_bounds() -> None:
    b = batch(0, 3, ["default", "4"])
    assert msg.decode(msg.encode(b)) == b
    huge = msgspec.msgpack.encode({"type": "batch", "actor": 0, "seq": 0, "generate_s": 0.0,
                                   "idle_s": 0.0, "groups": [{"prompt": [1], "samples": []}] * 65})
    with pytest.raises(msgspec.ValidationError, match="groups"):
        msg.decode(huge)


def test_gate_drops_stale_rollouts_and_waits_for_enough_fresh_groups() -> None:
    feed = [batch(0, 0, ["3", "3"]),            # staleness 2 at version 5: dropped
            batch(1, 0, ["4", "5"]),            # staleness 1 and 0: kept
            batch(0, 1, ["default", "5"])]      # version 0: dropped; 5 kept
    taken: list[msg.Batch] = []

    def next_batch() -> msg.Batch:
        taken.append(feed.pop(0))
        return taken[-1]

    ledger = StalenessLedger()
    rollouts = take_step_batch(next_batch, current_version=5, max_staleness=1,
                               groups_needed=3, ledger=ledger)
    assert len(taken) == 3  # needed the third batch for the third fresh group
    assert len(rollouts) == 6 and {r.versions.oldest for r in rollouts} == {4, 5}
    assert ledger.kept == {1: 2, 0: 4}
    assert ledger.dropped == {2: 4, 5: 2} and ledger.dropped_total == 6
    assert ledger.versions == {0, 3, 4, 5}


def test_a_lone_survivor_of_a_group_is_not_trained_on() -> None:
    mixed = msg.Group(prompt=[BOS, 1], samples=[
        msg.Sample(tokens=[2, 3, 4, 5], logprobs=[-1.0] * 4, spans=[("1", 0, 4)]),
        msg.Sample(tokens=[2, 3, 4, 7], logprobs=[-1.0] * 4, spans=[("2", 0, 4)]),
        msg.Sample(tokens=[2, 3, 4, 6], logprobs=[-1.0] * 4, spans=[("1", 0, 2), ("2", 2, 4)]),
    ])
    feed = [msg.Batch(actor=0, seq=0, groups=[mixed], generate_s=0.0, idle_s=0.0),
            batch(0, 1, ["2"])]
    ledger = StalenessLedger()
    rollouts = take_step_batch(lambda: feed.pop(0), 2, 0, 1, ledger)
    assert [r.group for r in rollouts] == [(0, 1, 0), (0, 1, 0)]
    assert ledger.kept == {0: 3} and ledger.dropped == {1: 2}  # one of the first group survived
    assert ledger.mixed == 1  # the answer sampled by versions 1 and 2


def test_grpo_pushes_the_policy_toward_better_answers() -> None:
    torch.manual_seed(0)
    model = policy_model(seed=0)
    good, bad = [2, 3, 4, 5], [9, 9, 9, 9]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([[BOS, 1] + good[:-1]])).logits,
                                 -1)[0, 1:].gather(-1, torch.tensor(good).unsqueeze(-1))
    group = msg.Group(prompt=[BOS, 1], samples=[
        msg.Sample(tokens=good, logprobs=logp.squeeze(-1).tolist(), spans=[("0", 0, 4)]),
        msg.Sample(tokens=bad, logprobs=[-3.0] * 4, spans=[("0", 0, 4)])])
    rollouts = rollouts_of(msg.Batch(actor=0, seq=0, groups=[group], generate_s=0, idle_s=0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def logprob_of(tokens: list[int]) -> float:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[BOS, 1] + tokens[:-1]])).logits[0, 1:]
            return float(torch.log_softmax(out, -1).gather(-1, torch.tensor(tokens)[:, None]).sum())

    before = logprob_of(good)
    for _ in range(3):
        loss = grpo_loss(model, rollouts)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert logprob_of(good) > before + 0.1


def test_bad_demo_options_are_refused_before_anything_starts(capsys) -> None:
    from weightpub.cli import main

    assert main(["demo", "--rl", "--steps", "0"]) == 2
    assert "steps: 0 must be >= 1" in capsys.readouterr().err
    assert main(["demo", "--rl", "--max-staleness", "-1"]) == 2
    assert "max_staleness" in capsys.readouterr().err


def test_an_actor_that_cannot_start_is_reported_with_its_error(tmp_path) -> None:
    """A real actor process that cannot load the model (it says so before importing
    vLLM): the learner names it, and the actor's error."""
    from weightpub.demos.rl_pool import ActorPool
    from weightpub_wire.errors import WeightPubError

    with ActorPool(1, model_dir=tmp_path / "no-such-model", publisher="tcp://127.0.0.1:1",
                   log_dir=tmp_path, seed=0, prompts_per_batch=1, group_size=2,
                   credit=1) as pool:
        pool.start()
        with pytest.raises(WeightPubError, match="actor0 (failed|exited)") as info:
            pool.wait_ready(timeout=120)
    assert "no-such-model" in str(info.value)
