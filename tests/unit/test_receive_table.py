"""A replica's receive table: one row per rank, what each pulled of its applied version (issue 30).

The rows are built from the dicts the ranks report (``weight_status()`` / the status
board), so the shapes here are those of a ``SliceReceiver`` and a node-staging
owner and follower; the collector turns the rows into /metrics gauges.
"""

from __future__ import annotations

from subscriber_ext.observe.receive_table import rank_receive, receive_table
from subscriber_ext.observe.status_board import StatusBoard
from subscriber_ext.vllm_ext.llm import replica_status
from subscriber_ext.vllm_ext.receive_choice import ReceiveChoice
from tests.unit.scrape import scrape

CHOICE = ReceiveChoice("slices", "auto", 0.54, {}, 0.12).status()


def _sliced(rank: int, received: int, version: int = 3) -> dict:
    return {
        "slices": {"label": f"tp2/rank{rank}", "needed_fraction": 0.5312},
        "slice_plan": {"fallbacks": {"busy": 1}},
        "applied_received": {"version": version, "received_bytes": received,
                             "version_bytes": 1000, "fraction": received / 1000,
                             "by_source": {"publisher": received - 100, "nixl": 100,
                                           "peers": 0}},
    }


def test_a_ranks_row_keeps_the_choice_and_adds_what_it_pulled() -> None:
    row = rank_receive(1, CHOICE, _sliced(1, 540))
    for key, value in CHOICE.items():  # the keys users read already, unchanged
        assert row[key] == value
    assert row["rank"] == 1 and row["planned_fraction"] == 0.5312  # the current plan
    assert row["received"]["fraction"] == 0.54 and row["received"]["version"] == 3
    assert row["sources"] == ["nixl", "publisher"]  # kinds that brought bytes
    assert row["fetch_fallbacks"] == {"busy": 1} and row["via_rank"] is None
    empty = rank_receive(0, None, None)  # before the subscriber started
    assert empty["received"] is None and empty["sources"] == [] and empty["rank"] == 0


def test_node_staging_counts_the_node_once_at_its_owner() -> None:
    node = ReceiveChoice("node", "a rank needs 0.95x of a version").status()
    owner = {"applied_received": {"version": 4, "received_bytes": 1000, "version_bytes": 1000,
                                  "fraction": 1.0, "by_source": {"publisher": 1000}},
             "node_staging": {"role": "owner", "rank": 0}}
    follower = {**owner, "node_staging": {"role": "follower", "rank": 1, "owner_rank": 0}}
    rows = [rank_receive(1, node, follower), rank_receive(0, node, owner)]
    assert rows[0]["received"] is None and rows[0]["via_rank"] == 0
    table = receive_table(rows)
    assert [r["rank"] for r in table["ranks"]] == [0, 1]
    assert table["modes"] == {"node": 2}
    assert table["version"] == 4 and table["received_fraction"] == 1.0


def test_the_replica_table_adds_up_the_newest_version_and_skips_stale_ranks() -> None:
    rows = [rank_receive(0, CHOICE, _sliced(0, 530)), rank_receive(1, CHOICE, _sliced(1, 560)),
            rank_receive(2, CHOICE, _sliced(2, 900, version=2)), None]
    table = receive_table(rows)
    assert table["version"] == 3 and table["received_fraction"] == 1.09  # 0.53 + 0.56
    assert table["modes"] == {"slices": 3} and len(table["ranks"]) == 3


def test_replica_status_asks_every_rank_and_builds_the_table() -> None:
    class FakeLLM:  # what replica_status needs of an ``LLM``: collective_rpc
        def collective_rpc(self, method: str) -> list[dict]:
            assert method == "weight_status"
            return [{"rank": r, "applied_version": 3,
                     "receive": rank_receive(r, CHOICE, _sliced(r, 500 + 10 * r))}
                    for r in (1, 0)]

    status = replica_status(FakeLLM())
    assert status["applied_version"] == 3 and len(status["ranks"]) == 2
    assert [r["rank"] for r in status["receive"]["ranks"]] == [0, 1]
    assert status["receive"]["received_fraction"] == 1.01


def test_metrics_show_each_ranks_mode_plan_and_share(tmp_path) -> None:
    board = StatusBoard(tmp_path)
    board.write(0, {"rank": 0, "receive": rank_receive(0, CHOICE, _sliced(0, 530))})
    board.write(1, {"rank": 1, "receive": {"mode": "rank", "planned_fraction": None,
                                           "received": None}})
    board.write(2, {"rank": 2, "receive": "garbage"})  # a bad file never breaks a scrape
    text = scrape(board)
    assert 'weightpub_receive_mode_info{mode="slices",rank="0"} 1.0' in text
    assert 'weightpub_receive_mode_info{mode="rank",rank="1"} 1.0' in text
    assert 'weightpub_receive_planned_fraction{rank="0"} 0.5312' in text
    assert 'weightpub_received_fraction{rank="0"} 0.53' in text
    assert 'weightpub_received_fraction{rank="1"}' not in text
