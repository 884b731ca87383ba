"""A fragment version's merge state (training/store/merge_records.py `MergeState`): one strict
parser, and `to_json` writing back the very JSON the merger always wrote (docs/STORE.md)."""

from __future__ import annotations

import math

import pytest

from training.store import merge_records as records
from training.store.merge_records import (
    BadFragmentManifest,
    IslandNorm,
    LastClaim,
    MergeState,
    merge_state_of,
    parse_merge_state,
)
from training.store.safejson import FRAGMENT_MANIFEST, dump_json, load_json

STATE = MergeState(
    steps=3,
    seen=5,
    cursors={"isl-b": -1, "isl-a": 4},
    norms=(IslandNorm("isl-a", 1.5), 0.25, IslandNorm("isl-b", 2)),
    sync_s=0.125,
    version_times={"3": 1700000000.5, "12": 1700000001.0},
    last_claim={"isl-a": LastClaim(4, 120, 1700000000.25)},
)
STATE_JSON = (
    b'{"cursors":{"isl-a":4,"isl-b":-1},"last_claim":{"isl-a":[4,120,1700000000.25]},'
    b'"norms":[["isl-a",1.5],0.25,["isl-b",2]],"seen":5,"steps":3,"sync_s":0.125,'
    b'"version_times":{"12":1700000001.0,"3":1700000000.5}}'
)


def test_to_json_writes_the_stored_bytes():
    assert dump_json(STATE.to_json()) == STATE_JSON


def test_the_stored_bytes_parse_back_to_the_same_state():
    assert parse_merge_state(load_json(STATE_JSON, FRAGMENT_MANIFEST)) == STATE


def test_a_parsed_state_writes_back_its_json_numbers_as_they_were():
    """Ints stay ints and floats floats (a bare legacy norm, an int time): what the merger
    copies forward is byte for byte what it read."""
    stored = dict(
        steps=0,
        seen=0,
        cursors={},
        norms=[3, ["a", 0], 0.5],
        sync_s=0,
        version_times={"0": 17},
        last_claim={"a": [1.0, 2, 3]},
    )
    assert dump_json(parse_merge_state(stored).to_json()) == dump_json(stored)


def test_the_initial_versions_state_is_the_json_of_version_0():
    got = dump_json(MergeState(0, 0, version_times={"0": 5.5}).to_json())
    assert got == (
        b'{"cursors":{},"last_claim":{},"norms":[],"seen":0,"steps":0,"sync_s":0.0,'
        b'"version_times":{"0":5.5}}'
    )


def test_optional_fields_parse_as_empty_and_other_keys_are_dropped():
    state = parse_merge_state(dict(steps=1, seen=1, cursors={}, norms=[], sync_s=0.0, x=[1]))
    assert (state.version_times, state.last_claim) == ({}, {})
    assert set(state.to_json()) == {
        "steps",
        "seen",
        "cursors",
        "norms",
        "sync_s",
        "version_times",
        "last_claim",
    }


VALID = STATE.to_json()
MISSING = object()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("steps", MISSING),
        ("steps", None),
        ("steps", -1),
        ("steps", "3"),
        ("steps", True),
        ("steps", 1.0),
        ("seen", MISSING),
        ("seen", -1),
        ("seen", 2**60),
        ("norms", MISSING),
        ("norms", None),
        ("norms", {"isl-a": 1.0}),
        ("norms", [["isl-a", -1.0]]),
        ("norms", [["Isl A", 1.0]]),
        ("norms", [["isl-a", 1.0, 2.0]]),
        ("norms", [True]),
        ("norms", [math.nan]),
        ("norms", ["1.0"]),
        ("cursors", MISSING),
        ("cursors", None),
        ("cursors", [["isl-a", 1]]),
        ("cursor", {"isl-a": -2}),
        ("cursor", {"isl-a": 10**8}),
        ("cursor", {"isl-a": 1.0}),
        ("cursor", {"../x": 1}),
        ("sync_s", MISSING),
        ("sync_s", None),
        ("sync_s", -0.1),
        ("sync_s", "0.1"),
        ("sync_s", math.inf),
        ("version_times", None),
        ("version_times", [1.0]),
        ("version_times", {"x": 1.0}),
        ("version_times", {"-1": 1.0}),
        ("version_times", {"123456789": 1.0}),
        ("version_times", {"\u0661": 1.0}),
        ("version_times", {"1": "now"}),
        ("last_claim", None),
        ("last_claim", {"isl-a": [1, 2]}),
        ("last_claim", {"isl-a": [1, 2, None]}),
        ("last_claim", {"isl-a": {"seq": 1}}),
        ("last_claim", {"Isl A": [1, 2, 3.0]}),
    ],
)
def test_a_malformed_field_is_refused_with_a_line_naming_it(field, value):
    key = "cursors" if field == "cursor" else field
    bad = {k: v for k, v in VALID.items() if k != key}
    if value is not MISSING:
        bad[key] = value
    with pytest.raises(BadFragmentManifest) as err:
        parse_merge_state(bad)
    message = str(err.value)
    assert "\n" not in message and message.startswith("merge_state: "), message
    assert field in message.split(":")[1], message


def test_a_merge_state_that_is_not_an_object_is_refused():
    with pytest.raises(BadFragmentManifest, match=r"^merge_state: \[\] is not an object$"):
        parse_merge_state([])


def test_merge_state_of_a_manifest_without_one_is_refused():
    with pytest.raises(BadFragmentManifest, match=r"^merge_state: missing$"):
        merge_state_of({"version": 0})
    assert merge_state_of({"merge_state": VALID}) == STATE


def test_a_fragment_manifest_carries_its_parsed_merge_state():
    manifest = dict(
        experiment="exp",
        fragment=0,
        version=0,
        parent_version=None,
        parent_dir=None,
        created_at=1.0,
        applied=[],
        crc32c={"params": "0" * 8, "outer_state": "1" * 8},
        nbytes={"params": 1, "outer_state": 1},
    )
    assert records.parse_fragment_manifest(manifest, "exp", 0, 0).merge_state is None
    manifest["merge_state"] = VALID
    assert records.parse_fragment_manifest(manifest, "exp", 0, 0).merge_state == STATE
