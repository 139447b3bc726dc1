"""The bench's results as rows (figure, value, baseline, ratio, target, met) and a table."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["bench_table", "summary"]

Row = dict[str, Any]


def _row(section: str, figure: str, value: str, baseline: str, ratio: float | None,
         target: str = "", met: bool | None = None) -> Row:
    return {"section": section, "figure": figure, "value": value, "baseline": baseline,
            "ratio": None if ratio is None else round(ratio, 3), "target": target, "met": met}


def summary(result: dict[str, Any]) -> list[Row]:
    """One row per headline figure; ``met`` is None where there is no target."""
    rows: list[Row] = []
    transport = result.get("transport")
    if transport:
        for p in transport["pairs"]:
            if p["scheme"] == "slices":
                rows.extend(_slice_rows(p))
                continue
            where = f"{p['mib']} MiB {p['scheme']}://"
            rows.append(_row("transport", f"{where} steady, publish -> staged",
                             f"{p['weightpub_GBps']:.2f} GB/s", f"raw TCP {p['raw_GBps']:.2f} GB/s",
                             p["ratio"], ">= 0.8", p["ratio"] >= 0.8))
            rows.append(_row("transport", f"{where} first version (cold buffers)",
                             f"{p['weightpub_seconds'][0]:.3f} s",
                             f"raw {p['raw_seconds'][0]:.3f} s", p["cold_ratio"], ">= 0.6",
                             p["cold_ratio"] >= 0.6))
            rows.append(_row("transport", f"{where} transfer only (manifest -> staged)",
                             f"{p['transfer_seconds']:.3f} s", "raw TCP", p["transfer_ratio"]))
            cpu = p.get("cpu_s_per_GB")
            if cpu:
                rows.append(_row("transport", f"{where} CPU-s per GB: publisher, subscriber",
                                 f"{cpu['publisher']:.2f}, {cpu['subscriber']:.2f}",
                                 f"raw send {cpu['raw_sender']:.2f}, "
                                 f"recv {cpu['raw_receiver']:.2f}", None))
            faults = p.get("faults_per_GB")
            if faults and "subscriber" in faults:
                rows.append(_row("transport", f"{where} page faults per GB: publisher, "
                                 "subscriber (steady / cold)",
                                 f"{faults['publisher']['steady']} / "
                                 f"{faults['publisher']['cold']}, "
                                 f"{faults['subscriber']['steady']} / "
                                 f"{faults['subscriber']['cold']}",
                                 f"raw recv {faults['raw_receiver']['steady']} / "
                                 f"{faults['raw_receiver']['cold']}", None))
            if "stream_vs_frames" in p:  # the stream path, frames and raw in one run
                frames_cpu = p["frames_cpu_s_per_GB"]
                rows.append(_row("transport", f"{where} stream vs ZeroMQ frames (same run)",
                                 f"{p['weightpub_GBps']:.2f} GB/s",
                                 f"frames {p['frames_GBps']:.2f} GB/s ({p['frames_ratio']:.2f}x "
                                 "raw)", p["stream_vs_frames"]))
                rows.append(_row("transport", f"{where} CPU-s per GB over frames: publisher, "
                                 "subscriber", f"{frames_cpu['publisher']:.2f}, "
                                 f"{frames_cpu['subscriber']:.2f}",
                                 "paths: " + ",".join(sorted(set(p["data_paths"]))), None))
            if cpu and "forwarding" in cpu:
                rows.append(_row("transport", f"{where} CPU-s per GB: forwarding peer "
                                 "(serving), its whole process, receiver fed by it",
                                 f"{cpu['forwarding'] or float('nan'):.2f}, "
                                 f"{cpu['forwarder']:.2f}, "
                                 f"{cpu['peer_receiver']:.2f}",
                                 f"{p['from_peers_fraction']:.0%} of bytes via the peer",
                                 None))
    e2e = result.get("e2e")
    if e2e:
        med, r = e2e["median_s"], e2e["ratios"]
        label = f"{e2e['model_bytes'] / 1e6:.0f} MB {e2e['dtype']}"
        rows.append(_row("e2e", f"{label}: publish -> generating, vs disk reload",
                         f"{med['weightpub']:.3f} s", f"{med['disk']:.3f} s",
                         r["weightpub/disk"], "<= 0.33", r["weightpub/disk"] <= 0.33))
        rows.append(_row("e2e", f"{label}: vs one RPC per tensor", f"{med['weightpub']:.3f} s",
                         f"{med['per_param_rpc']:.3f} s", r["weightpub/per_param_rpc"],
                         "<= 0.2", r["weightpub/per_param_rpc"] <= 0.2))
        rows.append(_row("e2e", "vLLM output == transformers (oracle)",
                         f"{e2e['oracle']['exact']}/{e2e['oracle']['runs']} exact, gap "
                         f"{e2e['oracle']['max_gap']:.3f}", f"tol {e2e['oracle']['tolerance']}",
                         None, "all", e2e["oracle"]["ok"]))
        pause = e2e["commit_pause_seconds"]["median"]
        rows.append(_row("commit pause", "step loop blocked by a commit (median)",
                         f"{pause * 1e3:.2f} ms", f"reload_weights "
                         f"{e2e['reload_weights_seconds'] * 1e3:.0f} ms",
                         r["commit_pause/reload_weights"], "<= 0.1",
                         r["commit_pause/reload_weights"] <= 0.1))
        rows.append(_row("commit pause", "layers prepared while the version arrived (median)",
                         f"{e2e['early_layers']:.0f}", f"{e2e['prepared_commits']} of "
                         f"{e2e['reps']} commits prepared", None))
    streaming = result.get("streaming")
    if streaming:
        for c in streaming["cadences"]:
            med = c["median_tokens_per_s"]
            target = c["every_s"] >= 1.0
            rows.append(_row("streaming", f"tokens/s, a version every {c['every_s']:g} s",
                             f"{med['streaming']:.0f} tok/s", f"no updates {med['quiet']:.0f}",
                             c["ratio"], ">= 0.9" if target else "",
                             (c["ratio"] >= 0.9) if target else None))
            engine = c.get("engine_pause_seconds") or {}
            stall = "" if engine.get("max") is None else \
                f", engine core {engine['max'] * 1e3:.1f} ms"
            rows.append(_row("streaming", f"  commits (prepared), every {c['every_s']:g} s",
                             f"{c['commits']} ({c['prepared_commits']}) of {c['published']}",
                             f"pause max {c['commit_pause_seconds']['max'] * 1e3:.1f} ms"
                             f"{stall}", None))
            rows.append(_row("streaming", f"  staged -> live, every {c['every_s']:g} s",
                             f"median {c['staged_to_commit_seconds']['median']:.3f} s",
                             f"max {c['staged_to_commit_seconds']['max']:.3f} s", None))
        first = streaming.get("first_busy_commit")
        if first and first.get("staged_to_commit_s") is not None:
            rows.append(_row("streaming", "first commit on a busy engine: staged -> live",
                             f"{first['staged_to_commit_s']:.3f} s",
                             f"{first.get('early_layers', 0)} layers prepared early", None))
    delta = result.get("delta")
    if delta:
        rows.append(_row("delta", f"bytes on the wire, AdamW lr {delta['lr']:g} "
                                  f"({delta['mib']} MiB bf16)",
                         "delta versions", "full versions", delta["bytes_ratio"], "<= 0.1",
                         delta["bytes_ratio"] <= 0.1))
        rows.append(_row("delta", "publish -> staged, delta vs full (loopback)",
                         "bit exact" if delta["bit_exact"] else "NOT bit exact", "",
                         delta["time_ratio"], "", delta["bit_exact"]))
    scale = result.get("scale")
    if scale:
        rows.extend(_scale_rows(scale))
    metrics = result.get("replica_metrics") or {}
    pauses = metrics.get("commit_pause_seconds")
    if pauses and pauses["count"]:
        rows.append(_row("metrics", "weightpub_commit_pause_seconds (replica /metrics)",
                         f"{pauses['count']:.0f} commits", f"mean "
                         f"{pauses['sum'] / pauses['count'] * 1e3:.2f} ms", None))
    return rows


def _slice_rows(p: dict[str, Any]) -> list[Row]:
    """A sliced subscriber over the stream vs frames, per GB of the plan's bytes (no
    target: the plan's short pieces cost scatters that raw TCP never does)."""
    where = (f"{p['mib']} MiB sliced ({p['bytes'] / (1 << 20):.0f} MiB planned, "
             f"{p['piece_bytes']} B of every {p['row_bytes']} B row)")
    cpu, frames_cpu = p["cpu_s_per_GB"], p["frames_cpu_s_per_GB"]
    return [
        _row("transport", f"{where}: stream vs ZeroMQ frames, publish -> staged",
             f"{p['weightpub_GBps']:.2f} GB/s", f"frames {p['frames_GBps']:.2f} GB/s",
             p["stream_vs_frames"]),
        _row("transport", f"{where}: CPU-s per GB planned: publisher, subscriber",
             f"stream {cpu['publisher']:.2f}, {cpu['subscriber']:.2f}",
             f"frames {frames_cpu['publisher']:.2f}, {frames_cpu['subscriber']:.2f}",
             frames_cpu["subscriber"] / cpu["subscriber"] if cpu["subscriber"] else None),
        _row("transport", f"{where}: stream vs raw TCP of the planned bytes",
             f"{p['weightpub_GBps']:.2f} GB/s", f"raw {p['raw_GBps']:.2f} GB/s "
             f"(paths: {','.join(sorted(set(p['data_paths'])))})", p["ratio"]),
    ]


