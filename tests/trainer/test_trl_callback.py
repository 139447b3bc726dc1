"""``PublishCallback`` in a TRL trainer (``SFTTrainer``): one line, same guarantees."""

from __future__ import annotations

import pytest

from publisher import PublishCallback, WeightPublisher
from tests.trainer.test_publish_callback import tiny_model
from tests.transport.procs import Child, digests

pytestmark = pytest.mark.timeout(180)


def word_tokenizer() -> object:
    """A 64-word tokenizer built in memory (w0..w59 and four specials): no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(60)} | {"[UNK]": 60, "[PAD]": 61, "[EOS]": 62, "[BOS]": 63}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]",
                                   pad_token="[PAD]", eos_token="[EOS]", bos_token="[BOS]")


def test_sft_trainer_publishes_and_the_subscriber_gets_the_trained_model(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    texts = [" ".join(f"w{(i * 7 + j) % 60}" for j in range(8)) for i in range(16)]
    with WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2) as pub:
        sub = Child("subscriber", {"endpoint": pub.endpoint}, forked=True)
        try:
            sub.event("ready", 60)
            callback = PublishCallback(pub, every_n_steps=2)
            args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                             learning_rate=1e-2, logging_strategy="no", save_strategy="no",
                             report_to="none", use_cpu=True, disable_tqdm=True, max_length=16)
            trainer = SFTTrainer(model=tiny_model(), args=args,
                                 train_dataset=Dataset.from_dict({"text": texts}),
                                 processing_class=word_tokenizer(), callbacks=[callback])
            trainer.train()
            assert callback.published == [(2, 1), (3, 2)]
            last = sub.event("staged", 60, version=2)
        finally:
            sub.close()
    assert last["digests"] == digests(trainer.model.state_dict().items())
