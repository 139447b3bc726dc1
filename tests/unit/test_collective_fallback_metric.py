"""The replica's /metrics counts collective-path fallbacks per cause (issue 22.1)."""

from __future__ import annotations

from subscriber_ext.observe.status_board import StatusBoard
from tests.unit.scrape import scrape


def test_fallbacks_are_a_counter_with_a_cause_label(tmp_path) -> None:
    board = StatusBoard(tmp_path)
    board.write(0, {"rank": 0, "collective_fallbacks": {"join_timeout": 2, "checksum": 1}})
    board.write(1, {"rank": 1, "collective_fallbacks": {}})  # a follower: its owner counts
    text = scrape(board)
    assert 'weightpub_collective_fallbacks_total{cause="join_timeout",rank="0"} 2.0' in text
    assert 'weightpub_collective_fallbacks_total{cause="checksum",rank="0"} 1.0' in text
    assert 'rank="1"' not in "".join(line for line in text.splitlines()
                                     if line.startswith("weightpub_collective_fallbacks"))


def test_nixl_fallbacks_are_a_counter_with_a_cause_label(tmp_path) -> None:
    """Issue 31: versions offered over NIXL but fetched over ZeroMQ, by cause."""
    board = StatusBoard(tmp_path)
    board.write(0, {"rank": 0, "nixl_fallbacks": {"transfer": 1, "off": 3},
                    "data_path": "nixl+zmq"})
    text = scrape(board)
    assert 'weightpub_nixl_fallbacks_total{cause="transfer",rank="0"} 1.0' in text
    assert 'weightpub_nixl_fallbacks_total{cause="off",rank="0"} 3.0' in text
    assert 'weightpub_data_path_info{path="nixl+zmq",rank="0"} 1.0' in text


def test_stream_fallbacks_are_a_counter_with_a_cause_label(tmp_path) -> None:
    """Issue 29: chunks offered on the stream port but fetched over ZeroMQ, by cause."""
    board = StatusBoard(tmp_path)
    board.write(0, {"rank": 0, "stream_fallbacks": {"refused": 2, "checksum": 1},
                    "data_path": "stream+zmq", "received_bytes": 4096,
                    "stream_received_bytes": 3072})
    board.write(1, {"rank": 1})  # a worker that predates the counter: no series
    text = scrape(board)
    assert 'weightpub_stream_received_bytes_total{rank="0"} 3072.0' in text
    assert 'weightpub_stream_received_bytes_total{rank="1"}' not in text
    assert 'weightpub_stream_fallbacks_total{cause="refused",rank="0"} 2.0' in text
    assert 'weightpub_stream_fallbacks_total{cause="checksum",rank="0"} 1.0' in text
    assert 'weightpub_data_path_info{path="stream+zmq",rank="0"} 1.0' in text
