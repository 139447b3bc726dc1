"""The weightpub trainer backend through vLLM's trainer factory, without any vLLM engine.

A real publisher, a real subscriber, vLLM's own ``ModuleSource``; rank 0 publishes,
another rank only iterates its source (as FSDP ranks must). vLLM is imported inside the
tests: at collection every xdist worker would pay its 7 s.
"""

from __future__ import annotations

import pytest
import torch

from subscriber_ext import WeightSubscriber
from weightpub_wire.errors import ConfigError


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(16, 8),
                               torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                               torch.nn.LayerNorm(8))


def test_send_weights_publishes_the_source_each_time() -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightpub.vllm_trainer import WeightpubTrainerInitInfo

    model = _model(0)
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightpubTrainerInitInfo(rank=0), client=None, source=ModuleSource(model))
    sub = WeightSubscriber(engine.replica_endpoint)
    try:
        for version, seed in ((1, 1), (2, 2)):
            model.load_state_dict(_model(seed).state_dict())
            engine.send_weights()
            assert engine.last_version == version
            staged = sub.wait_for_version(version, timeout=30)
            want = dict(model.named_parameters())
            assert sorted(staged.tensors) == sorted(want)
            for name, tensor in staged.tensors.items():
                assert torch.equal(tensor, want[name].detach()), name
    finally:
        sub.close()
        engine.shutdown()


def test_other_ranks_iterate_without_publishing_and_a_missing_source_is_named() -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightpub.vllm_trainer import WeightpubTrainerInitInfo

    walked: list[str] = []

    class Counting(ModuleSource):
        def __iter__(self):
            for name, tensor in super().__iter__():
                walked.append(name)
                yield name, tensor

    model = _model(0)
    other = WeightTransferTrainerFactory.trainer_init(
        WeightpubTrainerInitInfo(rank=1), client=None, source=Counting(model))
    assert other.publisher is None
    other.send_weights()
    assert walked == [n for n, _ in model.named_parameters()]
    assert other.last_version == 0
    with pytest.raises(ConfigError, match="only the sender"):
        other.replica_endpoint  # noqa: B018
    bare = WeightTransferTrainerFactory.trainer_init(WeightpubTrainerInitInfo(rank=1),
                                                     client=None)
    with pytest.raises(ConfigError, match="no WeightSource"):
        bare.send_weights()
    with pytest.raises(ConfigError, match="wait_replicas"):
        WeightpubTrainerInitInfo(rank=0, wait_replicas=-1)
