"""Light versions (`syncer.full_every` k > 1, docs/STORE.md "Light versions"): between full
versions a merge writes the broadcast update only (its params' checksum in the manifest;
params too without update broadcast or with outer.anchor "now"); a merger that starts cold
replays the merges since the nearest full version (training/merge/replay.py `state_at`),
checked bit for bit, and merges on with the bits of a merger that stayed warm; an island's
shadow at a light version is the merger's, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import new_store, publish_delta, random_delta, small_config, tamper_params
from training import cli
from training.config.experiment import parse_config
from training.config.sections import SyncerConfig
from training.merge import replay
from training.merge.merger import Merger
from training.protocol import broadcast
from training.store import merge_records as records
from training.store.layout import dump_json
from training.store.objectstore import CorruptObject
from training.store.tensors import checksum, tensor_parts
from training.store.versions import LightVersion


def _cfg(k: int, name: str = "light", background: bool = False, **outer):
    # nesterov: an outer momentum (the state a light version leaves out); int4 with update
    # broadcast (the default outer.broadcast "codec"): each version has an update and a shadow.
    # The merge writes the due full versions itself unless `background`
    # (tests/test_promotions.py has the background ones)
    return small_config(
        name,
        codec="int4",
        outer={"method": "nesterov", **outer},
        syncer={"full_every": k, "full_every_s": 0, "full_in_background": background},
    )


def _round(store, cfg, merger, r: int) -> int:
    """One merge: islands a and b publish (seq r) from HEAD's params, `merger` applies both."""
    head = store.head(0)
    theta = store.load_params(None, replay.params_of(cfg, store))
    for i, island in enumerate(("a", "b")):
        delta = random_delta(theta, 100 * r + i)
        publish_delta(store, cfg, island, r, delta, base_version=head.version)
    result = merger.merge_once()
    assert result.versions == {0: head.version + 1}
    return head.version + 1


def _run(k: int, rounds: int, name: str = "light", background: bool = False, **outer):
    cfg = _cfg(k, name, background, **outer)
    store = new_store(cfg)
    merger = Merger(cfg, store)
    for r in range(rounds):
        _round(store, cfg, merger, r)
    return cfg, store, merger


def _payloads(store, version: int) -> list[str]:
    """The payload names of fragment 0's `version` (from its manifest's nbytes)."""
    manifest = store.fragment_manifest(store.find_version(0, version))
    return sorted(manifest["nbytes"])


def test_with_k_4_versions_1_to_3_are_light_and_4_is_full():
    # k = 4: version v is full when v % 4 == 0 (and version 0 is); light versions hold the
    # update only (1 payload), full ones params, outer_state, update, shadow (4)
    _, store, _ = _run(4, 5)
    assert [_payloads(store, v) for v in range(1, 6)] == [
        ["update"],
        ["update"],
        ["update"],
        ["outer_state", "params", "shadow", "update"],
        ["update"],
    ]
    fives = store.fragment_manifest(store.head(0))
    four = store.find_version(0, 4)
    assert (fives["full"], fives["full_version"], fives["full_dir"]) == (False, 4, four.dir)
    assert "full" not in store.fragment_manifest(four)  # a full version: no field (as before)
    # the objects written: 5 versions, 1 + 1 + 1 + 4 + 1 = 8 payloads (k = 1: 5 x 4 = 20)
    payloads = [k for k in store.list_keys("fragments/f000/v") if k.endswith(".safetensors")]
    assert len(payloads) == 2 + 8  # version 0's params and outer state, then the merges'


def test_k_1_writes_every_version_full_as_before():
    _, store, _ = _run(1, 2)
    assert [_payloads(store, v) for v in (1, 2)] == [
        ["outer_state", "params", "shadow", "update"]
    ] * 2
    assert all("full" not in m for m in store.list_fragment_versions(0))


def _params_bits(store, cfg) -> dict[str, bytes]:
    return {
        n: v.tobytes() for n, v in store.load_params(None, replay.params_of(cfg, store)).items()
    }


