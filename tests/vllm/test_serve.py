"""`weightpub replica` -> `vllm serve` subscribes by itself and serves each new version.

A real OpenAI-compatible server process (started from a replica YAML through
the CLI), a publisher in this process, HTTP requests with token-id prompts,
and transformers as the oracle. The replica reports staged/applied versions
to the publisher over the back-channel.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from publisher import WeightPublisher

from .helpers import free_port, hf_greedy, new_weights, save_tiny

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]
KIND = "qwen2"
PROMPT = [5, 17, 42, 99, 7, 3]
N = 6


def save_word_tokenizer(path) -> None:
    """A 512-word tokenizer ("t0".."t511") built offline: the server needs one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(
        path)


def complete(port: int, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "return_token_ids": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["choices"][0]["token_ids"]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    raise AssertionError("server did not become healthy")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One Prometheus scrape, parsed: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_metric(url: str, name: str, labels: dict[str, str], want: float,
                timeout: float = 20) -> dict:
    """Scrape until ``name{labels} == want`` (ranks refresh their status every second)."""
    key = (name, tuple(sorted(labels.items())))
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if samples.get(key) == want:
            return samples
        assert time.monotonic() < deadline, f"{key} = {samples.get(key)}, want {want}"
        time.sleep(0.25)


def test_replica_from_yaml_follows_publisher(tmp_path):
    model = tmp_path / "model"
    save_tiny(KIND, 0, model)
    save_word_tokenizer(model)
    pub_port, http_port = free_port(), free_port()
    config = tmp_path / "replica.yaml"
    config.write_text(
        "replica:\n"
        f"  model: {model}\n"
        f"  port: {http_port}\n"
        "  gpu_memory_utilization: 0.2\n"
        "  max_model_len: 256\n"
        "  extra_args: [--dtype, float32, --enforce-eager]\n"
        "  subscriber:\n"
        f"    endpoint: tcp://127.0.0.1:{pub_port}\n"
        "    request_timeout: 2.0\n"
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with WeightPublisher(f"tcp://127.0.0.1:{pub_port}") as pub:
        first = new_weights(KIND, 71)
        version = pub.publish(first)  # published before the replica exists: a late joiner
        log = open(tmp_path / "server.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "weightpub", "replica", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            wait_healthy(http_port, proc)
            pub.wait_for_subscribers(version, 1, applied=False, timeout=60)
            assert complete(http_port, str(model)) == hf_greedy(KIND, first, N)[0][0]
            reports = pub.wait_for_subscribers(version, 1, applied=True, timeout=30)
            assert reports[0].last_error is None
            second = new_weights(KIND, 72)
            version = pub.publish(second)
            # applied, not just staged (no prepare budget by default: the commit writes the
            # staged bytes into the live weights)
            pub.wait_for_subscribers(version, 1, applied=True, timeout=60)
            assert complete(http_port, str(model)) == hf_greedy(KIND, second, N)[0][0]

            # the server's own /metrics shows the replica's weights (scraped from outside)
            rank = {"rank": "0"}
            samples = wait_metric(f"http://127.0.0.1:{http_port}/metrics",
                                  "weightpub_applied_version", rank, version)
            assert samples[("weightpub_versions_behind", (("rank", "0"),))] == 0
            assert samples[("weightpub_commits_total", (("rank", "0"),))] >= 2
            received = samples[("weightpub_received_bytes_total", (("rank", "0"),))]
            assert received >= 2 * sum(t.numel() * t.element_size() for t in second.values())
            assert samples[("weightpub_transfer_seconds_count", (("rank", "0"),))] >= 2
            assert samples[("weightpub_commit_pause_seconds_count", (("rank", "0"),))] >= 2
            assert samples[("weightpub_data_path_info", (("path", "zmq"), ("rank", "0")))] == 1
            assert any(name.startswith("vllm:") for name, _ in samples), "vLLM's own metrics"
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
