"""The syncer's objects in the store's layout: lease and run-marker names (golden), their strict
records, and what the syncer does with a lease that is not one (takes it as a free one)."""

from __future__ import annotations

import pytest

from tests.helpers import FakeClock, new_store, small_config
from training.merge.syncer import ShardLease, ShardView
from training.store import keys
from training.store.syncer_records import (
    BadLease,
    BadRunMarker,
    Lease,
    lease_record,
    parse_lease,
    parse_run_marker,
    run_marker_record,
)

RUN = "manual__2026-01-01T00:00:00+00:00"


# -- names ------------------------------------------------------------------------------------
def test_lease_and_run_marker_names_are_golden():
    assert keys.lease_key(0) == "control/syncer/shard-0.json"
    assert keys.lease_key(12) == "control/syncer/shard-12.json"
    assert (
        keys.run_marker_key(RUN) == "control/runs/manual__2026-01-01T00_00_00_00_00-33e279c4.json"
    )
    assert keys.run_marker_key("run-1") == "control/runs/run-1-bc3f1728.json"
    assert keys.run_marker_key("") == "control/runs/run-da39a3ee.json"
    assert keys.run_marker_key("x" * 100) == f"control/runs/{'x' * 80}-50e48369.json"


def test_lease_and_run_marker_names_parse_back_and_nothing_else_does():
    assert keys.parse_key(keys.lease_key(7)) == keys.ObjectName("syncer-lease", shard=7)
    for run_id in (RUN, "run-1", "", "é", "x" * 100):
        assert keys.parse_key(keys.run_marker_key(run_id)).kind == "run-marker"
    for junk in (
        "control/syncer/shard-007.json",  # leading zeros: not the name the builder makes
        "control/syncer/shard-1000.json",
        "control/syncer/shard-x.json",
        "control/runs/run-1-BC3F1728.json",
        "control/runs/run-1.json",
        f"control/runs/{'x' * 81}-50e48369.json",
    ):
        with pytest.raises(keys.BadName):
            keys.parse_key(junk)
    with pytest.raises(keys.BadName):
        keys.lease_key(1000)
    with pytest.raises(keys.BadName):
        keys.run_marker_key(b"run-1")
    with pytest.raises(keys.BadName):
        keys.run_marker_key("\ud800")


# -- records ----------------------------------------------------------------------------------
def test_the_records_are_the_bytes_the_syncer_always_wrote():
    assert lease_record(Lease("r1", 1030.0, "h/1")) == (
        b'{"owner": "r1", "expires_at": 1030.0, "holder": "h/1"}'
    )
    assert run_marker_record("run-1", 5.0, ["a", "b"]) == (
        b'{"ended_at": 5.0, "islands": ["a", "b"], "run_id": "run-1"}'
    )
    assert parse_lease(lease_record(Lease("r1", 0.0, "h/1"))) == Lease("r1", 0.0, "h/1")
    marker = parse_run_marker(run_marker_record("run-1", 5.0, ["a", "b"]), "run-1")
    assert (marker.run_id, marker.ended_at, marker.islands) == ("run-1", 5.0, ("a", "b"))


HOSTILE_LEASES = {
    "not json": b"\xff{",
    "not an object": b'["r1", 1030.0, "h"]',
    "owner not a string": b'{"owner": 3, "expires_at": 1e30, "holder": "h"}',
    "expires_at a string": b'{"owner": "r1", "expires_at": "soon", "holder": "h"}',
    "expires_at a bool": b'{"owner": "r1", "expires_at": true, "holder": "h"}',
    "expires_at negative": b'{"owner": "r1", "expires_at": -1.0, "holder": "h"}',
    "holder not a string": b'{"owner": "r1", "expires_at": 1030.0, "holder": ["h"]}',
    "extra field": b'{"owner": "r1", "expires_at": 1030.0, "holder": "h", "x": 1}',
    "missing holder": b'{"owner": "r1", "expires_at": 1030.0}',
    "NaN": b'{"owner": "r1", "expires_at": NaN, "holder": "h"}',
    "Infinity": b'{"owner": "r1", "expires_at": Infinity, "holder": "h"}',
    "overflowing float": b'{"owner": "r1", "expires_at": 1e999, "holder": "h"}',
    "huge int": b'{"owner": "r1", "expires_at": 1' + b"0" * 40 + b', "holder": "h"}',
    "long owner": b'{"owner": "' + b"r" * 251 + b'", "expires_at": 1.0, "holder": "h"}',
    "huge": b'{"owner": "r1", "expires_at": 1.0, "holder": "' + b"h" * 5000 + b'"}',
    "nested": b'{"owner": {"a": 1}, "expires_at": 1.0, "holder": "h"}',
    "duplicate key": b'{"owner": "r1", "owner": "r2", "expires_at": 1.0, "holder": "h"}',
}


