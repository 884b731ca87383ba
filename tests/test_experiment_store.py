"""The experiment layout and protocol on memory:// and file:// (a subset also on gs://).

Past 500 lines: one test per rule of docs/STORE.md's protocol, in the order the doc gives them,
on the same fixtures; the fault-point, hostile and fuzz cases have files of their own.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from tests.gcs_fixture import BACKENDS, gcs_bucket, open_backend  # noqa: F401
from training.config.names import validate_name
from training.store.experiment import (
    DoubleApply,
    ExperimentExists,
    ExperimentStore,
    LayoutMismatch,
    dump_json,
)
from training.store.objectstore import CorruptObject, ObjectNotFound
from training.store.tensors import checksum, encode_tensors, sha256

LOCAL_BACKENDS = ["memory", "file"]


def _params(value: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "embed": np.full((4, 2), value, np.float32),
        "blocks/0/w": np.arange(6, dtype=np.float32),
    }


def _fragment(p: int, value: float = 1.0) -> dict[str, np.ndarray]:
    """Fragment p's slice of a model: its own tensor names."""
    return {f"blocks/{p}/w": np.full((3,), value, np.float32)}


def _state() -> dict[str, np.ndarray]:
    return {"momentum/embed": np.zeros((4, 2), np.float32)}


@pytest.fixture(params=LOCAL_BACKENDS)
def exp(request, tmp_path) -> ExperimentStore:
    return ExperimentStore(open_backend(request.param, request, tmp_path), "exp")


@pytest.fixture(params=BACKENDS)
def exp_any(request, tmp_path) -> ExperimentStore:
    """Like `exp`, plus gs:// (fake-gcs-server) for the protocol's conditional writes."""
    return ExperimentStore(open_backend(request.param, request, tmp_path), "exp")


def _publish_v0(exp: ExperimentStore, p: int = 0):
    return exp.publish_fragment(p, 0, _fragment(p, 0.0), _state(), expected=None)


def _publish(exp: ExperimentStore, head, value: float = 1.0, applied=()):
    """Publish the version after `head` on head's fragment."""
    p, v = head.fragment, head.version + 1
    return exp.publish_fragment(p, v, _fragment(p, value), _state(), {}, applied, head)


def _concurrently(fn, args) -> None:
    """Run fn(arg) for each arg on its own thread; re-raise the first error once all are done."""
    errors: list[BaseException] = []

    def run(arg) -> None:
        try:
            fn(arg)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _meet_before_head_cas(exp: ExperimentStore, monkeypatch, parties: int = 2) -> None:
    """Make `parties` publishers wait for each other just before their HEAD compare-and-swap
    (payloads and manifests written): their swaps then really race."""
    barrier, real = threading.Barrier(parties), exp.store.compare_and_swap_generation

    def cas(key, *args):
        if key.endswith("/HEAD.json"):
            barrier.wait(timeout=30)
        return real(key, *args)

    monkeypatch.setattr(exp.store, "compare_and_swap_generation", cas)


def _two_fragments(exp: ExperimentStore) -> ExperimentStore:
    exp.write_config({"fragments": {"count": 2}})
    return exp


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


# --- config and layout -------------------------------------------------------------------------


def test_write_config_twice_with_equal_content_is_fine(exp_any):
    exp_any.write_config({"lr": 0.1, "islands": 2})
    exp_any.write_config({"islands": 2, "lr": 0.1})
    assert exp_any.read_config() == {"islands": 2, "lr": 0.1}


def test_write_config_with_different_content_raises_experiment_exists(exp_any):
    exp_any.write_config({"lr": 0.1})
    with pytest.raises(ExperimentExists):
        exp_any.write_config({"lr": 0.2})


def test_config_json_records_layout_2(exp):
    exp.write_config({"lr": 0.1})
    assert json.loads(exp.store.read("exp/config.json")) == {"layout": 2, "lr": 0.1}


