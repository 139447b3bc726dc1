"""``PublishCallback`` on a real ``transformers.Trainer``: a subscriber in another process
receives every published version, and the last one is the trained model, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from publisher import ConfigError, PublishCallback, WeightPublisher
from tests.transport.procs import Child, digests

pytestmark = pytest.mark.timeout(180)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, vocab_size=64,
                         max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def token_dataset(n: int = 16, length: int = 8) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 64, (length,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone(),
                     "attention_mask": torch.ones(length, dtype=torch.long)})
    return rows


def training_args(out: Path, max_steps: int, **extra: object) -> object:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
        learning_rate=1e-2, logging_strategy="no", save_strategy="no", report_to="none",
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0, **extra)


def staged_versions(sub: Child, last: int, timeout: float = 60.0) -> list[dict]:
    sub.event("staged", timeout, version=last)
    return [e for e in sub.events if e.get("event") == "staged"]


def test_trainer_publishes_every_n_steps_and_the_last_version_is_the_trained_model(tmp_path):
    from transformers import Trainer

    with WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) as pub:
        sub = Child("subscriber", {"endpoint": pub.endpoint}, forked=True)
        try:
            sub.event("ready", 60)
            model = tiny_model()
            initial = digests(model.state_dict().items())
            callback = PublishCallback(pub, every_n_steps=2)
            trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=5),
                              train_dataset=token_dataset(), callbacks=[callback])
            trainer.train()
            # steps 2 and 4, then the end of training (step 5)
            assert callback.published == [(2, 1), (4, 2), (5, 3)]
            seen = staged_versions(sub, last=3)
        finally:
            sub.close()
    trained = digests(trainer.model.state_dict().items())
    last = seen[-1]
    assert [e["version"] for e in seen] == sorted({e["version"] for e in seen})
    assert last["names"] == list(trained)
    assert last["dtypes"] == {k: str(v.dtype) for k, v in trainer.model.state_dict().items()}
    assert last["digests"] == trained  # bit for bit
    assert trained != initial  # the trainer did change the weights
    if seen[0]["version"] == 1:  # conflation may skip it; if it came, it was an older model
        assert seen[0]["digests"] != trained


def test_trainer_with_step_numbers_as_versions_and_no_final_publish(tmp_path):
    from transformers import Trainer

    with WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) as pub:
        callback = PublishCallback(pub, every_n_steps=3, step_as_version=True,
                                   publish_on_train_end=False)
        trainer = Trainer(model=tiny_model(), args=training_args(tmp_path, max_steps=7),
                          train_dataset=token_dataset(), callbacks=[callback])
        trainer.train()
        assert callback.published == [(3, 3), (6, 6)]
        pub.wait_announced(6, timeout=10)
        assert pub.latest_version == 6


def test_bad_arguments_name_what_is_wrong(tmp_path):
    from transformers import Trainer

    with pytest.raises(ConfigError, match="every_n_steps"):
        PublishCallback(None, every_n_steps=0)
    with pytest.raises(ConfigError, match="publisher"):
        PublishCallback("tcp://127.0.0.1:5555", every_n_steps=1)  # type: ignore[arg-type]
    trainer = Trainer(model=tiny_model(), args=training_args(tmp_path, max_steps=1),
                      train_dataset=token_dataset(), callbacks=[PublishCallback(None)])
    with pytest.raises(ConfigError, match="world process zero needs a WeightPublisher"):
        trainer.train()


def test_ranks_holding_the_whole_model_each_publish_their_share_with_sharded_publishers(
) -> None:
    """DDP (or gathered ZeRO-3): every rank holds the model whole; with a
    ``ShardedPublisher`` each rank's callback publishes the part ``owner_ranks`` gives it,
    so the union names every tensor once, at the step's version."""
    from transformers import TrainerControl, TrainerState

    from publisher import ShardedPublisher
    from subscriber_ext import WeightSubscriber

    model = tiny_model(seed=3)
    with ShardedPublisher("tcp://127.0.0.1:0", rank=0, world_size=2,
                          coordinator="tcp://127.0.0.1:0",
                          announce_endpoint="tcp://127.0.0.1:0") as rank0:
        assert rank0.coordinator is not None
        with ShardedPublisher("tcp://127.0.0.1:0", rank=1, world_size=2,
                              coordinator=rank0.coordinator.collect_endpoint) as rank1:
            sub = WeightSubscriber(rank0.coordinator.endpoint)
            try:
                for rank, pub in enumerate((rank0, rank1)):
                    state = TrainerState(is_world_process_zero=rank == 0, global_step=4)
                    callback = PublishCallback(pub, every_n_steps=2)
                    callback.on_step_end(None, state, TrainerControl(), model=model)
                    assert callback.published == [(4, 4)]
                    pub.wait_submitted(4, timeout=30)  # hashed: its manifest is out
                    assert 0 < len(pub.shard.manifest(4).tensors) < len(model.state_dict())
                staged = sub.wait_for_version(4, timeout=30)
                assert digests(staged.tensors.items()) == digests(model.state_dict().items())
                staged.release()
            finally:
                sub.close()
