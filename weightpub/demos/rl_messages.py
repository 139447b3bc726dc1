"""What the RL demo's actors and learner say to each other (msgpack over ZeroMQ).

::

    actor DEALER -> learner ROUTER   [ {t: "ready" | "batch" | "failed", ...} ]
    learner ROUTER -> actor DEALER   [ b"ack" ]    one batch consumed: one more credit
                                   | [ b"stop" ]   finish now

An actor may have ``credit`` batches that the learner has not consumed yet; it
keeps generating while it has credit (never waiting for weights: the engine
switches to each new version between two steps), and waits only when the
learner is that far behind. Lists are bounded while decoding, so a confused
peer cannot make the learner allocate without limit.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

__all__ = ["ACK", "STOP", "Batch", "Failed", "Group", "Ready", "Sample", "decode", "encode"]

ACK = b"ack"
STOP = b"stop"

Tokens = Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 31)]], Meta(max_length=256)]
Span = tuple[Annotated[str, Meta(max_length=32)], Annotated[int, Meta(ge=0)],
             Annotated[int, Meta(ge=0)]]


class Sample(msgspec.Struct, frozen=True):
    """One completion: its tokens, the sampler's logprob of each, and the version spans."""

    tokens: Tokens
    logprobs: Annotated[list[float], Meta(max_length=256)]
    spans: Annotated[list[Span], Meta(max_length=256)]  # vLLM's (version, start, end)


class Group(msgspec.Struct, frozen=True):
    """The completions of one prompt (GRPO compares them with each other)."""

    prompt: Tokens
    samples: Annotated[list[Sample], Meta(max_length=64)]


class Ready(msgspec.Struct, tag="ready", frozen=True):
    actor: int
    pid: int


class Batch(msgspec.Struct, tag="batch", frozen=True):
    actor: int
    seq: int
    groups: Annotated[list[Group], Meta(max_length=64)]
    generate_s: float  # spent in llm.generate for this batch
    idle_s: float  # spent out of credit since the previous batch


class Failed(msgspec.Struct, tag="failed", frozen=True):
    actor: int
    error: Annotated[str, Meta(max_length=4096)]


ActorMessage = Ready | Batch | Failed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ActorMessage)


def encode(message: ActorMessage) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> ActorMessage:
    """Raises ``msgspec.ValidationError`` / ``DecodeError`` naming the bad field."""
    return _decoder.decode(frame)
