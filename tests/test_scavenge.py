"""The scavenging rules (training/config/scavenge.py): settings, slots, window, outcomes, records."""

from __future__ import annotations

import json

import pytest

from tests.helpers import small_config
from training.config import scavenge as rules
from training.config.experiment import ConfigError, check_same_settings, join_islands, parse_config

WIN = {"opens_at": 1000.0, "closes_at": 1600.0}


def test_settings_reject_a_bad_prefix_and_unknown_keys_in_one_line():
    with pytest.raises(ConfigError, match="name_prefix: .*uppercase"):
        rules.parse_scavenge_config({"name_prefix": "Scav"})
    with pytest.raises(ConfigError, match="window_minutes"):
        rules.parse_scavenge_config({"window_minutes": 0})
    with pytest.raises(ConfigError, match="colour"):
        rules.parse_scavenge_config({"colour": "red"})


def test_slots_are_numbered_names_of_the_prefix():
    assert rules.slot_names("scav", 3) == ["scav-0", "scav-1", "scav-2"]


@pytest.mark.parametrize(
    "name, expected",
    [("scav-0", True), ("scav-12", True), ("scav-01", False), ("scav-a", False), ("scav", False)],
)
def test_is_slot(name, expected):
    assert rules.is_slot(name, "scav") is expected


def test_cloud_islands_get_the_capacity_flag_local_ones_nothing():
    tpu = rules.parse_scavenge_config(
        {"backend": "tpu_vm", "capacity": "preemptible", "hardware": {"spot": True, "zone": "z"}}
    )
    assert rules.hardware_for(tpu) == {"zone": "z", "preemptible": True}
    spot = rules.parse_scavenge_config({"backend": "tpu_vm"})
    assert rules.hardware_for(spot) == {"spot": True}
    local = rules.parse_scavenge_config({"backend": "local", "capacity": "spot"})
    assert rules.hardware_for(local) == {}


def test_join_params_ask_for_the_stored_experiment_with_only_the_slots_added():
    """What the scavenge DAG hands `init_experiment` passes its join rule unchanged."""
    from diloco_airflow.params import config_from_params

    stored = json.loads(small_config("run", data={"num_shards": 4}).to_json())
    cfg = rules.parse_scavenge_config({"experiment": "run", "islands": 2})
    wanted = json.loads(
        config_from_params(rules.join_params(stored, rules.scavenged_islands(cfg))).to_json()
    )
    check_same_settings(stored, wanted)  # no ConfigError: the same experiment
    joined = parse_config(join_islands(stored, wanted["islands"]))
    assert [i.name for i in joined.islands] == ["a", "b", "scav-0", "scav-1"]
    assert [joined.shard_of(n) for n in ("scav-0", "scav-1")] == [2, 3]
    # the next window asks for the same slots again: a no-op join
    assert join_islands(joined.model_dump(mode="json"), wanted["islands"]) == json.loads(
        joined.to_json()
    )


def test_the_window_opens_at_the_run_start_and_closes_after_its_minutes():
    cfg = rules.parse_scavenge_config({"window_minutes": 10})
    win = rules.window(1000.0, cfg)
    assert win == WIN
    assert [rules.window_open(t, win) for t in (999.9, 1000.0, 1599.9, 1600.0)] == [
        False,
        True,
        True,
        False,
    ]


@pytest.mark.parametrize(
    "has_config, stop, done, running",
    [
        (False, False, [], False),
        (True, True, [], False),
        (True, False, ["a", "b"], False),  # every island of its own is done
        (True, False, ["a", "scav-0"], True),
        (True, False, ["scav-0"], True),
    ],
)
def test_experiment_running(has_config, stop, done, running):
    got, why = rules.experiment_running(has_config, stop, ["a", "b", "scav-0"], done, "scav")
    assert got is running, why


@pytest.mark.parametrize(
    "state, done, now, outcome",
    [
        ("RUNNING", True, 1700.0, "finished"),  # done wins, even past the window
        ("RUNNING", False, 1600.0, "window closed"),
        ("PROVISIONING", False, 1600.0, "window closed"),
        ("PREEMPTED", False, 1200.0, "reclaimed"),
        ("GONE", False, 1200.0, "reclaimed"),
        ("SUCCEEDED", False, 1200.0, "reclaimed"),  # exited after SIGTERM, no done marker
        ("FAILED", False, 1200.0, None),  # a crash: the wait's retry relaunches it
        ("RUNNING", False, 1200.0, None),
        ("PROVISIONING", False, 1200.0, None),
    ],
)
def test_watch_outcome(state, done, now, outcome):
    assert rules.watch_outcome(state, done, now, WIN["closes_at"]) == outcome


def test_leave_reason_is_the_waits_outcome_else_what_is_seen_now_else_failed():
    assert rules.leave_reason("reclaimed", False, "RUNNING", 1700.0, 1600.0) == "reclaimed"
    assert rules.leave_reason(None, False, "RUNNING", 1700.0, 1600.0) == "window closed"
    assert rules.leave_reason(None, False, "FAILED", 1200.0, 1600.0) == "failed"


def test_only_a_running_island_that_is_not_done_is_waited_for_on_leaving():
    assert rules.needs_stop_wait("RUNNING", False)
    assert not rules.needs_stop_wait("RUNNING", True)
    assert not rules.needs_stop_wait("PREEMPTED", False)


def test_view_of_joins_and_leaves_counts_windows_and_ignores_junk():
    records = [
        rules.join_record("scav-0", "local", WIN, "r1", 1001.0),
        rules.leave_record("scav-0", "window closed", True, WIN, "r1", 1601.0),
        rules.join_record("scav-0", "local", WIN, "r2", 2001.0),
        {"event": "leave", "island": "never-joined", "reason": "failed"},
        {"event": "join", "island": "../x"},
        {"event": "party", "island": "scav-1"},
    ]
    view = rules.scavenge_view(records)
    assert set(view) == {"scav-0"}
    assert view["scav-0"]["state"] == "joined" and view["scav-0"]["windows"] == 2
    view = rules.scavenge_view(records[:2])
    assert view["scav-0"] | {} == {
        "state": "left",
        "joined_at": 1001.0,
        "left_at": 1601.0,
        "reason": "window closed",
        "clean": True,
        "closes_at": 1600.0,
        "windows": 1,
    }


def test_a_leave_record_needs_a_known_reason():
    with pytest.raises(ValueError, match="unknown leave reason"):
        rules.leave_record("scav-0", "bored", True, WIN, "r", 1.0)
