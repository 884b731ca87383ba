"""Issue 28, item 7: nothing in the bucket stops the syncer.

Objects a hostile island (or a hand in the bucket) could plant where the merger keeps its own
records: a ledger entry for a contribution still pending, claiming it was applied in another
version (before the fix `diloco merge` raised DoubleApply and exited 2 on every pass, for
good); a contribution to a fragment the experiment does not have (silently ignored before).
The versions' `applied` lists are the truth: ledger entries and cursors that contradict them
are reported (log line, counted as skipped), corrected, and the merge goes on. On memory://,
file:// and fake-gcs-server (`-m integration`).
"""

from __future__ import annotations

import json

import pytest

from tests.gcs_fixture import BACKENDS, gcs_bucket, open_backend  # noqa: F401
from tests.helpers import publish_delta, random_delta, small_config
from training.cli import main
from training.merge.merger import Merger, initial_version
from training.store.experiment import DoubleApply, ExperimentStore, dump_json

GOOD = "b/00000000-f000"


@pytest.fixture(params=BACKENDS)
def setup(request, tmp_path):
    objects = open_backend(request.param, request, tmp_path)
    cfg = small_config(outer={"method": "nesterov"}, store_url=objects.url)
    store = ExperimentStore(objects, cfg.name)
    store.write_config(cfg.model_dump(mode="json"))
    initial_version(cfg, store)
    return cfg, store, store.load_params()


def _plant(store, relative: str, data: bytes) -> None:
    store.store.write(store.object_key(relative), data)


def _merge_cli(cfg) -> int:
    return main(["merge", "--store", cfg.store_url, "--experiment", cfg.name])


def _ledger_version(store, pg_id) -> int:
    return json.loads(store.store.read(store.object_key(f"ledger/{pg_id}.json")))["version"]


@pytest.mark.parametrize(
    "entry",
    [
        {"version": 7, "at": 0.0, "at_iso": "1970-01-01T00:00:00Z"},  # a version not yet made
        {"version": 0, "at": 0.0, "at_iso": "1970-01-01T00:00:00Z"},  # one that applied nothing
        "not json",  # unreadable
    ],
    ids=["future-version", "version-0", "unreadable"],
)
def test_a_ledger_entry_forged_for_a_pending_contribution_stops_no_merge_pass(setup, entry):
    cfg, store, theta = setup
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1))
    _plant(
        store, f"ledger/{GOOD}.json", entry.encode() if isinstance(entry, str) else dump_json(entry)
    )
    assert _merge_cli(cfg) == 0  # applies GOOD in version 1 (before the fix: DoubleApply, 2)
    assert _merge_cli(cfg) == 0  # and every later pass (before: 2 again, repair_ledger)
    fresh = ExperimentStore(store.store, cfg.name)
    assert fresh.head(0).version == 1
    assert fresh.list_fragment_versions(0)[1]["applied"] == [GOOD]
    assert _ledger_version(store, GOOD) == 1  # the entry now says what version 1 says


def test_a_forged_ledger_entry_is_reported_and_counted(setup):
    cfg, store, theta = setup
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1))
    _plant(store, f"ledger/{GOOD}.json", dump_json({"version": 7, "at": 0.0, "at_iso": "x"}))
    r = Merger(cfg, store).merge_once()
    assert r.applied == [GOOD] and r.skipped == 1
    (example,) = store.skipped.examples
    assert example.startswith(f"ledger/{GOOD}.json: contradicts the versions")
    assert "names version 7" in example


def test_a_real_double_apply_still_stops_the_merge(setup):
    """Two committed versions whose applied lists both name an id: no bucket object to blame
    (only the merger writes versions), so it is an error, not a skip."""
    cfg, store, theta = setup
    v0 = store.head(0)
    fv = store.load_fragment(v0, outer_state=True)
    extra = {k: v for k, v in store.fragment_manifest(v0).items() if k in ("merge_state",)}
    extra["tokens_merged"] = 0
    v1 = store.publish_fragment(0, 1, fv.params, fv.outer_state, extra, [GOOD], expected=v0)
    with pytest.raises(DoubleApply, match=r"b/00000000-f000 \(version 1\)"):
        store.publish_fragment(0, 2, fv.params, fv.outer_state, extra, [GOOD], expected=v1)