def test_a_cold_merger_replays_5_and_6_from_full_4_and_merges_the_bits_of_a_warm_one():
    # the same inputs to a k = 1 run (every version full, the merger warm) and a k = 4 run
    # whose merger is replaced by a new one (nothing warm) at HEAD = 6: the new one loads full
    # version 4, re-applies 5 and 6, and its merge 7 writes the same params bits
    cfg1, warm, m1 = _run(1, 6, "warm")
    cfg4, cold, _ = _run(4, 6, "cold")
    assert _params_bits(warm, cfg1) == _params_bits(cold, cfg4)
    ticks = []
    fresh = Merger(cfg4, cold)
    cold.hit_fault = ticks.append  # the cold replay's fault point, once per version
    _round(warm, cfg1, m1, 6)
    _round(cold, cfg4, fresh, 6)
    assert ticks.count("merge.cold-replay") == 2  # versions 5 and 6
    assert _params_bits(warm, cfg1) == _params_bits(cold, cfg4)
    # and the shadows (what islands adopt) too: version 7's update bytes are the same
    got = [s.load_payload(s.head(0), "update") for s in (warm, cold)]
    assert {n: v.tobytes() for n, v in got[0].items()} == {
        n: v.tobytes() for n, v in got[1].items()
    }


def _cold_start_error(cfg, store, theta) -> str:
    """The one line a cold merger stops with at HEAD 6 (light, full 4), given work to merge
    (a delta on `theta`, the params a warm merger holds)."""
    head = store.head(0)
    publish_delta(store, cfg, "a", 6, random_delta(theta, 7), base_version=head.version)
    with pytest.raises(replay.ColdStartMismatch) as err:
        Merger(cfg, store).merge_once()
    assert store.head(0).version == 6  # nothing merged on a state it cannot trust
    return str(err.value)


def test_a_tampered_light_update_stops_a_cold_start_with_one_line_naming_it():
    cfg, store, merger = _run(4, 6)
    name, index = tamper_params(store, 0, 5, "update")
    assert _cold_start_error(cfg, store, merger._warm[0][1]) == (
        f"fragment 0: cold start stopped (DIFFERS): version 5 (light, from full 4): "
        f"update/{name}: max abs diff 1, first at index {index}"
    )


def test_a_tampered_params_crc32c_stops_a_cold_start_with_one_line_naming_it():
    cfg, store, merger = _run(4, 6)
    five = store.find_version(0, 5)
    manifest = store.fragment_manifest(five)
    good, size = manifest["params_crc32c"], manifest["params_nbytes"]
    bad = f"{int(good, 16) ^ 1:08x}"  # the lowest bit flipped
    manifest["params_crc32c"] = bad
    store.store.write(store.object_key(f"{five.dir}/manifest.json"), dump_json(manifest))
    assert _cold_start_error(cfg, store, merger._warm[0][1]) == (
        f"fragment 0: cold start stopped (DIFFERS): version 5 (light, from full 4): "
        f"params: crc32c {good} ({size} bytes), recorded {bad} ({size} bytes)"
    )


def _index(cfg, name, flat):
    from training.model import definition as model

    shape = model.abstract_params(cfg.model)[name].shape
    return [int(i) for i in np.unravel_index(flat, shape)]


def test_an_islands_shadow_at_a_light_version_equals_the_mergers_bit_for_bit():
    # a joining island reads version 6 (light) whole: full 4's shadow plus updates 5 and 6;
    # the merger holds S_6 in its warm set
    cfg, store, merger = _run(4, 6)
    head = store.head(0)
    manifest = store.fragment_manifest(head)
    want = merger._warm[0][3]
    shapes = {n: tuple(v.shape) for n, v in want.items()}
    got = broadcast.read_full(store, head, manifest, shapes)
    assert (got.how, got.updates) == ("full", 2)
    assert {n: v.tobytes() for n, v in got.tensors.items()} == {
        n: v.tobytes() for n, v in want.items()
    }


def test_an_island_holding_s5_follows_light_version_6_by_its_update():
    # version 6 holds no params: the size a whole read would cost is its params_nbytes, so
    # one int4 update (about 1/8 of it) is taken, not S_6 read whole
    cfg, store, merger = _run(4, 5)
    five = store.head(0)
    # a copy: the next merge updates the merger's shadow in place
    held = broadcast.Shadow(5, five.dir, {n: v.copy() for n, v in merger._warm[0][3].items()})
    _round(store, cfg, merger, 5)
    head = store.head(0)
    shapes = {n: tuple(v.shape) for n, v in held.tensors.items()}
    got = broadcast.fetch(store, head, store.fragment_manifest(head), held, "int4", shapes)
    assert (got.how, got.updates) == ("updates", 1)
    assert _bits(got.tensors) == _bits(merger._warm[0][3])


