"""The experiment layout and protocol on memory:// and file:// (a subset also on gs://)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.gcs_fixture import BACKENDS, gcs_bucket, open_backend  # noqa: F401
from training.names import validate_name
from training.store.experiment import (
    DoubleApply,
    ExperimentExists,
    ExperimentStore,
    dump_json,
)
from training.store.objectstore import CorruptObject
from training.store.tensors import encode_tensors, sha256

LOCAL_BACKENDS = ["memory", "file"]


def _params(value: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "embed": np.full((4, 2), value, np.float32),
        "blocks/0/w": np.arange(6, dtype=np.float32),
    }


def _state() -> dict[str, np.ndarray]:
    return {"momentum/embed": np.zeros((4, 2), np.float32)}


@pytest.fixture(params=LOCAL_BACKENDS)
def exp(request, tmp_path) -> ExperimentStore:
    return ExperimentStore(open_backend(request.param, request, tmp_path), "exp")


@pytest.fixture(params=BACKENDS)
def exp_any(request, tmp_path) -> ExperimentStore:
    """Like `exp`, plus gs:// (fake-gcs-server) for the protocol's conditional writes."""
    return ExperimentStore(open_backend(request.param, request, tmp_path), "exp")


def _publish_v0(exp: ExperimentStore):
    return exp.publish_global(0, _params(), _state(), {}, [], expected=None)


# --- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "a/b", "..", "Upper", "x" * 64, "-lead", "a_b", "a\n"])
def test_validate_name_rejects(bad):
    with pytest.raises(ValueError, match="invalid island name"):
        validate_name("island", bad)


def test_validate_name_accepts_a_63_character_name():
    assert validate_name("experiment", "a" + "-b" * 31) == "a" + "-b" * 31


def test_experiment_store_rejects_an_invalid_experiment_name(exp):
    with pytest.raises(ValueError, match="invalid experiment name"):
        ExperimentStore(exp.store, "../escape")


# --- config ------------------------------------------------------------------------------------


def test_write_config_twice_with_equal_content_is_fine(exp_any):
    exp_any.write_config({"lr": 0.1, "islands": 2})
    exp_any.write_config({"islands": 2, "lr": 0.1})
    assert exp_any.read_config() == {"islands": 2, "lr": 0.1}


def test_write_config_with_different_content_raises_experiment_exists(exp_any):
    exp_any.write_config({"lr": 0.1})
    with pytest.raises(ExperimentExists):
        exp_any.write_config({"lr": 0.2})