def test_a_cursor_below_its_versions_applied_list_applies_nothing_twice(setup):
    """Version 1 names a/00000003 in `applied` but its cursors do not cover it (what a broken
    or hand-edited manifest says): the applied list wins, a/00000003 is not pending again."""
    cfg, store, theta = setup
    v0 = store.head(0)
    fv = store.load_fragment(v0, outer_state=True)
    manifest = store.fragment_manifest(v0)
    extra = {"merge_state": manifest["merge_state"], "tokens_merged": 512}  # cursors: none
    store.publish_fragment(0, 1, fv.params, fv.outer_state, extra, ["a/00000003-f000"], v0)
    publish_delta(store, cfg, "a", 3, random_delta(theta, 3), base_version=1)
    assert Merger(cfg, store).pending() == {0: []}
    r = Merger(cfg, store).merge_once()
    assert r.applied == [] and r.version is None
    assert any("cursor of a is -1, below a/00000003-f000" in e for e in store.skipped.examples)


def test_a_contribution_to_a_fragment_out_of_range_is_quarantined_with_its_reason(setup):
    cfg, store, theta = setup
    publish_delta(store, cfg, "a", 0, random_delta(theta, 2), fragment=5)  # P = 1
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1))
    r = Merger(cfg, store).merge_once()
    assert r.applied == [GOOD]
    assert r.quarantined == {"a/00000000-f005": "fragment 5 out of range (P = 1)"}
    assert store.quarantined() == {"a/00000000-f005": "fragment 5 out of range (P = 1)"}


def _advance(store, versions: int) -> None:
    """Publish `versions` new versions of fragment 0 that apply nothing (HEAD moves on)."""
    head = store.head(0)
    fv = store.load_fragment(head, outer_state=True)
    manifest = store.fragment_manifest(head)
    extra = {"merge_state": manifest["merge_state"], "tokens_merged": 0}
    for _ in range(versions):
        head = store.publish_fragment(
            0, head.version + 1, fv.params, fv.outer_state, extra, expected=head
        )


@pytest.mark.parametrize("entry", [b'{"version": 0, "at": 0.0}', b"not json"])
def test_gc_keeps_a_pending_contribution_a_forged_ledger_entry_calls_applied_long_ago(setup, entry):
    """The ledger says a/00000000 was applied in version 0 (or is unreadable: version -1);
    HEAD is 2, so with keep_last = 1 an entry of version 0 is outside the window. No version
    applies it: it is pending, and collecting its marker would lose it."""
    cfg, store, theta = setup
    publish_delta(store, cfg, "a", 0, random_delta(theta, 2))
    _plant(store, "ledger/a/00000000-f000.json", entry)
    _advance(store, 2)
    assert "a/00000000-f000" not in store.plan_gc(keep_last=1).pseudograds
    assert any(e.startswith("ledger/a/00000000-f000.json") for e in store.skipped.examples)


def test_forged_ledger_entries_leave_every_contribution_applied_exactly_once(setup):
    """Islands a and b publish 3 intervals each, one merge pass per interval; before each pass
    a forged entry claims the newest pending contribution of b was applied in version 0. Over
    the 3 passes the versions' applied lists name each of the 6 ids once (3 versions), and a
    4th pass applies nothing."""
    cfg, store, theta = setup
    merger = Merger(cfg, store)
    for seq in range(3):
        base = store.head(0).version
        publish_delta(store, cfg, "a", seq, random_delta(theta, 10 + seq), base_version=base)
        publish_delta(store, cfg, "b", seq, random_delta(theta, 20 + seq), base_version=base)
        _plant(store, f"ledger/b/{seq:08d}-f000.json", dump_json({"version": 0, "at": 0.0}))
        assert merger.merge_once().version == seq + 1
    assert merger.merge_once().applied == []
    applied = [i for m in store.list_fragment_versions(0) for i in m.get("applied", [])]
    expected = [f"{isl}/{s:08d}-f000" for s in range(3) for isl in ("a", "b")]
    assert sorted(applied) == sorted(expected)
    assert store.applied() == {i: int(i[9]) + 1 for i in expected}  # seq s -> version s + 1