def test_diloco_replay_carries_the_state_across_light_versions():
    cfg, store, _ = _run(4, 6)
    lines = []
    assert replay.run(cfg, store, 0, None, 1, False, lines.append) == 0
    assert lines[-1] == "replayed 6 version(s): all bit-exact"
    lines = []  # from version 6: v5 light, replayed forward from full 4 first
    assert replay.run(cfg, store, 0, None, 6, False, lines.append) == 0
    assert lines == ["fragment 0 version 6 (2 applied): ok", "replayed 1 version(s): all bit-exact"]


def test_the_manifest_parser_refuses_a_light_version_without_a_full_ancestor():
    _, store, _ = _run(4, 2)
    manifest = dict(store.fragment_manifest(store.head(0)))
    parse = lambda m: records.parse_fragment_manifest(dump_json(m), "light", 0, 2)  # noqa: E731
    assert parse(manifest).full_at == (0, manifest["full_dir"])
    for bad in (
        {"full": "no"},
        {"full_version": 2},  # not below the version itself
        {"full_dir": manifest["parent_dir"]},  # version 1's directory, named as version 0's
        {"full": True},  # a full version naming a full ancestor
    ):
        with pytest.raises(CorruptObject):
            parse({**manifest, **bad})
    del manifest["full_version"]
    with pytest.raises(CorruptObject):
        parse(manifest)


def test_full_every_is_a_described_config_field_defaulting_to_every_eighth_version():
    # the default (not small_config's pin of 1): a full version every 8 merges or 600 s
    fields = SyncerConfig.model_fields
    assert (fields["full_every"].default, fields["full_every_s"].default) == (8, 600.0)
    assert fields["full_every"].description and fields["full_every_s"].description
    cfg = small_config()
    with pytest.raises(ValueError):
        parse_config({**cfg.model_dump(mode="json"), "syncer": {"full_every": 0}})


def test_a_restore_of_a_light_version_replays_its_outer_state_and_is_full():
    # BEST at light version 5 (no params, no outer state stored): the restore (version 7)
    # holds the params and the outer momentum a k = 1 run of the same inputs stored at 5
    cfg, store, _ = _run(4, 6, "restore")
    _, ref, _ = _run(1, 6, "ref")
    five = store.find_version(0, 5)
    snapshot = store.snapshot_of({"versions": [5], "dirs": [five.dir], "tokens_merged": 0})
    with pytest.raises(LightVersion):
        store.restore_snapshot(snapshot, "test")  # no way to its outer state: refused
    store.restore_snapshot(snapshot, "test", replay.arrays_of(cfg, store))
    head = store.head(0)
    restored = store.load_fragment(head, outer_state=True)
    want = ref.load_fragment(ref.find_version(0, 5), outer_state=True)
    assert head.version == 7 and "full" not in restored.manifest
    assert [_bits(restored.params), _bits(restored.outer_state)] == [
        _bits(want.params),
        _bits(want.outer_state),
    ]
    lines = []
    assert replay.run(cfg, store, 0, None, 1, False, lines.append) == 0, lines


def test_gc_keeps_what_the_kept_light_head_replays_from():
    # HEAD 7 is light, its full ancestor 4. keep_last 1 keeps HEAD and version 0; HEAD's
    # replay needs 4 (full state), 5 and 6 (params, updates) and the contributions of 5-7
    # (a, b seqs 4-6); those of versions 1-4 (seqs 0-3) go, with versions 1-3's payloads
    cfg, store, _ = _run(4, 7, "gc")
    plan = store.plan_gc(keep_last=1)
    assert plan.protected == {0: [0, 4, 5, 6, 7]}
    assert sorted(plan.pseudograds) == sorted(f"{i}/{s:08d}-f000" for i in "ab" for s in range(4))
    store.collect_garbage(plan)
    _round(store, cfg, Merger(cfg, store), 7)  # a cold merger still starts (from full 4)
    assert store.head(0).version == 8


