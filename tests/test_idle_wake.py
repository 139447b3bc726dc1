"""The idle engine's wake-up (``vllm_ext.commit.idle_wake``): real Unix sockets, no vLLM.

A burst of datagrams is one wake-up until the engine took it; a sender without a
listener neither blocks nor raises; a second listener cannot steal the name; close
ends the thread.
"""

from __future__ import annotations

import queue
import secrets
import time

import pytest

from subscriber_ext.vllm_ext.commit.idle_wake import CHECK_S, WakeListener, WakeSender, wake_address

pytestmark = pytest.mark.timeout(30)


def _address() -> bytes:
    return wake_address(f"/dev/shm/weightpub-test-{secrets.token_hex(6)}")


def test_a_burst_is_one_wake_up_until_taken_then_the_next_write_wakes_again() -> None:
    woken: queue.Queue[float] = queue.Queue()
    address = _address()
    listener = WakeListener(address, lambda: woken.put(time.monotonic()))
    sender = WakeSender(address)
    try:
        for _ in range(500):
            sender.notify()
        woken.get(timeout=5)
        time.sleep(0.2)
        assert woken.empty(), "a burst must wake the engine once"
        assert listener.wakes == 1
        sender.notify()  # not re-armed yet: dropped
        time.sleep(0.2)
        assert woken.empty()
        listener.taken()  # the engine consumed the wake-up and looked
        sent = time.monotonic()
        sender.notify()
        assert woken.get(timeout=5) >= sent
        assert listener.wakes == 2
    finally:
        sender.close()
        listener.close()


def test_a_sender_without_listener_neither_blocks_nor_raises() -> None:
    sender = WakeSender(_address())
    start = time.monotonic()
    for _ in range(10_000):
        sender.notify()
    assert time.monotonic() - start < 5
    assert sender.sent == 0
    sender.close()


def test_the_name_is_taken_once_and_close_ends_the_thread() -> None:
    address = _address()
    listener = WakeListener(address, lambda: None)
    with pytest.raises(OSError):
        WakeListener(address, lambda: None)
    start = time.monotonic()
    listener.close()
    assert time.monotonic() - start <= 2 * CHECK_S + 0.5
    assert not listener._thread.is_alive()
    again = WakeListener(address, lambda: None)  # the name is free once closed
    again.close()
