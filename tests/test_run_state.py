"""Finished, stopped and running told apart (issue 24 item 6): control/STOP records who wrote it,
and `diloco list`, `diloco status` and the page read the state from that one rule
(`ExperimentStore.run_state`, `RUN_STATES`)."""

from __future__ import annotations

from tests.helpers import new_store, publish_delta, random_delta, small_config
from training.merge.merger import Merger
from training.views.report import format_list
from training.views.status import STATE_NOTE


def test_an_experiment_without_a_stop_marker_is_running():
    store = new_store(small_config())
    assert store.stop_reason() is None and store.run_state() == "running"


def test_a_stop_a_person_asks_for_reads_stopped():
    store = new_store(small_config())
    store.request_stop()  # `diloco stop` and the page's button: the default reason
    assert store.run_state() == "stopped"


def test_the_merge_that_reaches_the_budget_marks_the_experiment_finished():
    # two contributions of 512 tokens each (publish_delta's default) to the one fragment: the
    # version's tokens_merged is 1,024 = the budget, so the merger writes control/STOP itself
    cfg = small_config(token_budget=1024)
    store = new_store(cfg)
    theta = store.load_params()
    publish_delta(store, cfg, "a", 0, random_delta(theta, 0))
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1))
    Merger(cfg, store).merge_once()
    assert store.stop_reason() == "budget" and store.run_state() == "finished"


def test_a_stop_marker_that_names_no_known_reason_counts_as_a_persons_stop():
    store = new_store(small_config())
    store.write_json(store.STOP, {"at": 1.0, "reason": "because"})
    assert store.run_state() == "stopped"


def test_a_stop_marker_that_is_not_json_still_stops_and_reads_stopped():
    store = new_store(small_config())
    store.store.write(store.object_key(store.STOP), b"\xff not json")
    assert store.stop_requested() and store.run_state() == "stopped"


def test_diloco_list_shows_each_state():
    rows = [
        dict(experiment=n, versions=[3], tokens_merged=10, token_budget=10, islands=2,
             islands_done=2, best_loss=None, stop_requested=s != "running", state=s)
        for n, s in (("r", "running"), ("f", "finished"), ("s", "stopped"))
    ]  # fmt: skip
    states = [line.split()[-1] for line in format_list(rows).splitlines()[2:]]
    assert states == ["running", "finished", "stopped"]


def test_diloco_status_says_finished_not_stop_requested():
    assert "FINISHED" in STATE_NOTE["finished"] and "STOP" not in STATE_NOTE["finished"]