def killed_merge(tmp_path, faults: str, background: bool = False):
    """HEAD 3 (k = 4) on a file:// store with round 3 published by islands a and b; a `diloco
    merge` process run with DILOCO_FAULTS=`faults` must SIGKILL itself. (cfg, store, url)."""
    cfg = _cfg(4, "kill", background)
    url = f"file://{tmp_path}/store"
    store = new_store(cfg, url)
    merger = Merger(cfg, store)
    for r in range(3):
        _round(store, cfg, merger, r)
    theta = merger._warm[0][1]
    for i, island in enumerate(("a", "b")):
        publish_delta(store, cfg, island, 3, random_delta(theta, 300 + i), base_version=3)
    env = dict(os.environ, DILOCO_FAULTS=faults, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "training.cli", "merge", "--store", url, "--experiment", "kill"]
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    return cfg, store, url


def test_a_cold_start_killed_mid_replay_then_rerun_applies_each_contribution_once(tmp_path):
    # HEAD 3 light (full 0); a `diloco merge` process starts cold, replays version 1, dies at
    # the second replayed version; the rerun replays 1-3 again and merges round 3 once
    cfg, store, url = killed_merge(tmp_path, "merge.cold-replay@2")
    assert store.head(0).version == 3  # killed before it merged anything
    assert cli.main(["merge", "--store", url, "--experiment", "kill"]) == 0
    chain = store.list_fragment_versions(0)
    assert [m["version"] for m in chain] == [0, 1, 2, 3, 4]
    flat = [pg for m in chain for pg in m["applied"]]
    assert sorted(flat) == sorted(f"{i}/{s:08d}-f000" for i in "ab" for s in range(4))
    assert store.applied() == {pg: m["version"] for m in chain for pg in m["applied"]}
    assert "full" not in chain[-1]  # version 4: full


def _is_full(store) -> bool:
    return "full" not in store.fragment_manifest(store.head(0))


def test_a_merge_after_stop_is_full():
    # k = 4: version 1 would be light; control/STOP (the end of a run) makes it full
    cfg, store, merger = _run(4, 1, "stop")
    assert not _is_full(store)
    store.request_stop(reason="user")
    _round(store, cfg, merger, 1)
    assert _is_full(store)


def test_the_merge_that_reaches_the_budget_and_those_after_it_are_full():
    # k = 4, two islands of 512 tokens a merge: version 1 has 1,024 tokens (light), version 2
    # reaches the 2,048-token budget (full: a run that ends there ends on a full version, even
    # with nothing left to merge after it), version 3 is past it (full)
    cfg = small_config(
        "budget",
        codec="int4",
        outer={"method": "nesterov"},
        syncer={"full_every": 4, "full_every_s": 0},
        token_budget=2048,
    )
    store = new_store(cfg)
    merger = Merger(cfg, store)
    fulls = []
    for r in range(3):
        _round(store, cfg, merger, r)
        fulls.append(_is_full(store))
    assert fulls == [False, True, True]
    assert store.stop_requested()  # the merge of version 2 asked the islands to stop


def test_the_syncers_last_drain_writes_full_versions():
    cfg, store, merger = _run(4, 0, "drain")
    merger.full_always = True  # what ShardSyncer._last_drain sets
    _round(store, cfg, merger, 0)
    assert _is_full(store)


def test_full_every_s_makes_a_version_full_once_that_long_passed():
    # k = 100 (by count, version 100 would be the first full one); full_every_s = 1e-6: by the
    # second merge more than a microsecond passed since version 0 was written
    cfg = small_config(
        "timed",
        codec="int4",
        outer={"method": "nesterov"},
        syncer={"full_every": 100, "full_every_s": 1e-6, "full_in_background": False},
    )
    store = new_store(cfg)
    _round(store, cfg, Merger(cfg, store), 0)
    assert _is_full(store)


def test_gc_keeps_the_base_a_replayed_merge_reanchored_a_stale_vote_at():
    # outer.anchor = "now", k = 4: island c publishes once from version 1; version 6 (light,
    # full ancestor 4) applies it with staleness 4 (parent 5 - base 1), re-anchored at the
    # fragment now, so the merge read version 1's params. keep_last 1 keeps HEAD 6 and what its
    # replay reads: 4, 5, 6 and base 1 (without it a cold start stops: base 1 was collected)
    cfg = small_config(
        "gc-now",
        islands=("a", "b", "c"),
        codec="int4",
        outer={"method": "nesterov", "anchor": "now"},
        syncer={"full_every": 4, "full_every_s": 0},
    )
    store = new_store(cfg)
    merger = Merger(cfg, store)
    for r in range(5):
        _round(store, cfg, merger, r)
        if r == 0:
            stale = random_delta(store.load_fragment(store.find_version(0, 1)).params, 7)
    publish_delta(store, cfg, "c", 0, stale, base_version=1)
    _round(store, cfg, merger, 5)
    (record,) = [
        c for c in store.fragment_manifest(store.head(0))["contributions"] if c["island"] == "c"
    ]
    assert (store.head(0).version, record["staleness"], record["reanchored"]) == (6, 4, True)
    plan = store.plan_gc(keep_last=1)
    assert plan.protected == {0: [0, 1, 4, 5, 6]}
    store.collect_garbage(plan)
    _round(store, cfg, Merger(cfg, store), 6)  # a cold merger replays 5 and 6 from full 4
    assert store.head(0).version == 7