def test_json_is_sorted_and_compact():
    assert dump_json({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'


# --- pseudo-gradients --------------------------------------------------------------------------


def test_payload_without_manifest_is_not_listed(exp_any):
    payload = "exp/pseudograds/isl-a/00000001-f000-0123abcd.safetensors"
    exp_any.store.write(payload, encode_tensors(_params()))
    assert exp_any.list_pseudograds() == []


def test_published_pseudograd_is_listed_and_loads_back(exp_any):
    exp_any.publish_pseudograd("isl-a", 1, 0, _params(2.0), {"base_version": 0})
    (ref,) = exp_any.list_pseudograds()
    assert np.array_equal(exp_any.load_pseudograd(ref)["embed"], _params(2.0)["embed"])


def test_publishing_the_same_pseudograd_twice_commits_once(exp_any):
    first = exp_any.publish_pseudograd("isl-a", 3, 1, _params(1.0), {})
    second = exp_any.publish_pseudograd("isl-a", 3, 1, _params(9.0), {})
    files = exp_any.store.list("exp/pseudograds/")
    assert second == first and len(files) == 2  # one manifest, one payload


def test_manifest_fields_are_filled(exp):
    ref = exp.publish_pseudograd("isl-a", 7, 2, _params(), {"tokens": 128})
    m = ref.manifest
    assert (m["experiment"], m["island"], m["seq"], m["fragment"], m["tokens"]) == (
        "exp",
        "isl-a",
        7,
        2,
        128,
    ) and m["sha256"] == sha256(exp.store.read(f"exp/{m['payload']}"))


def test_list_pseudograds_filters_by_island_and_exclusion(exp):
    for island, seq in [("isl-a", 1), ("isl-a", 2), ("isl-b", 1)]:
        exp.publish_pseudograd(island, seq, 0, _params(), {})
    ids = [r.id for r in exp.list_pseudograds("isl-a", exclude={"isl-a/00000001-f000"})]
    assert ids == ["isl-a/00000002-f000"]


def test_load_pseudograd_refuses_a_payload_key_outside_its_island(exp):
    ref = exp.publish_pseudograd("isl-a", 1, 0, _params(), {})
    forged = {**ref.manifest, "payload": "../other/x"}
    exp.store.write("exp/pseudograds/isl-a/00000001-f000.json", dump_json(forged))
    (listed,) = exp.list_pseudograds()
    with pytest.raises(CorruptObject, match="not inside pseudograds/isl-a/"):
        exp.load_pseudograd(listed)


def test_load_pseudograd_refuses_another_islands_payload(exp):
    exp.publish_pseudograd("isl-b", 1, 0, _params(), {})
    ref = exp.publish_pseudograd("isl-a", 1, 0, _params(), {})
    other = exp.list_pseudograds("isl-b")[0].manifest["payload"]
    exp.store.write(
        "exp/pseudograds/isl-a/00000001-f000.json", dump_json({**ref.manifest, "payload": other})
    )
    with pytest.raises(CorruptObject):
        exp.load_pseudograd(exp.list_pseudograds("isl-a")[0])


def test_load_pseudograd_detects_a_flipped_payload_byte(exp):
    ref = exp.publish_pseudograd("isl-a", 1, 0, _params(), {})
    key = f"exp/{ref.payload_key}"
    data = bytearray(exp.store.read(key))
    data[-1] ^= 0xFF
    exp.store.write(key, bytes(data))
    with pytest.raises(CorruptObject, match="sha256"):
        exp.load_pseudograd(ref)


def test_unparseable_manifest_is_listed_but_refused_on_load(exp):
    exp.store.write("exp/pseudograds/isl-a/00000004-f000.json", b"{not json")
    (ref,) = exp.list_pseudograds()
    with pytest.raises(CorruptObject):
        exp.load_pseudograd(ref)


def test_caller_manifest_may_not_override_filled_fields(exp):
    with pytest.raises(ValueError, match="payload"):
        exp.publish_pseudograd("isl-a", 1, 0, _params(), {"payload": "../x"})


# --- global versions ---------------------------------------------------------------------------


def test_head_is_none_before_the_first_publish(exp_any):
    assert exp_any.head() is None


def test_published_global_loads_back(exp_any):
    head = _publish_v0(exp_any)
    loaded = exp_any.load_global()
    assert loaded.version == head.version == 0 and np.array_equal(
        loaded.params["blocks/0/w"], _params()["blocks/0/w"]
    )


def test_publish_with_stale_expected_head_returns_none_and_keeps_head(exp_any):
    v0 = _publish_v0(exp_any)
    v1 = exp_any.publish_global(1, _params(2.0), _state(), {}, [], expected=v0)
    assert exp_any.publish_global(1, _params(3.0), _state(), {}, [], expected=v0) is None
    assert exp_any.head() == v1


def test_first_publish_loses_when_head_already_exists(exp):
    _publish_v0(exp)
    assert _publish_v0(exp) is None


def test_two_threads_racing_publish_global_have_exactly_one_winner(exp_any):
    v0 = _publish_v0(exp_any)
    barrier, results = threading.Barrier(2), [None, None]

    def merger(i: int) -> None:
        barrier.wait()
        results[i] = exp_any.publish_global(
            1, _params(i), _state(), {}, [f"isl-{i}/00000001-f000"], expected=v0
        )

    threads = [threading.Thread(target=merger, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r is not None]
    assert len(winners) == 1 and exp_any.head() == winners[0]


def test_racing_loser_applies_nothing(exp):
    v0 = _publish_v0(exp)
    exp.publish_global(1, _params(), _state(), {}, ["isl-a/00000001-f000"], expected=v0)
    exp.publish_global(1, _params(), _state(), {}, ["isl-b/00000001-f000"], expected=v0)
    assert exp.applied() == {"isl-a/00000001-f000": 1}


def test_load_global_detects_a_flipped_byte_in_params(exp_any):
    head = _publish_v0(exp_any)
    key = f"exp/{head.dir}/params.safetensors"
    data = bytearray(exp_any.store.read(key))
    data[len(data) // 2] ^= 0x01
    exp_any.store.write(key, bytes(data))
    with pytest.raises(CorruptObject, match="params"):
        exp_any.load_global()


def test_manifest_records_parent_applied_and_extra(exp):
    v0 = _publish_v0(exp)
    exp.publish_global(
        1, _params(), _state(), {"fragment_versions": {"0": 1}}, ["a/00000002-f000"], v0
    )
    m = exp.load_global().manifest
    assert (m["parent_version"], m["applied"], m["fragment_versions"]) == (
        0,
        ["a/00000002-f000"],
        {"0": 1},
    )


def test_version_must_follow_the_expected_head(exp):
    v0 = _publish_v0(exp)
    with pytest.raises(ValueError):
        exp.publish_global(5, _params(), _state(), {}, [], expected=v0)


def test_list_global_versions_follows_head_and_skips_race_losers(exp):
    v0 = _publish_v0(exp)
    v1 = exp.publish_global(1, _params(), _state(), {}, [], expected=v0)
    exp.publish_global(1, _params(), _state(), {}, [], expected=v0)  # loses: orphan dir
    exp.publish_global(2, _params(), _state(), {}, [], expected=v1)
    assert [m["version"] for m in exp.list_global_versions()] == [0, 1, 2]


# --- ledger and quarantine ---------------------------------------------------------------------


def test_publish_global_records_its_applied_list_in_the_ledger(exp_any):
    v0 = _publish_v0(exp_any)
    exp_any.publish_global(1, _params(), _state(), {}, ["isl-a/00000001-f000"], expected=v0)
    assert exp_any.applied() == {"isl-a/00000001-f000": 1}


def test_record_applied_again_with_the_same_version_is_fine(exp):
    exp.record_applied(["isl-a/00000001-f000"], 3)
    exp.record_applied(["isl-a/00000001-f000"], 3)
    assert exp.applied() == {"isl-a/00000001-f000": 3}


def test_record_applied_with_a_different_version_raises_double_apply(exp_any):
    exp_any.record_applied(["isl-a/00000001-f000"], 3)
    with pytest.raises(DoubleApply):
        exp_any.record_applied(["isl-a/00000001-f000"], 4)


def test_repair_ledger_completes_entries_lost_in_a_crash_after_the_head_swap(exp, monkeypatch):
    v0 = _publish_v0(exp)
    monkeypatch.setattr(exp, "record_applied", lambda ids, version: None)  # crash before ledger
    exp.publish_global(1, _params(), _state(), {}, ["isl-a/00000001-f000"], expected=v0)
    monkeypatch.undo()
    exp.repair_ledger()
    assert exp.applied() == {"isl-a/00000001-f000": 1}


def test_quarantine_is_listed_with_its_reason(exp):
    exp.quarantine("isl-a/00000002-f001", "sha256 mismatch")
    assert exp.quarantined() == {"isl-a/00000002-f001": "sha256 mismatch"}


def test_invalid_pseudograd_id_is_refused(exp):
    with pytest.raises(ValueError):
        exp.record_applied(["../ledger/x"], 1)


# --- heartbeats, checkpoints, metrics, control, done -------------------------------------------


def test_heartbeat_overwrites_the_previous_one(exp):
    exp.write_heartbeat("isl-a", {"step": 1})
    exp.write_heartbeat("isl-a", {"step": 2})
    assert exp.heartbeats()["isl-a"]["step"] == 2


def test_checkpoint_round_trip(exp):
    exp.save_checkpoint("isl-a", 10, _params(1.0), {"cursor": 5})
    exp.save_checkpoint("isl-a", 20, _params(2.0), {"cursor": 9})
    tensors, meta = exp.load_checkpoint("isl-a")
    assert (
        meta["cursor"] == 9
        and meta["step"] == 20
        and np.array_equal(tensors["embed"], _params(2.0)["embed"])
    )


def test_load_checkpoint_without_one_is_none(exp):
    assert exp.load_checkpoint("isl-a") is None


def test_load_checkpoint_detects_a_corrupt_state(exp):
    exp.save_checkpoint("isl-a", 1, _params(), {})
    (key,) = [k for k in exp.store.list("exp/checkpoints/") if k.endswith("state.safetensors")]
    exp.store.write(key, exp.store.read(key)[:-4])
    with pytest.raises(CorruptObject):
        exp.load_checkpoint("isl-a")


def test_metrics_come_back_in_append_order(exp):
    for step in range(25):
        exp.append_metric("train", {"step": step, "loss": np.float32(1.0 / (step + 1))})
    assert [r["step"] for r in exp.read_metrics("train")] == list(range(25))


def test_stop_is_not_requested_initially(exp):
    assert not exp.stop_requested("isl-a")


def test_experiment_wide_stop_reaches_every_island(exp):
    exp.request_stop()
    assert exp.stop_requested("isl-a") and exp.stop_requested("isl-b")


def test_island_stop_reaches_only_that_island(exp):
    exp.request_stop("isl-a")
    assert exp.stop_requested("isl-a") and not exp.stop_requested("isl-b")


def test_clear_stop_removes_the_marker(exp):
    exp.request_stop()
    exp.clear_stop()
    assert not exp.stop_requested()


def test_done_records_are_listed_by_island(exp):
    exp.mark_done("isl-a", {"steps": 100})
    assert exp.done()["isl-a"]["steps"] == 100


def test_layout_keys_are_the_documented_ones(exp):
    exp.write_config({})
    head = _publish_v0(exp)
    exp.publish_pseudograd("isl-a", 1, 0, _params(), {})
    exp.write_heartbeat("isl-a", {})
    keys = set(exp.store.list("exp/"))
    assert {
        "exp/config.json",
        "exp/global/HEAD.json",
        f"exp/{head.dir}/manifest.json",
        f"exp/{head.dir}/params.safetensors",
        f"exp/{head.dir}/outer_state.safetensors",
        "exp/pseudograds/isl-a/00000001-f000.json",
        "exp/heartbeats/isl-a.json",
    } <= keys
