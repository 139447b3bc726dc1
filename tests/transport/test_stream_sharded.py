"""The stream path from a sharded trainer (issue 29): each rank with ``stream=True`` serves
its own shard on a plain-TCP port of its own (``ShardSource.stream_port``); a subscriber
with ``stream=True`` asks each rank for a token over its DEALER to that rank and receives
the rank's range there.

Ranks are real processes (``shard_procs.py``, forked from the zygote). What must hold:
versions come bit-exact with every rank's bytes over its stream (no rank sends a chunk
frame); a rank without the stream costs frames for its range only; a rank whose token
is refused falls back to frames for its range, counted against it; a rank killed -9
mid-stream never lets a partial version stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from subscriber_ext import WeightSubscriber
from subscriber_ext.transport.client import stream_source
from tests.transport.procs import Child, wait_until
from tests.transport.test_sharded import CHUNK, SPECS, _check, _expected, _publish, _start_ranks

pytestmark = pytest.mark.timeout(120)


def test_every_rank_streams_its_range_bit_exact(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    ranks, ready0 = _start_ranks(spawn, SPECS, stream=True)
    sub = make_sub(ready0["announce"], stream=True, request_timeout=3.0)
    for version in (1, 2):
        _publish(ranks, version)
        staged = sub.wait_for_version(version, timeout=60)
        _check(staged, _expected(version, SPECS))
        assert staged.data_path == "stream"
        shards = staged.manifest.shards
        assert shards is not None and staged.manifest.stream_port is None
        ports = [shard.stream_port for shard in shards]
        assert None not in ports and len(set(ports)) == 2  # each rank its own port
        staged.release()
    stream = sub.status()["stream"]
    assert stream["fallbacks"] == 0 and stream["rank_fallbacks"] == {}, stream
    assert stream["state"] == "up" and stream["rank_states"] == {0: "up", 1: "up"}
    assert stream["bytes_received"] == 2 * staged.manifest.total_bytes
    for rank in ranks:
        # a connection's thread counts a batch once sendmsg returns: maybe after it was staged
        wait_until(lambda rank=rank: rank.request("status")["stream"]["bytes_sent"]
                   >= 2 * rank.request("status")["shard_total"], 10, "a rank to count its sends")
        status = rank.request("status")
        assert status["bytes_sent"] == 0, status  # not one chunk frame from any rank
        assert status["stream"]["accepted"] == 1  # one connection for both versions
        assert status["stream"]["bytes_sent"] == 2 * status["shard_total"]


def test_a_rank_without_the_stream_costs_frames_for_its_range_only(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber]) -> None:
    world = len(SPECS)
    rank0 = spawn("shard_rank", rank=0, world_size=world, spec=SPECS[0], seed=20,
                  chunk_size=4096, announce_endpoint="tcp://127.0.0.1:0", stream=True)
    ready0 = rank0.event("ready", timeout=60)
    rank1 = spawn("shard_rank", rank=1, world_size=world, spec=SPECS[1], seed=20,
                  chunk_size=4096, coordinator=ready0["collect"])  # no stream here
    rank1.event("ready", timeout=60)
    sub = make_sub(ready0["announce"], stream=True, request_timeout=3.0)
    _publish([rank0, rank1], 1)
    staged = sub.wait_for_version(1, timeout=60)
    _check(staged, _expected(1, SPECS))
    assert staged.data_path == "stream+zmq"
    shards = staged.manifest.shards
    assert shards is not None and shards[1].stream_port is None
    stream = sub.status()["stream"]
    assert stream["fallbacks"] == 0 and stream["rank_states"] == {0: "up"}, stream
    assert stream["bytes_received"] == shards[0].num_chunks * staged.manifest.chunk_size
    first, second = rank0.request("status"), rank1.request("status")
    assert first["bytes_sent"] == 0 and first["stream"]["accepted"] == 1
    assert second["bytes_sent"] == second["shard_total"] and second["stream"] is None


def test_a_refused_token_falls_back_per_rank(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's token spoiled on the way: rank 1's range comes as frames, counted against
    rank 1; rank 0's still streams."""
    present = stream_source.StreamPicker.present
    spoiled: list[bool] = []

    def spoil_second(self: stream_source.StreamPicker, token: bytes) -> bytes:
        spoiled.append(True)
        return bytes(b ^ 0x5A for b in token) if len(spoiled) == 2 else present(self, token)

    monkeypatch.setattr(stream_source.StreamPicker, "present", spoil_second)
    ranks, ready0 = _start_ranks(spawn, SPECS, stream=True)
    sub = make_sub(ready0["announce"], stream=True, request_timeout=3.0)
    _publish(ranks, 1)
    staged = sub.wait_for_version(1, timeout=60)
    _check(staged, _expected(1, SPECS))
    assert staged.data_path == "stream+zmq"
    stream = sub.status()["stream"]
    assert stream["fallback_causes"] == {"refused": 1}, stream
    statuses = [rank.request("status") for rank in ranks]
    refused = [rank for rank, status in enumerate(statuses) if status["stream"]["refused"]]
    assert len(refused) == 1 and stream["rank_fallbacks"] == {refused[0]: 1}, stream
    assert f"trainer rank {refused[0]}" in stream["last_error"]
    other = 1 - refused[0]
    assert statuses[refused[0]]["bytes_sent"] == statuses[refused[0]]["shard_total"]
    assert statuses[other]["bytes_sent"] == 0 and statuses[other]["stream"]["accepted"] == 1


def test_a_rank_killed_mid_stream_never_stages_a_partial_version(
        spawn: Callable[..., Child], make_sub: Callable[..., WeightSubscriber],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 killed -9 while its range streams in: its stream falls back (counted against
    rank 1), its frames cannot come either, and the version is given up whole; the last
    complete version stays the latest."""
    big = [SPECS[0], [("layers.1.w", "float32", (512, 256))]]  # rank 1: 128 chunks
    ranks, ready0 = _start_ranks(spawn, big, stream=True)
    staged: list[int] = []
    sub = make_sub(ready0["announce"], stream=True, request_timeout=1.0, max_chunk_retries=1,
                   window_bytes=2 * CHUNK, on_version=lambda s: staged.append(s.version))
    _publish(ranks, 1)
    _check(sub.wait_for_version(1, timeout=30), _expected(1, big))
    assert sub.status()["stream"]["fallbacks"] == 0

    read = stream_source.StreamSource._read

    def paced(self: stream_source.StreamSource) -> None:
        time.sleep(0.05)  # a chunk or so per look: the kill lands mid-version
        read(self)

    monkeypatch.setattr(stream_source, "_READ_BUDGET", CHUNK)
    monkeypatch.setattr(stream_source.StreamSource, "_read", paced)
    client = sub._client
    _publish(ranks, 2)
    wait_until(lambda: client.target is not None and client.target.manifest.version == 2
               and len(client.target.missing) < client.target.manifest.num_chunks - 8,
               30, "version 2 partly streamed in")
    ranks[1].kill9()
    wait_until(lambda: 1 in sub.status()["stream"]["rank_fallbacks"], 30,
               "rank 1's dead stream noticed")
    wait_until(lambda: client.target is None, 30, "version 2 given up")
    stream = sub.status()["stream"]
    assert set(stream["fallback_causes"]) <= {"closed", "timeout"}, stream
    assert "trainer rank 1" in stream["last_error"]
    assert staged == [1]  # never a partial version
    assert sub.latest() is not None and sub.latest().version == 1  # type: ignore[union-attr]