def _bits(tensors) -> dict[str, bytes]:
    return {n: v.tobytes() for n, v in tensors.items()}


def _files(store, version: int) -> list[str]:
    """The object names in fragment 0's version `version` directory."""
    directory = store.find_version(0, version).dir
    return sorted(k.rsplit("/", 1)[1] for k in store.list_keys(f"{directory}/"))


def test_a_light_version_under_update_broadcast_has_no_params_object():
    _, store, _ = _run(4, 5)
    assert [_files(store, v) for v in (3, 4)] == [
        ["manifest.json", "update.safetensors"],
        [
            "manifest.json",
            "outer_state.safetensors",
            "params.safetensors",
            "shadow.safetensors",
            "update.safetensors",
        ],
    ]


def test_a_light_versions_params_crc32c_is_that_of_the_warm_mergers_params():
    # the merger holds version 3's params warm; the manifest records the crc32c and size of
    # the safetensors payload they make (tensors.tensor_parts, as a full version's params)
    _, store, merger = _run(4, 3)
    manifest = store.fragment_manifest(store.head(0))
    parts = tensor_parts(merger._warm[0][1])
    assert (manifest["params_crc32c"], manifest["params_nbytes"]) == (
        checksum(parts),
        sum(len(p) for p in parts),
    )


def test_load_params_of_a_light_snapshot_is_the_warm_mergers_params_bit_for_bit():
    # what evaluation, export and sample read (store.load_params with replay.params_of)
    cfg, store, merger = _run(4, 6)
    snapshot = store.current_snapshot()
    assert snapshot.versions == (6,)
    got = store.load_params(snapshot, replay.params_of(cfg, store))
    assert _bits(got) == _bits(merger._warm[0][1])


def test_load_params_of_a_light_snapshot_without_replay_is_refused():
    cfg, store, _ = _run(4, 1)
    with pytest.raises(LightVersion, match="light version without params"):
        store.load_params()


@pytest.mark.parametrize(
    "outer", [{"anchor": "now"}, {"broadcast": "fp32"}], ids=["anchor-now", "fp32"]
)
def test_a_light_version_keeps_its_params_where_readers_need_them(outer):
    # anchor "now" reads stale votes' base versions' params; fp32 broadcast: islands read
    # params whole (no update)
    _, store, _ = _run(4, 1, **outer)
    manifest = store.fragment_manifest(store.head(0))
    assert "params" in manifest["nbytes"] and "params_crc32c" not in manifest


def test_the_manifest_parser_refuses_hostile_params_checksum_fields():
    _, store, _ = _run(4, 2)
    manifest = dict(store.fragment_manifest(store.head(0)))
    parse = lambda m: records.parse_fragment_manifest(dump_json(m), "light", 0, 2)  # noqa: E731
    assert parse(manifest).params_sum == (manifest["params_crc32c"], manifest["params_nbytes"])
    full = dict(store.fragment_manifest(store.find_version(0, 0)))
    without = {k: v for k, v in manifest.items() if k != "params_nbytes"}
    bad = [
        {**manifest, "params_crc32c": "XYZ"},  # not 8 lowercase hex
        {**manifest, "params_crc32c": 12345678},
        {**manifest, "params_nbytes": -1},
        {**manifest, "params_nbytes": "10"},
        without,  # one of the two
        {**manifest, "crc32c": {**manifest["crc32c"], "params": "00000000"}},  # and a payload
    ]
    for m in bad:
        with pytest.raises(CorruptObject):
            parse(m)
    with pytest.raises(CorruptObject):  # on a full version (it holds its params)
        records.parse_fragment_manifest(
            dump_json({**full, "params_crc32c": "00000000", "params_nbytes": 8}), "light", 0, 0
        )
