"""Process helpers for the transport tests: deterministic weights and child processes.

Weights are derived from ``(seed, version, name)`` by a cheap integer hash, so
any process can recompute the exact bytes a publisher sent. Children speak JSON
lines: commands on stdin, events on stdout (logging goes to stderr, a file).

Run as ``python -m tests.transport.procs publisher|subscriber|node_rank|peer|shard_rank
'<json args>'``.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import torch
import xxhash

from weightpub_wire import chunk_frame
from weightpub_wire.dtypes import DTYPE_BY_NAME, itemsize

REPO = Path(__file__).resolve().parents[2]
Spec = list[tuple[str, str, tuple[int, ...]]]  # (name, dtype name, shape)

class InlineChunks:
    """For a test proxy that reads a publisher's replies: a chunk whose payload follows its
    header (protocol 4, ``chunk_frame.FOLLOWS``) comes out as one inline frame, so the
    proxy can look at (or spoil) header and payload together; subscribers take both forms.
    One per upstream socket."""

    def __init__(self) -> None:
        self.due: chunk_frame.ChunkHeader | None = None

    def feed(self, frames: list[bytes]) -> list[bytes] | None:
        """The message to forward, or None while a header waits for its payload."""
        if self.due is not None:
            header, self.due = self.due, None
            return [bytes(chunk_frame.build(req=header.req, version=header.version,
                                            chunk=header.chunk, payload=frames[0]))]
        if len(frames) == 1 and chunk_frame.is_chunk(frames[0]):
            header = chunk_frame.parse(frames[0])
            if header.follows:
                self.due = header
                return None
        return frames


# -- deterministic bytes ------------------------------------------------------------------------
_MUL1 = 6364136223846793005
_MUL2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed int64


def det_bytes(key: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` pseudo-random bytes (flat uint8) that depend only on ``key``."""
    words = -(-nbytes // 8)
    x = torch.arange(words, dtype=torch.int64)
    x.mul_(_MUL1).add_(key % (1 << 62))
    x.bitwise_xor_(x >> 29)
    x.mul_(_MUL2)
    x.bitwise_xor_(x >> 32)
    raw = x.view(torch.uint8)
    return raw if words * 8 == nbytes else raw[:nbytes].clone()  # no copy when whole words


def det_tensor(seed: int, version: int, name: str, dtype: torch.dtype,
               shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor whose bytes depend only on (seed, version, name)."""
    key = seed * 1_000_003 + version * 7_919 + zlib.crc32(name.encode())
    numel = 1
    for dim in shape:
        numel *= dim
    raw = det_bytes(key, numel * itemsize(dtype))
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def det_weights(seed: int, version: int, spec: Spec) -> dict[str, torch.Tensor]:
    return {name: det_tensor(seed, version, name, DTYPE_BY_NAME[dtype], tuple(shape))
            for name, dtype, shape in spec}


def drift_weights(seed: int, version: int, spec: Spec, *, per_mille: int = 20
                  ) -> dict[str, torch.Tensor]:
    """Weights that drift like RL steps: version 0's bytes, then each step ``k <= version``
    flips the low bit of the lowest byte of about ``per_mille``/1000 of the elements
    (bool elements stay 0/1). Consecutive versions differ in few, scattered elements."""
    weights = det_weights(seed, 0, spec)
    for name, tensor in weights.items():
        numel, size = tensor.numel(), tensor.element_size()
        if not numel:
            continue
        low = tensor.reshape(-1).view(torch.uint8).view(numel, size)[:, 0]  # little endian
        for step in range(1, version + 1):
            key = seed * 31 + step * 1_000_003 + zlib.crc32(name.encode())
            picked = det_bytes(key, numel * 2).view(torch.int16).to(torch.int32) & 1023
            low[picked < per_mille * 1024 // 1000] ^= 1
    return weights


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor as a flat uint8 tensor (works for 0-d and empty)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def digest(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(as_bytes(tensor).numpy())


def digests(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: digest(t) for name, t in tensors}


def spec_bytes(spec: Spec) -> int:
    total = 0
    for _, dtype, shape in spec:
        numel = 1
        for dim in shape:
            numel *= dim
        total += numel * itemsize(DTYPE_BY_NAME[dtype])
    return total


# -- the odd-shapes / every-dtype round trip case ------------------------------------------------
ROUNDTRIP_SEED = 424242


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def roundtrip_case(version: int) -> tuple[Any, dict[str, torch.Tensor], list[torch.Tensor]]:
    """(what to pass to ``publish()``, the tensors the subscriber must get, the source tensors).

    v1: a mapping with every wire dtype and odd shapes (0-d, empty, 5-d, transposed and
    strided views); v2: a ``torch.nn.Module``; v3: a generator of (name, tensor) pairs.
    """
    seed = ROUNDTRIP_SEED
    if version == 1:
        source: dict[str, torch.Tensor] = {}
        for i, (name, dtype) in enumerate(sorted(DTYPE_BY_NAME.items())):
            shape = ((3, 5, 7), (), (0, 7), (2, 1, 3, 1, 2), (13,))[i % 5]
            source[f"dtype.{name}"] = det_tensor(seed, version, name, dtype, shape)
        source["odd.scalar"] = det_tensor(seed, version, "s", torch.float64, ())
        source["odd.empty"] = det_tensor(seed, version, "e", torch.bfloat16, (0, 7))
        source["odd.five_d"] = det_tensor(seed, version, "5", torch.int16, (2, 3, 1, 4, 5))
        base = det_tensor(seed, version, "t", torch.float32, (7, 5))
        source["odd.transposed"] = base.t()  # non-contiguous view
        wide = det_tensor(seed, version, "w", torch.float16, (4, 9))
        source["odd.strided"] = wide[:, ::2]  # non-contiguous, with gaps
        source["odd.offset"] = wide[1:, 3:]  # non-contiguous, with a storage offset
        expected = {k: v.contiguous().clone() for k, v in source.items()}
        return source, expected, list(source.values())
    if version == 2:
        torch.manual_seed(seed)
        net = TinyNet()
        with torch.no_grad():
            net.steps.fill_(12345)
        expected = {k: v.detach().clone() for k, v in net.state_dict().items()}
        return net, expected, list(net.state_dict().values())
    if version == 3:
        pairs = [(f"pair.{i}", det_tensor(seed, version, str(i), torch.float32, (i, 3)))
                 for i in range(4)]
        expected = {k: v.clone() for k, v in pairs}
        return (p for p in pairs), expected, [t for _, t in pairs]
    raise ValueError(version)


@torch.no_grad()
def scribble(tensors: Iterable[torch.Tensor]) -> None:
    """Overwrite every byte of the tensors' storages in place (the trainer moves on)."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            torch.empty(0, dtype=torch.uint8).set_(storage).fill_(0xA5)


# -- small utilities -----------------------------------------------------------------------------
_PORTS = random.SystemRandom()  # from the OS: processes (forked ones too) pick apart


def free_port() -> int:
    """A TCP port that was free a moment ago (for tests that must reuse one endpoint),
    below the kernel's ephemeral range: no port-0 bind and no outgoing connect of another
    process takes it while a killed publisher's successor is about to bind it again (the
    fault matrix's parallel cases did, 1 run in 8, once their stream ports and
    connections came in)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(1000):
        port = _PORTS.randrange(max(1024, low - 12_000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


def pace_replies(client: Any, seconds: float) -> None:
    """Slow a ``SyncClient`` to one DEALER message per ``seconds`` (so a kill or a fault
    lands mid-transfer).

    The sleep comes before a message is read, never between its frames, so a test
    slows the transfer without holding a multipart reply half read (the libzmq abort
    on a half-read reply came from ``IMMEDIATE``, see ``weightpub_wire/monitored_dealer.py``).
    """
    receive = client.on_dealer

    def paced() -> None:
        time.sleep(seconds)
        receive()

    client.on_dealer = paced


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# -- child processes -----------------------------------------------------------------------------
class Child:
    """A helper process speaking JSON lines; every wait has a timeout."""

    def __init__(self, role: str, args: dict[str, Any], *, forked: bool = False,
                 repo: Path | None = None) -> None:
        """``forked``: from the zygote that has torch imported (``zygote.py``, milliseconds
        instead of an interpreter start), still a process of its own. ``repo``: run
        another tree's code (an older release, ``test_early_sums``; not forked)."""
        self.role = role
        self._stderr = tempfile.TemporaryFile()
        if forked:
            from tests.transport.zygote import forked_child

            self.proc: Any = forked_child(role, args, self._stderr)
        else:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            tree = REPO if repo is None else repo
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree),
                                                              env.get("PYTHONPATH")]))
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.transport.procs", role, json.dumps(args)],
                cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self._stderr, text=True, bufsize=1,
            )
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._eof = False
        self._exit_sent = False
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"test-{role}-reader")
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": "noise", "line": line}
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def stderr_tail(self, limit: int = 4000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-limit:]

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def expect(self, predicate: Callable[[dict[str, Any]], bool], timeout: float,
               what: str = "an event") -> dict[str, Any]:
        """The first event (seen so far or later) that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    state = "exited" if self._eof else "timed out"
                    raise AssertionError(
                        f"{self.role} {state} waiting for {what} (rc={self.proc.poll()}); "
                        f"events: {self.events[-5:]}\nstderr:\n{self.stderr_tail()}"
                    )
                self._cond.wait(min(left, 0.5))

    def event(self, name: str, timeout: float, **match: Any) -> dict[str, Any]:
        return self.expect(
            lambda e: e.get("event") == name and all(e.get(k) == v for k, v in match.items()),
            timeout, f"{name} {match}",
        )

    def request(self, name: str, timeout: float = 30.0, **command: Any) -> dict[str, Any]:
        """Send a command with a fresh id and wait for its reply event."""
        rid = f"{time.monotonic_ns()}"
        self.send(cmd=name, id=rid, **command)
        return self.expect(lambda e: e.get("id") == rid, timeout, f"reply to {name}")

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def ask_to_exit(self) -> None:
        """Send ``exit`` without waiting: children asked together shut down side by side
        (a subscriber's close takes seconds); ``close`` then waits for each."""
        if self.proc.poll() is None and not self._exit_sent:
            try:
                self.send(cmd="exit")
            except OSError:
                pass  # it is going already; close() reaps (or kills) it
            self._exit_sent = True

    def close(self, timeout: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            try:
                if not self._exit_sent:
                    self.send(cmd="exit")
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        self._stderr.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        return self.proc.returncode


# -- child side ----------------------------------------------------------------------------------
def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _commands() -> queue.Queue[dict[str, Any]]:
    """Read JSON-line commands from stdin on a thread; EOF means exit."""
    commands: queue.Queue[dict[str, Any]] = queue.Queue()

    def pump() -> None:
        for line in sys.stdin:
            if line.strip():
                commands.put(json.loads(line))
        commands.put({"cmd": "exit"})

    threading.Thread(target=pump, daemon=True, name="stdin").start()
    return commands


def run_publisher(args: dict[str, Any]) -> None:
    """A publisher publishing ``det_weights(seed, version, spec)`` on command."""
    from publisher import WeightPublisher

    pub = WeightPublisher(args["endpoint"], chunk_size=args.get("chunk_size", 1 << 20),
                          heartbeat_interval=args.get("heartbeat_interval", 0.2),
                          model_id=args.get("model_id", "test"),
                          metrics_port=args.get("metrics_port"),
                          delta_anchor_every=args.get("delta_anchor_every", 1),
                          nixl=bool(args.get("nixl", False)),
                          stream=bool(args.get("stream", False)),
                          announce_early=bool(args.get("announce_early", False)))
    if args.get("sums_gate"):
        gate = args["sums_gate"]
        held_sums(pub, lambda: os.path.exists(gate))
    if args.get("nixl_fault"):
        nixl_fault(pub, args["nixl_fault"])
    if args.get("stream_fault"):
        stream_fault(pub, args["stream_fault"])
    _emit(event="ready", endpoint=pub.endpoint, publisher_id=pub.publisher_id, pid=os.getpid(),
          metrics_url=pub.metrics.url if pub.metrics is not None else None)
    commands = _commands()
    seed = args["seed"]
    while True:
        command = commands.get(timeout=600)
        cmd = command.get("cmd")
        if cmd == "exit":
            break
        if cmd == "publish":
            version = command["version"]
            make = drift_weights if command.get("drift") else det_weights
            weights = make(seed, version, command["spec"])
            pub.publish(weights, version=version)
            del weights
            pub.wait_announced(version, timeout=60)
            delta = pub.manifest(version).delta
            _emit(event="published", id=command.get("id"), version=version,
                  publisher_id=pub.publisher_id,
                  delta_chain=None if delta is None else [b.version for b in delta.chain])
        elif cmd == "stats":
            _emit(event="stats", id=command.get("id"), stats=pub.data_stats(),
                  nixl=pub.nixl_status(), stream=pub.stream_status())
        elif cmd == "fleet":
            _emit(event="fleet", id=command.get("id"),
                  reports=[msgspec.to_builtins(r) for r in pub.fleet()])
    pub.close()
    _emit(event="closed")


def nixl_fault(pub: Any, fault: str) -> None:
    """Test-only faults of a publisher's NIXL offers (``tests/transport/test_nixl_path.py``):
    ``corrupt:<chunk>``: offers a registered copy of each version with one byte of that
    chunk flipped after hashing (ZeroMQ frames still serve the real bytes), with
    ``corrupt+claims:<chunk>`` also claims words that show no reuse; ``lie``:
    offers that name another agent than their metadata's; ``short``: a region one byte
    shorter than the version."""
    import numpy

    from weightpub_wire.nixl_link import NixlClaims, NixlOffer, NixlRegion

    export = pub._nixl
    real_offer = export.offer
    shadows: list[torch.Tensor] = []

    def corrupted(buffer: torch.Tensor, total: int, chunk: int, version: int | None = None
                  ) -> Any:
        snapshot = pub._last_snapshot[1]
        deadline = time.monotonic() + 30
        while snapshot.copied_bytes < total and time.monotonic() < deadline:
            time.sleep(0.01)  # the copy may still run while the hashes are done
        shadow = buffer[:total].clone()
        shadow[chunk * pub.chunk_size] ^= 0xFF
        shadows.append(shadow)  # alive (and registered) for the process's life
        exporter = export._exporter
        exporter.register(shadow.data_ptr(), total)
        words = None
        if version is not None:  # claims words saying the shadow holds this version only
            from publisher.store.buffer_claims import REGION

            held = numpy.full(-(-total // REGION), version, dtype="<i8")
            shadows.append(torch.from_numpy(held))
            exporter.register(held.ctypes.data, held.nbytes)
            words = NixlClaims(held.ctypes.data, held.nbytes, REGION, version)
        return exporter.offer([NixlRegion(shadow.data_ptr(), total)], claims=words)

    def offer(buffer: torch.Tensor, total: int, **claims: Any) -> Any:
        if fault.startswith("corrupt:"):  # no claims: the shadow is never reused
            return corrupted(buffer, total, int(fault.split(":")[1]))
        if fault.startswith("corrupt+claims:"):  # claims words that show no reuse
            return corrupted(buffer, total, int(fault.split(":")[1]), claims["version"])
        made = real_offer(buffer, total, **claims)
        if fault == "lie" and made is not None:
            return NixlOffer("someone-else", made.metadata, made.regions, made.mem_type)
        if fault == "short" and made is not None:
            region = made.regions[0]
            return NixlOffer(made.agent, made.metadata,
                             [NixlRegion(region.address, region.length - 1)], made.mem_type)
        return made

    export.offer = offer


def held_sums(pub: Any, opened: Callable[[], bool]) -> None:
    """Test-only (``test_early_sums``): an early version's sums leave the publisher only
    once ``opened()`` (its ``chunk_sums`` replies and the complete manifest; 60 s at
    most), so every byte of it lands before any of its sums, whatever the hashing."""
    from publisher.version_preparer import EarlyHooks

    serving = pub._server.sum_serving
    answer = serving._answer
    serving._answer = lambda identity, request: opened() and answer(identity, request)
    hooks = pub._preparer._early

    def complete(number: int, snapshot: Any, sums: tuple[int, ...]) -> None:
        deadline = time.monotonic() + 60
        while not opened() and time.monotonic() < deadline:
            time.sleep(0.01)
        hooks.complete(number, snapshot, sums)

    pub._preparer._early = EarlyHooks(hooks.announce, complete)


def stream_fault(pub: Any, fault: str) -> None:
    """Test-only faults of a publisher's stream port (``tests/transport/test_stream_path.py``):
    ``corrupt:<chunk>``: that chunk goes out on the stream with one byte flipped (a copy;
    ZeroMQ frames still serve the real bytes), whole or as slices (its first byte: a
    slice's bytes are read out of ``chunk_bytes`` too); ``old``: the stream of a publisher
    from before slices (``tests/transport/test_stream_slices.py``)."""
    server = pub._stream
    if fault == "old":
        server.serves_slices = False
        return
    real = server.chunk_bytes
    bad = int(fault.split(":")[1])

    def chunk_bytes(version: Any, chunk: int) -> memoryview:
        data = real(version, chunk)
        if chunk != bad:
            return data
        spoiled = bytearray(data)
        spoiled[0] ^= 0xFF
        return memoryview(spoiled)

    server.chunk_bytes = chunk_bytes


def pace_stream(budget: int) -> None:
    """This process's stream sources read at most ``budget`` bytes per look, one look per
    0.2 s: a version of a few MiB takes seconds, so a kill lands mid-receive."""
    from subscriber_ext.transport.client import stream_source

    read = stream_source.StreamSource._read

    def paced(self: Any) -> None:
        time.sleep(0.2)
        read(self)

    stream_source._READ_BUDGET = budget
    stream_source.StreamSource._read = paced  # type: ignore[method-assign]


def run_subscriber(args: dict[str, Any]) -> None:
    """A subscriber reporting every staged version (digests per tensor) as a JSON line."""
    from subscriber_ext import SyncOptions, WeightSubscriber
    from weightpub_wire.protocol import Limits

    options = dict(args.get("options", {}))
    if "limits" in options:
        options["limits"] = Limits(**options["limits"])
    if args.get("pace_stream"):
        pace_stream(int(args["pace_stream"]))
    staged_q: queue.Queue[Any] = queue.Queue()
    sub = WeightSubscriber(args["endpoint"], options=SyncOptions(**options),
                           on_version=staged_q.put)
    _emit(event="ready", subscriber_id=sub.subscriber_id, pid=os.getpid())
    commands = _commands()
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            command = None
        if command is not None:
            if command.get("cmd") == "exit":
                break
            if command.get("cmd") == "status":
                _emit(event="status", id=command.get("id"), status=sub.status())
        try:
            staged = staged_q.get(timeout=0.05)
        except queue.Empty:
            continue
        event: dict[str, Any] = {
            "event": "staged", "version": staged.version, "publisher_id": staged.publisher_id,
            "total_bytes": staged.total_bytes, "names": list(staged.tensors),
            "shapes": {k: list(v.shape) for k, v in staged.tensors.items()},
            "dtypes": {k: str(v.dtype) for k, v in staged.tensors.items()},
            "digests": digests(staged.items()),
        }
        if args.get("verify") == "roundtrip":
            _, expected, _ = roundtrip_case(staged.version)
            event["mismatches"] = sorted(
                name for name, want in expected.items()
                if name not in staged.tensors
                or staged.tensors[name].dtype != want.dtype
                or staged.tensors[name].shape != want.shape
                or not torch.equal(as_bytes(staged.tensors[name]), as_bytes(want))
            ) + sorted(set(staged.tensors) - set(expected))
        if args.get("verify") == "drift":
            want = digests(drift_weights(args["seed"], staged.version, args["spec"]).items())
            event["mismatches"] = sorted(k for k in set(want) | set(event["digests"])
                                         if want.get(k) != event["digests"].get(k))
        if args.get("mark_applied"):
            sub.mark_applied(staged.version)
        _emit(**event)
    sub.close()
    _emit(event="closed")


def main() -> None:
    torch.set_num_threads(1)
    role, raw = sys.argv[1], sys.argv[2]
    args = json.loads(raw)
    if role == "node_rank":
        from tests.transport.node_procs import run_node_rank

        run_node_rank(args)
        return
    if role == "peer":
        from tests.transport.peer_procs import run_peer

        run_peer(args)
        return
    if role == "relay":
        from tests.transport.relay_procs import run_relay

        run_relay(args)
        return
    if role == "shard_rank":
        from tests.transport.shard_procs import run_shard_rank

        run_shard_rank(args)
        return
    {"publisher": run_publisher, "subscriber": run_subscriber}[role](args)


if __name__ == "__main__":
    main()