def _scale_rows(scale: dict[str, Any]) -> list[Row]:
    """Peak host memory beyond the source (in versions) and GB/s per size; skipped runs."""
    rows: list[Row] = []
    targets = scale["targets"]
    for s in scale["summary"]:
        trainer, sub = s["trainer_beyond_source"], s["subscriber_beyond_source"]
        rows.append(_row("scale", f"{s['run']}: trainer peak RSS beyond its weights",
                         f"{trainer:.2f} x version", f"{s['rounds']} runs, worst", None,
                         f"<= {targets['trainer_beyond_source']}",
                         trainer <= targets["trainer_beyond_source"]))
        rows.append(_row("scale", f"{s['run']}: subscriber process peak RSS beyond start",
                         f"{sub:.2f} x version", "staging only, no vLLM", None,
                         f"<= {targets['subscriber_beyond_source']}",
                         sub <= targets["subscriber_beyond_source"]))
        if s["warm_GBps"] is not None:
            cold = "" if s["cold_GBps"] is None else f"fresh buffers {s['cold_GBps']:.2f} GB/s"
            rows.append(_row("scale", f"{s['run']}: publish -> staged (reused buffers)",
                             f"{s['warm_GBps']:.2f} GB/s", cold, None))
    ratio = scale.get("gbps_largest_over_smallest")
    if ratio:
        target = targets["gbps_largest_over_smallest"]
        rows.append(_row("scale", f"GB/s {ratio['largest']} vs {ratio['smallest']}",
                         "largest", "smallest", ratio["ratio"], f">= {target}",
                         ratio["ratio"] >= target))
    for replica in scale.get("replicas", []):
        budget = (replica.get("options") or {}).get("prepare_budget_bytes")
        label = "" if budget is None else (
            ", no prepare budget (default)" if budget == 0 else
            ", prepare budget unbounded" if budget >= 1 << 50 else
            f", prepare budget {budget / (1 << 20):.0f} MiB")
        rows.append(_row("scale", f"{replica['run']}{label}: tree peak RSS beyond start",
                         f"{replica['beyond_start']:.2f} x version",
                         f"{sum(replica['prepared'])} of {replica['versions']} prepared", None,
                         f"<= {targets['subscriber_beyond_source']}",
                         replica["beyond_start"] <= targets["subscriber_beyond_source"]))
        pauses = replica.get("commit_pause_s") or []
        if pauses:
            rows.append(_row("scale", f"{replica['run']}{label}: commit pause (median, max)",
                             f"{statistics.median(pauses) * 1e3:.1f} ms",
                             f"max {max(pauses) * 1e3:.1f} ms", None))
        rows.append(_row("scale", f"{replica['run']}: publish -> applied (after version 1)",
                         f"{replica['warm_GBps']:.2f} GB/s", "", None))
    for skipped in scale.get("skipped", []):
        rows.append(_row("scale", f"{skipped['run']}: skipped (host memory)",
                         f"needs {skipped['needs_bytes'] / (1 << 30):.1f} GiB",
                         f"{skipped['available_bytes'] / (1 << 30):.1f} GiB available", None))
    return rows


def bench_table(result: dict[str, Any]) -> Any:
    """A rich ``Table`` of ``summary(result)``."""
    from rich.table import Table

    quick = " (quick: sizes too small to mean anything)" if result.get("quick") else ""
    load = result.get("machine", {})
    table = Table(title=f"weightpub bench{quick}", caption=(
        f"{load.get('cpus')} CPUs, load average {load.get('load_avg_start', ['?'])[0]:.2f} -> "
        f"{load.get('load_avg_end', ['?'])[0]:.2f}; {result.get('wall_s', 0):.0f} s; ratios "
        "from the same run, interleaved with their baseline"))
    for column, justify in (("section", "left"), ("figure", "left"), ("value", "right"),
                            ("baseline", "right"), ("ratio", "right"), ("target", "right"),
                            ("met", "center")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in summary(result):
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: ""}[row["met"]]
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.3f}"
        table.add_row(row["section"], row["figure"], row["value"], row["baseline"], ratio,
                      row["target"], met)
    return table
