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


def test_stream_scratch_landing_abandoned_and_early_sums_reach_metrics(tmp_path) -> None:
    """The stream's scratch (a gauge) and landing refusals, versions given up, and the
    early-sums counts (one family, by ``what``); a worker without them: no series."""
    board = StatusBoard(tmp_path)
    board.write(0, {"rank": 0, "stream_scratch_bytes": 65536, "stream_landing_refused": 5,
                    "versions_abandoned": 2,
                    "early_sums": {"versions": 3, "replies": 4, "held": 40}})
    board.write(1, {"rank": 1})  # a worker that predates them
    text = scrape(board)
    assert 'weightpub_stream_scratch_bytes{rank="0"} 65536.0' in text
    assert 'weightpub_stream_landing_refused_total{rank="0"} 5.0' in text
    assert 'weightpub_versions_abandoned_total{rank="0"} 2.0' in text
    assert 'weightpub_early_sums_total{rank="0",what="versions"} 3.0' in text
    assert 'weightpub_early_sums_total{rank="0",what="replies"} 4.0' in text
    assert 'weightpub_early_sums_total{rank="0",what="chunks_held"} 40.0' in text
    assert 'rank="1"' not in "".join(
        line for line in text.splitlines() if line.startswith(
            ("weightpub_stream_scratch", "weightpub_stream_landing", "weightpub_versions_ab",
             "weightpub_early_sums")))
