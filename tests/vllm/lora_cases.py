"""LoRA adapters for the vLLM tests: PEFT-named tensors, their spec, the oracle's merged
weights (``W + alpha/r * B @ A``), greedy generation with an adapter by name."""

from __future__ import annotations

import torch

from publisher.adapters import AdapterSpec
from subscriber_ext.vllm_ext.lora import adapter_request

from .helpers import PROMPTS, build_hf

KIND = "qwen2"
N = 6
RANK = 8
ALPHA = 16.0
TARGETS = ("q_proj", "v_proj", "down_proj")


def lora_tensors(seed: int, layers: int = 2) -> dict[str, torch.Tensor]:
    """A PEFT-named adapter (as ``save_pretrained`` names it) strong enough to change
    the tiny model's greedy tokens."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (128, 128), "self_attn.v_proj": (64, 128),
              "mlp.down_proj": (128, 256)}
    out = {}
    for layer in range(layers):
        for module, (rows, cols) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(RANK, cols, generator=gen) * 0.3
            out[f"{prefix}.lora_B.weight"] = torch.randn(rows, RANK, generator=gen) * 0.3
    return out


def spec(name: str) -> AdapterSpec:
    return AdapterSpec.from_peft(name, {"r": RANK, "lora_alpha": ALPHA,
                                        "target_modules": list(TARGETS)})


BASE = {k: v.contiguous() for k, v in build_hf(KIND, 0).state_dict().items()}


def merged(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(BASE)
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        weight = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        out[weight] = BASE[weight] + (ALPHA / RANK) * (b @ a)
    return out


def generate(llm, name: str | None, n: int = N, prompts: list | None = None) -> list:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True)
    prompts = PROMPTS if prompts is None else prompts
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                       lora_request=None if name is None else adapter_request(name))
    out = []
    for r in res:
        o = r.outputs[0]
        toks = list(o.token_ids)
        out.append((toks, [float(o.logprobs[i][t].logprob) for i, t in enumerate(toks)]))
    return out


#: teacher-forced sequences: every position after the first is scored
SEQUENCES = [[(i * 37 + 5 * j) % 500 + 1 for i in range(24)] for j in range(1, 4)]


@torch.no_grad()
def hf_forced(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> list[list[float]]:
    """transformers' logprob of each next token of ``SEQUENCES`` with ``weights`` in
    ``dtype``."""
    model = build_hf(KIND, 0)
    model.load_state_dict(weights)
    model = model.to(dtype)
    out = []
    for seq in SEQUENCES:
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
        out.append([float(lp[i, seq[i + 1]]) for i in range(len(seq) - 1)])
    return out


def vllm_forced(llm, name: str | None) -> list[list[float]]:
    """vLLM's prompt logprobs of ``SEQUENCES`` (the same positions as ``hf_forced``)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    res = llm.generate([{"prompt_token_ids": s} for s in SEQUENCES], sp, use_tqdm=False,
                       lora_request=None if name is None else adapter_request(name))
    return [[float(r.prompt_logprobs[i + 1][seq[i + 1]].logprob) for i in range(len(seq) - 1)]
            for r, seq in zip(res, SEQUENCES, strict=True)]


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(gaps(a, b))


def mean_gap(a: list[list[float]], b: list[list[float]]) -> float:
    found = gaps(a, b)
    return sum(found) / len(found)


def gaps(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