@pytest.mark.parametrize("case", list(HOSTILE_LEASES))
def test_a_hostile_lease_is_refused_with_one_line(case):
    with pytest.raises(BadLease) as refused:
        parse_lease(HOSTILE_LEASES[case])
    assert "\n" not in str(refused.value) and len(str(refused.value)) <= 300


@pytest.mark.parametrize("case", list(HOSTILE_LEASES))
def test_the_syncer_takes_a_hostile_lease_as_a_free_one(case):
    """As before the strict reader: a lease that is not one is free; taken by CAS over it."""
    store, clock = new_store(small_config()), FakeClock(1000.0)
    key = f"{store.experiment}/{keys.lease_key(0)}"
    store.store.write(key, HOSTILE_LEASES[case])
    assert ShardView(store, 0).lease() is None
    other = ShardLease(store, 0, "r2", 30, clock)
    other.release()  # not its lease: left as it is
    assert store.store.read(key) == HOSTILE_LEASES[case]
    assert ShardLease(store, 0, "r1", 30, clock).acquire()
    assert parse_lease(store.store.read(key)).owner == "r1"
    assert not other.acquire()


def test_a_lease_object_too_large_to_read_is_deleted_and_the_lease_taken():
    store, clock = new_store(small_config()), FakeClock(1000.0)
    key = f"{store.experiment}/{keys.lease_key(1)}"
    store.store.write(key, b" " * 2**20)
    assert ShardView(store, 1).lease() is None
    ShardLease(store, 1, "r2", 30, clock).release()  # not its lease: nothing happens
    assert len(store.store.read(key)) == 2**20
    assert ShardLease(store, 1, "r1", 30, clock).acquire()
    assert ShardView(store, 1).lease().owner == "r1"


def test_a_lease_no_reader_would_accept_is_never_written():
    store = new_store(small_config())
    with pytest.raises(ValueError, match="owner"):
        ShardLease(store, 0, "r" * 251, 30)
    with pytest.raises(ValueError, match="NaN"):
        lease_record(Lease("r1", float("nan"), "h"))
    assert len(ShardLease(store, 0, "r1", 30).holder) <= 200


@pytest.mark.parametrize(
    "data",
    [
        b'{"ended_at": 5.0, "islands": ["a"], "run_id": "run-1", "x": 1}',
        b'{"ended_at": 5.0, "islands": ["A b"], "run_id": "run-1"}',
        b'{"ended_at": NaN, "islands": ["a"], "run_id": "run-1"}',
        b'{"ended_at": 5.0, "islands": "a", "run_id": "run-1"}',
        b'{"ended_at": 5.0, "islands": ["a"], "run_id": "run-2"}',
        b'{"ended_at": 5.0, "islands": [["a"]], "run_id": "run-1"}',
    ],
)
def test_a_hostile_run_marker_is_refused_with_one_line(data):
    with pytest.raises(BadRunMarker) as refused:
        parse_run_marker(data, "run-1")
    assert "\n" not in str(refused.value)


def test_a_run_marker_is_written_at_its_name_and_read_back():
    store = new_store(small_config())
    assert not store.run_ended(RUN)
    store.mark_run_ended(RUN, ["a", "b"])
    assert store.run_ended(RUN) and not store.run_ended("manual__other")
    data = store.store.read(f"{store.experiment}/{keys.run_marker_key(RUN)}")
    assert parse_run_marker(data, RUN).islands == ("a", "b")
    with pytest.raises(ValueError):
        store.mark_run_ended("run-1", ["not a name"])