def test_a_config_json_with_a_retired_field_still_loads_joins_and_rewrites(exp):
    """eval_every_versions (removed from the config, which forbids unknown keys) in a
    config.json stored before: dropped on read, so the experiment loads and can be joined."""
    from training.config.experiment import parse_config
    from training.usecases.create import add_islands

    cfg = json.loads(parse_config({"name": "exp", "data": {"num_shards": 3}}).to_json())
    old = {**cfg, "eval_every_versions": 5, "layout": 2}
    exp.store.write("exp/config.json", dump_json(old))
    assert exp.read_config() == cfg and parse_config(exp.read_config()).name == "exp"
    exp.write_config(cfg)  # the same experiment asked for again: a no-op, not ExperimentExists
    joined = add_islands(exp, [{"name": "island-2"}])
    assert "eval_every_versions" not in joined
    assert [i.name for i in parse_config(exp.read_config()).islands][-1] == "island-2"


READERS = {
    "read_config": lambda exp: exp.read_config(),
    "heads": lambda exp: exp.heads(),
    "update_config": lambda exp: exp.update_config(lambda cfg: {**cfg, "lr": 1.0}),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("layout", [{}, {"layout": 1}, {"layout": 3}])
def test_a_store_of_another_layout_is_refused_with_one_line(exp, reader, layout):
    exp.store.write("exp/config.json", dump_json({**layout, "fragments": {"count": 2}}))
    with pytest.raises(LayoutMismatch, match="layout") as info:
        READERS[reader](exp)
    assert "\n" not in str(info.value)


def test_the_store_stores_a_join_but_does_not_decide_it():
    """The join rule is the config's (`check_same_settings`, `join_islands`), applied by the
    caller (training/usecases/create.py) through `update_config`: no module of the store names
    it, and `ExperimentStore` has no join of its own."""
    import ast
    from pathlib import Path

    import training.store

    rule = {"check_same_settings", "join_islands"}
    named = []
    for path in sorted(Path(training.store.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = {a.name for a in node.names} if isinstance(node, ast.ImportFrom) else set()
            names |= {node.id} if isinstance(node, ast.Name) else set()
            names |= {node.attr} if isinstance(node, ast.Attribute) else set()
            named += [f"{path.name}:{node.lineno} {n}" for n in sorted(names & rule)]
    assert named == []
    assert not hasattr(ExperimentStore, "add_islands")


def test_update_config_stores_the_callers_config_as_given(exp):
    """No rule of its own: an island list the join rule would refuse (no free shard) is
    stored as the caller's change returns it."""
    exp.write_config({"name": "exp", "islands": [{"name": "a"}]})
    grown = exp.update_config(lambda cfg: {**cfg, "islands": [*cfg["islands"], {"name": "b"}]})
    assert exp.read_config() == grown == {"name": "exp", "islands": [{"name": "a"}, {"name": "b"}]}


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
    ) and m["crc32c"] == checksum([exp.store.read(f"exp/{m['payload']}")], "crc32c")


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
    with pytest.raises(CorruptObject, match="crc32c checksum"):
        exp.load_pseudograd(ref)


def test_unparseable_manifest_is_listed_but_refused_on_load(exp):
    exp.store.write("exp/pseudograds/isl-a/00000004-f000.json", b"{not json")
    (ref,) = exp.list_pseudograds()
    with pytest.raises(CorruptObject):
        exp.load_pseudograd(ref)


def test_caller_manifest_may_not_override_filled_fields(exp):
    with pytest.raises(ValueError, match="payload"):
        exp.publish_pseudograd("isl-a", 1, 0, _params(), {"payload": "../x"})


@pytest.mark.parametrize("after_seq", [0, 3, 5, 9])
def test_list_pseudograds_after_seq_never_returns_an_earlier_seq(exp, after_seq):
    for seq in range(1, 6):
        for fragment in (0, 1):
            exp.publish_pseudograd("isl-a", seq, fragment, _params(), {})
        exp.publish_pseudograd("isl-b", seq + 10, 0, _params(), {})
    exp.store.write("exp/pseudograds/isl-a/00000009-f000-0123abcd.safetensors", b"uncommitted")
    ids = [r.id for r in exp.list_pseudograds("isl-a", after_seq=after_seq)]
    assert ids == [f"isl-a/{s:08d}-f{p:03d}" for s in range(after_seq + 1, 6) for p in (0, 1)]


def test_list_pseudograds_after_seq_needs_an_island(exp):
    with pytest.raises(ValueError, match="needs an island"):
        exp.list_pseudograds(after_seq=3)


@pytest.mark.integration
def test_list_pseudograds_after_seq_is_a_server_side_start_offset_on_gcs(
    request, tmp_path, monkeypatch
):
    exp = ExperimentStore(open_backend("gs", request, tmp_path), "exp")
    for seq in range(1, 6):
        exp.publish_pseudograd("isl-a", seq, 0, _params(), {})
    client, calls = exp.store._client(), []
    real = client.list_blobs

    def spy(*args, **kwargs):
        blobs = list(real(*args, **kwargs))
        calls.append((kwargs.get("start_offset"), [b.name.rsplit("/", 1)[1][:8] for b in blobs]))
        return blobs

    monkeypatch.setattr(client, "list_blobs", spy)
    assert [r.seq for r in exp.list_pseudograds("isl-a", after_seq=3)] == [4, 5]
    offset = f"{exp.store.prefix}/exp/pseudograds/isl-a/00000003~"
    assert calls == [(offset, ["00000004", "00000004", "00000005", "00000005"])]


def test_quarantined_after_seq_lists_only_later_seqs_of_that_island(exp):
    for pg_id in ("isl-a/00000002-f000", "isl-a/00000004-f001", "isl-b/00000005-f000"):
        exp.quarantine(pg_id, "bad")
    assert exp.quarantined("isl-a", after_seq=2) == {"isl-a/00000004-f001": "bad"}


# --- fragment versions -------------------------------------------------------------------------


def test_head_is_none_before_the_first_publish(exp_any):
    assert exp_any.head(0) is None


def test_published_fragment_loads_back_with_its_outer_state(exp_any):
    head = _publish_v0(exp_any)
    got = exp_any.load_fragment(head, outer_state=True)
    assert (got.fragment, got.version, got.params["blocks/0/w"].tolist()) == (0, 0, [0.0] * 3)
    assert np.array_equal(got.outer_state["momentum/embed"], _state()["momentum/embed"])


def test_load_fragment_leaves_out_the_outer_state_unless_asked(exp):
    assert exp.load_fragment(_publish_v0(exp)).outer_state == {}


def test_publish_with_stale_expected_head_returns_none_and_keeps_head(exp_any):
    v0 = _publish_v0(exp_any)
    v1 = _publish(exp_any, v0, 2.0)
    assert _publish(exp_any, v0, 3.0) is None
    assert exp_any.head(0) == v1


def test_first_publish_loses_when_head_already_exists(exp):
    _publish_v0(exp)
    assert _publish_v0(exp) is None


def test_two_threads_racing_on_one_fragment_have_exactly_one_winner(exp_any, monkeypatch):
    v0 = _publish_v0(exp_any)
    _meet_before_head_cas(exp_any, monkeypatch)
    results = [None, None]

    def merger(i: int) -> None:
        results[i] = _publish(exp_any, v0, float(i), [f"isl-{i}/00000001-f000"])

    _concurrently(merger, range(2))
    monkeypatch.undo()
    winners = [r for r in results if r is not None]
    assert len(winners) == 1 and exp_any.head(0) == winners[0]


def test_two_threads_publishing_different_fragments_both_win(exp_any, monkeypatch):
    heads = [_publish_v0(exp_any, 0), _publish_v0(exp_any, 1)]
    _meet_before_head_cas(exp_any, monkeypatch)
    results = [None, None]

    def merger(p: int) -> None:
        results[p] = _publish(exp_any, heads[p], 1.0, [f"isl-a/00000001-f{p:03d}"])

    _concurrently(merger, range(2))
    monkeypatch.undo()
    assert [exp_any.head(p) for p in (0, 1)] == results and None not in results


def test_a_cas_on_fragment_0_never_affects_fragment_1(exp):
    f0, f1 = _publish_v0(exp, 0), _publish_v0(exp, 1)
    _publish(exp, f0)
    assert _publish(exp, f0) is None  # a lost CAS on fragment 0
    assert exp.head(1) == f1  # same version, dir and generation
    assert _publish(exp, f1) is not None  # fragment 1's pointer from before still wins


def test_racing_loser_applies_nothing(exp):
    v0 = _publish_v0(exp)
    _publish(exp, v0, applied=["isl-a/00000001-f000"])
    _publish(exp, v0, applied=["isl-b/00000001-f000"])
    assert exp.applied() == {"isl-a/00000001-f000": 1}


def test_load_fragment_detects_a_flipped_byte_in_params(exp_any):
    head = _publish_v0(exp_any)
    key = f"exp/{head.dir}/params.safetensors"
    data = bytearray(exp_any.store.read(key))
    data[len(data) // 2] ^= 0x01
    exp_any.store.write(key, bytes(data))
    with pytest.raises(CorruptObject, match="params"):
        exp_any.load_fragment(head)


def test_manifest_records_fragment_parent_applied_and_extra(exp):
    v0 = _publish_v0(exp, 1)
    v1 = exp.publish_fragment(
        1, 1, _fragment(1), _state(), {"tokens_merged": 64}, ["a/00000002-f001"], v0
    )
    m = exp.fragment_manifest(v1)
    fields = ("fragment", "parent_version", "parent_dir", "applied", "tokens_merged")
    assert [m[k] for k in fields] == [1, 0, v0.dir, ["a/00000002-f001"], 64]


@pytest.mark.parametrize(
    "change",
    [
        {"version": 5},  # does not follow the expected head
        {"fragment": 1},  # the expected head is fragment 0's
        {"applied": ["a/00000001-f001"]},  # a pseudo-gradient of another fragment
        {"applied": ["a/00000001-f000", "a/00000001-f000"]},
        {"manifest_extra": {"applied": []}},  # a field publish_fragment fills
    ],
)
def test_publish_fragment_refuses_inconsistent_arguments(exp, change):
    v0 = _publish_v0(exp)
    args = {"fragment": 0, "version": 1, "params": _fragment(0), "outer_state": _state()}
    with pytest.raises(ValueError):
        exp.publish_fragment(**{**args, **change}, expected=v0)


def test_list_fragment_versions_follows_head_and_skips_race_losers(exp):
    v0 = _publish_v0(exp)
    v1 = _publish(exp, v0)
    _publish(exp, v0)  # loses: orphan dir
    _publish(exp, v1)
    assert [m["version"] for m in exp.list_fragment_versions(0)] == [0, 1, 2]


def test_find_version_points_at_a_committed_ancestor(exp):
    v0 = _publish_v0(exp)
    _publish(exp, _publish(exp, v0, 1.0), 2.0)
    pointer = exp.find_version(0, 1)
    assert exp.load_fragment(pointer).params["blocks/0/w"][0] == 1.0


def test_find_version_of_an_unknown_version_raises_object_not_found(exp):
    _publish_v0(exp, 0)
    _publish_v0(exp, 1)
    with pytest.raises(ObjectNotFound):
        exp.find_version(1, 1)


def test_a_version_directory_is_not_committed_before_its_head_swap(exp, monkeypatch):
    v0 = _publish_v0(exp)
    real = exp.store.compare_and_swap_generation

    def crash(key, *args):
        if key.endswith("/HEAD.json"):
            raise RuntimeError("killed before the HEAD swap")
        return real(key, *args)

    monkeypatch.setattr(exp.store, "compare_and_swap_generation", crash)
    with pytest.raises(RuntimeError):
        _publish(exp, v0)  # payloads and manifest written, HEAD still at v0
    monkeypatch.undo()
    manifests = [k for k in exp.store.list("exp/fragments/f000/") if k.endswith("manifest.json")]
    assert len(manifests) == 2 and [m["version"] for m in exp.list_fragment_versions(0)] == [0]
    assert _publish(exp, v0) is not None


def test_heads_reads_every_fragment_in_order(exp):
    _two_fragments(exp)
    f1 = _publish_v0(exp, 1)
    assert exp.heads() == [None, f1]


# --- snapshots ---------------------------------------------------------------------------------


def test_current_snapshot_is_none_until_every_fragment_has_a_head(exp):
    _two_fragments(exp)
    _publish_v0(exp, 0)
    assert exp.current_snapshot() is None


def test_a_recorded_snapshot_reloads_the_whole_model_after_fragments_advance(exp):
    _two_fragments(exp)
    heads = [_publish_v0(exp, 0), _publish_v0(exp, 1)]
    heads = [_publish(exp, h, 1.0 + p) for p, h in enumerate(heads)]
    exp.record_snapshot(exp.current_snapshot(), {"step": 7})
    for h in heads:
        _publish(exp, h, 9.0)
    (record,) = exp.snapshots()
    params = exp.load_params(exp.snapshot_of(record))
    assert (record["step"], record["versions"]) == (7, [1, 1])
    assert {name: t.tolist() for name, t in params.items()} == {
        "blocks/0/w": [1.0] * 3,
        "blocks/1/w": [2.0] * 3,
    }


def test_current_snapshot_counts_the_mean_tokens_over_fragments(exp):
    _two_fragments(exp)
    for p, tokens in ((0, 100), (1, 300)):
        exp.publish_fragment(p, 0, _fragment(p), {}, {"tokens_merged": tokens})
    assert exp.current_snapshot().tokens_merged == 200


def test_snapshot_of_refuses_a_directory_of_another_fragment(exp):
    f0, f1 = _publish_v0(exp, 0), _publish_v0(exp, 1)
    with pytest.raises(CorruptObject, match="entry 0"):
        exp.snapshot_of({"versions": [0, 0], "dirs": [f1.dir, f0.dir]})


@pytest.mark.parametrize("tokens", ["many", None, 1.5, True])
def test_snapshot_of_refuses_an_invalid_token_count(exp, tokens):
    f0 = _publish_v0(exp, 0)
    with pytest.raises(CorruptObject, match="tokens_merged"):
        exp.snapshot_of({"versions": [0], "dirs": [f0.dir], "tokens_merged": tokens})


def test_offer_best_keeps_the_lower_loss(exp):
    assert exp.offer_best({"loss": 2.0, "versions": [1]})
    assert not exp.offer_best({"loss": 3.0, "versions": [2]})
    assert not exp.offer_best({"loss": float("nan"), "versions": [3]})
    assert exp.best() == {"loss": 2.0, "versions": [1]}


@pytest.mark.parametrize("first", [0.5, 0.3])
def test_offer_best_keeps_the_lowest_loss_when_two_writers_race(exp_any, monkeypatch, first):
    """Both writers read BEST (1.0) before either swaps; `first` swaps first, the other's swap
    then fails on the generation and re-reads: either way 0.3 ends up BEST."""
    exp_any.offer_best({"loss": 1.0, "versions": [0]})
    both_read, first_swapped, seen = threading.Barrier(2), threading.Event(), threading.local()
    read, swap = exp_any.store.read_versioned, exp_any.store.compare_and_swap_generation

    def read_versioned(key, max_bytes=None):
        got = read(key, max_bytes)
        if key.endswith("/snapshots/BEST.json") and not getattr(seen, "read", False):
            seen.read = True
            both_read.wait(timeout=30)
        return got

    def compare_and_swap_generation(key, data, expected):
        if json.loads(data)["loss"] != first:
            assert first_swapped.wait(timeout=30)
            return swap(key, data, expected)
        try:
            return swap(key, data, expected)
        finally:
            first_swapped.set()

    monkeypatch.setattr(exp_any.store, "read_versioned", read_versioned)
    monkeypatch.setattr(exp_any.store, "compare_and_swap_generation", compare_and_swap_generation)
    results = {}

    def evaluator(loss: float) -> None:
        results[loss] = exp_any.offer_best({"loss": loss, "versions": [int(loss * 10)]})

    _concurrently(evaluator, (0.5, 0.3))
    monkeypatch.undo()
    assert (results, exp_any.best()) == (
        {0.5: first == 0.5, 0.3: True},
        {"loss": 0.3, "versions": [3]},
    )


# --- ledger and quarantine ---------------------------------------------------------------------


def test_publish_fragment_records_its_applied_list_in_the_ledger(exp_any):
    v0 = _publish_v0(exp_any)
    _publish(exp_any, v0, applied=["isl-a/00000001-f000"])
    assert exp_any.applied() == {"isl-a/00000001-f000": 1}


def test_ledger_entries_carry_their_time(exp):
    exp.record_applied(["isl-a/00000001-f000"], 3)
    entry = json.loads(exp.store.read("exp/ledger/isl-a/00000001-f000.json"))
    assert entry["version"] == 3 and entry["at_iso"].endswith("Z") and entry["at"] > 0


def test_is_applied_checks_one_ledger_entry(exp):
    exp.record_applied(["isl-a/00000001-f000"], 3)
    assert exp.is_applied("isl-a/00000001-f000") and not exp.is_applied("isl-a/00000002-f000")


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
    v1 = _publish(exp, v0, applied=["isl-a/00000001-f000"])
    monkeypatch.undo()
    exp.repair_ledger(v1)
    assert exp.applied() == {"isl-a/00000001-f000": 1}


def test_quarantine_is_listed_with_its_reason(exp):
    exp.quarantine("isl-a/00000002-f001", "sha256 mismatch")
    assert exp.quarantined() == {"isl-a/00000002-f001": "sha256 mismatch"}


def test_quarantine_entries_carry_their_time(exp):
    exp.quarantine("isl-a/00000002-f001", "bad")
    entry = json.loads(exp.store.read("exp/quarantine/isl-a/00000002-f001.json"))
    assert entry["reason"] == "bad" and entry["at_iso"].endswith("Z") and entry["at"] > 0


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
    exp.record_applied(["isl-a/00000001-f000"], 0)
    exp.write_heartbeat("isl-a", {})
    snapshot = exp.record_snapshot(exp.current_snapshot())
    exp.offer_best({"loss": 1.0, **exp.current_snapshot().to_dict()})
    keys = set(exp.store.list("exp/"))
    assert {
        "exp/config.json",
        "exp/fragments/f000/HEAD.json",
        f"exp/{head.dir}/manifest.json",
        f"exp/{head.dir}/params.safetensors",
        f"exp/{head.dir}/outer_state.safetensors",
        "exp/pseudograds/isl-a/00000001-f000.json",
        "exp/ledger/isl-a/00000001-f000.json",
        "exp/heartbeats/isl-a.json",
        f"exp/{snapshot}",
        "exp/snapshots/BEST.json",
    } <= keys and head.dir.startswith("fragments/f000/v00000000-")


def test_sha256_manifests_of_older_stores_still_verify(exp):
    """Stores written before crc32c carry sha256: both kinds are verified, one per manifest."""
    ref = exp.publish_pseudograd("isl-a", 1, 0, _params(), {})
    data = exp.store.read(f"exp/{ref.payload_key}")
    old = {k: v for k, v in ref.manifest.items() if k != "crc32c"}
    marker = "exp/pseudograds/isl-a/00000001-f000.json"
    exp.store.write(marker, dump_json({**old, "sha256": sha256(data)}))
    (listed,) = exp.list_pseudograds()
    assert np.array_equal(exp.load_pseudograd(listed)["embed"], _params()["embed"])
    exp.store.write(marker, dump_json({**old, "sha256": sha256(data + b"x")}))
    with pytest.raises(CorruptObject, match="fails its sha256 checksum"):
        exp.load_pseudograd(exp.list_pseudograds()[0])
    exp.store.write(marker, dump_json({**ref.manifest, "sha256": sha256(data)}))
    with pytest.raises(CorruptObject, match="exactly one checksum"):
        exp.load_pseudograd(exp.list_pseudograds()[0])

    head = _publish_v0(exp)
    manifest = exp.fragment_manifest(head)
    sums = {
        n: sha256(exp.store.read(f"exp/{head.dir}/{n}.safetensors"))
        for n in ("params", "outer_state")
    }
    legacy = {k: v for k, v in manifest.items() if k != "crc32c"} | {"sha256": sums}
    exp.store.write(f"exp/{head.dir}/manifest.json", dump_json(legacy))
    loaded = exp.load_fragment(exp.head(0), outer_state=True)
    assert sorted(loaded.params) == sorted(_fragment(0, 0.0))


def test_config_is_the_stored_config_parsed_and_checked():
    from tests.helpers import new_store, small_config
    from training.config.experiment import ConfigError

    cfg = small_config(name="typed")
    store = new_store(cfg)
    assert store.config() == cfg  # the typed config, validated
    raw = json.loads(store.store.read(store.object_key("config.json")))
    raw["inner"]["H"] = 0  # no longer a valid config (H >= 1)
    store.store.write(store.object_key("config.json"), json.dumps(raw).encode())
    with pytest.raises(ConfigError, match="invalid config"):
        store.config()
