"""The weightpub weight-transfer backend at TP=2: both ranks subscribe through vLLM's
``init_weight_transfer_engine`` (each rank its own slices: ``receive`` auto at TP=2),
and ``update_weights`` returns once both run the version; transformers is the oracle."""

from __future__ import annotations

import os

import pytest

from .helpers import assert_matches_hf, build_hf, new_weights, save_tiny, shut_down

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 6


def test_tp2_replica_follows_vllms_trainer_api(tmp_path) -> None:
    import torch
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightpub.vllm_trainer import LLMClient, WeightpubTrainerInitInfo

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    path = save_tiny(KIND, 0, tmp_path / "m")
    llm = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
              tensor_parallel_size=2, max_num_seqs=8, gpu_memory_utilization=0.2,
              max_model_len=256, weight_transfer_config={"backend": "weightpub"})
    model = build_hf(KIND, 0)
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightpubTrainerInitInfo(rank=0, timeout=60.0), client=LLMClient(llm),
        source=ModuleSource(model))
    try:
        for version, seed in ((1, 21), (2, 22)):
            weights = new_weights(KIND, seed)
            with torch.no_grad():
                model.load_state_dict(weights)
            trainer.send_weights()  # no wait_replicas: update_weights alone waits for both
            ranks = llm.collective_rpc("weight_status")
            assert [r["applied_version"] for r in ranks] == [version, version], ranks
            assert llm.get_weight_version() == str(version)
            assert_matches_hf(llm, KIND, weights, N)
        # a version that never comes: the error reaches the caller once, and the engine's
        # later RPCs still get their own answers (vLLM reads the ranks' replies in order
        # and stops at the first error: an error raised on both ranks left rank 1's reply
        # unread, and weight_status then got the previous call's answer)
        llm.start_weight_update()
        with pytest.raises(Exception, match="not >= 99"):
            llm.update_weights({"update_info": {"version": 99, "timeout": 0.5}})
        # the failed update ended the session on every rank alike: a new one starts
        llm.start_weight_update()
        llm.finish_weight_update()
        ranks = llm.collective_rpc("weight_status")
        assert [r["applied_version"] for r in ranks] == [2, 2], ranks
        assert [r["rank"] for r in ranks] == [0, 1], ranks
        # one subscription per rank, each fetching its own slices
        fleet = trainer.publisher.fleet()
        assert sorted(r.ranks for r in fleet) == [(0,), (1,)], fleet
        assert {r.data_path for r in fleet} == {"slices"}, fleet
    finally:
        trainer.shutdown()
        shut_down(llm)
