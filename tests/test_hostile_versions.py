"""One bad object stops no one (issue 37, items 1 and 2): a corrupted light version or promotion
is passed over, named once with its reason, and islands and merges keep going.

The experiment (tests/test_light_versions.py `_cfg`): k = 4 (versions 4, 8 full, the others
light), int4 with update broadcast, nesterov; islands a and b publish every round. On
`file://` and fake-gcs-server.

1. A flipped byte in HEAD 6's `update.safetensors`, HEAD 6 promoted: reading version 6 whole
   takes its own promotion (no update read), where it went back to full version 4 and died on
   update 6 (every island, every retry: exit 2).
2. The same byte flipped with no promotion anywhere: no representation of 6 (or of 7, whose
   chain runs through 6) reads; an island starting then takes version 5, one that holds 5 keeps
   it, names version 6 once, and adopts full version 8 when it comes.
   A cold merger replaying that chain names the update once and merges on (the replay matched
   the versions' params; the update is the islands' object).
3. NaN in a promotion whose checksums match (written through the store's own promote): the
   cold merger passes it over, replays from version 4 and merges the bits of a warm merger.
4. BEST or FINAL naming a copy of HEAD's directory (valid checksums) that no HEAD swap named:
   `diloco export` refuses it in one line, the finalize does not restore it.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from tests.gcs_fixture import BACKENDS, gcs_bucket  # noqa: F401  (fixture)
from tests.helpers import (
    flip_update_byte,
    new_store,
    promote_with_nan,
    publish_delta,
    random_delta,
    small_config,
)
from tests.test_light_versions import _cfg, _params_bits, _round
from training.island.process import Island
from training.merge.merger import Merger
from training.protocol import broadcast
from training.store.keys import promoted_payload
from training.store.tensors import checksum, tensor_parts


def _url(kind: str, request, tmp_path) -> str:
    if kind == "memory":
        return f"memory://hv-{tmp_path.name}"
    if kind == "file":
        return f"file://{tmp_path}/store"
    return f"{request.getfixturevalue('gcs_bucket')}/hv-{tmp_path.name}"


def _experiment(kind, request, tmp_path, rounds: int, name: str = "hv"):
    cfg = _cfg(4, name)
    store = new_store(cfg, _url(kind, request, tmp_path))
    merger = Merger(cfg, store)
    for r in range(rounds):
        _round(store, cfg, merger, r)
    return cfg, store, merger


def _warm_round(store, cfg, merger, r: int) -> None:
    """`_round` from the merger's own params of HEAD (a reader's replay of the tampered chain
    is what is under test, not the islands of this experiment)."""
    head, theta = store.head(0), merger._warm[0][1]
    for i, island in enumerate(("a", "b")):
        delta = random_delta(theta, 100 * r + i)
        publish_delta(store, cfg, island, r, delta, base_version=head.version)
    assert merger.merge_once().versions == {0: head.version + 1}


def _shapes(merger) -> dict:
    return {n: v.shape for n, v in merger._warm[0][1].items()}


@pytest.mark.parametrize("kind", BACKENDS[1:])
def test_a_flipped_update_byte_reads_from_the_versions_promotion(kind, request, tmp_path):
    cfg, store, merger = _experiment(kind, request, tmp_path, 6)
    assert merger.promote_heads() == [0]
    flip_update_byte(store, 6)
    head = store.head(0)
    got = broadcast.read_full(store, head, store.fragment_manifest(head), _shapes(merger))
    assert (got.how, got.updates) == ("full", 0)  # version 6's promoted shadow, no update
    want = merger._warm[0][3]  # the merger's shadow of version 6
    assert {n: v.tobytes() for n, v in got.tensors.items()} == {
        n: v.tobytes() for n, v in want.items()
    }


def test_a_cold_merger_passes_over_an_update_that_does_not_read_and_merges_on(
    tmp_path, request, caplog
):
    # HEAD 6 light (full 4), nothing promoted, one byte of version 5's update flipped: the
    # cold start replays 5 and 6 from 4, matches their params checksums, names 5's update once
    # and merges version 7 with the bits of a warm merger (the update is the islands' object)
    cfg_a, warm, merger_a = _experiment("file", request, tmp_path / "a", 6)
    cfg_b, cold, _ = _experiment("file", request, tmp_path / "b", 6)
    flip_update_byte(cold, 5)
    _round(warm, cfg_a, merger_a, 6)
    shapes = merger_a._warm[0][1]  # random_delta takes only the shapes from it
    for i, island in enumerate(("a", "b")):  # the deltas _round published on `warm`
        publish_delta(cold, cfg_b, island, 6, random_delta(shapes, 600 + i), base_version=6)
    with caplog.at_level(logging.WARNING, logger="training.merge.replay"):
        Merger(cfg_b, cold).merge_once()
    named = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(named) == 1 and "version 5: its stored update does not read" in named[0]
    assert "crc32c" in named[0]
    assert cold.head(0).version == 7
    assert _params_bits(cold, cfg_b) == _params_bits(warm, cfg_a)


@pytest.mark.parametrize("kind", BACKENDS[1:])
def test_a_version_nothing_reads_is_passed_over_and_the_island_trains_on(
    kind, request, tmp_path, caplog
):
    cfg, store, merger = _experiment(kind, request, tmp_path, 6)
    flip_update_byte(store, 6)
    with caplog.at_level(logging.INFO, logger="diloco.island"):
        island = Island(cfg, "a", store)  # it starts, adopts and steps (publishes no round)
        island.start()
        assert island.base_version == [5]  # the newest version that reads
        _warm_round(store, cfg, merger, 6)  # version 7: its chain runs through 6
        assert island.adopt([0]) == 0 and island.base_version == [5]
        island.adopter.pending.clear()
        assert island.adopt([0]) == 0  # asked again: passed over without a second read
        island.step()  # it trains on
        _warm_round(store, cfg, merger, 7)  # version 8: full
        assert island.adopt([0]) == 1 and island.base_version == [8]
    lines = [
        (r.levelno, r.getMessage()) for r in caplog.records if "does not read" in r.getMessage()
    ]
    version = [m.split(" does not read")[0].rsplit(" ", 1)[1] for _, m in lines]
    # version 6 named once with the reason (its update fails its checksum); version 7 fails on
    # the same object, so it only points back to that warning (INFO)
    assert list(zip([lv for lv, _ in lines], version, strict=True)) == [
        (logging.WARNING, "6"),
        (logging.INFO, "7"),
    ]
    assert "crc32c" in lines[0][1] and "either" in lines[1][1]


@pytest.mark.parametrize("kind", BACKENDS[1:])
def test_nan_in_a_promotion_is_passed_over_and_the_cold_start_replays(kind, request, tmp_path):
    cfg_a, warm, merger_a = _experiment(kind, request, tmp_path / "a", 6, "hvwarm")
    cfg_b, cold, merger_b = _experiment(kind, request, tmp_path / "b", 6, "hvcold")
    promote_with_nan(cold, merger_b)
    head = cold.head(0)
    assert cold.load_promoted(head, cold.fragment_manifest(head)) is None  # passed over
    ticks = []
    fresh = Merger(cfg_b, cold)
    cold.hit_fault = ticks.append
    _round(warm, cfg_a, merger_a, 6)
    _round(cold, cfg_b, fresh, 6)
    assert ticks.count("merge.cold-replay") == 2  # versions 5 and 6 replayed from 4
    assert _params_bits(warm, cfg_a) == _params_bits(cold, cfg_b)


def test_nan_in_a_promoted_shadow_is_not_what_an_island_reads(tmp_path, request):
    # the promoted shadow of 6 with NaN and valid checksums: reading 6 whole falls back to 4
    # and the updates of 5 and 6 (the same bits as the merger's shadow)
    cfg, store, merger = _experiment("file", request, tmp_path, 6)
    params, outer, shadow = merger._warm[0][1:4]
    name = sorted(shadow)[0]
    bad = {**shadow, name: np.full_like(shadow[name], np.nan)}
    head = store.head(0)
    assert store.promote_version(head, store.fragment_manifest(head), params, outer, bad)
    assert promoted_payload("shadow") in [k.rsplit("/", 1)[1] for k in store.list_keys(head.dir)]
    got = broadcast.read_full(store, head, store.fragment_manifest(head), _shapes(merger))
    assert (got.how, got.updates) == ("full", 2)
    assert {n: v.tobytes() for n, v in got.tensors.items()} == {
        n: v.tobytes() for n, v in shadow.items()
    }


# -- 3. pointers stay on the chain -------------------------------------------------------------


def _forged_pointer(store, which: str) -> str:
    """Copy HEAD's directory, files and checksums intact, to a directory of the same version
    that no HEAD swap ever named (`...-0badf00d`), and point `which` (BEST or FINAL) at it."""
    head = store.head(0)
    forged = f"{head.dir.rsplit('-', 1)[0]}-0badf00d"
    for key in store.list_keys(f"{head.dir}/"):
        data = store.store.read(store.object_key(key))
        store.store.write(store.object_key(forged + key[len(head.dir) :]), data)
    record = {"versions": [head.version], "dirs": [forged], "loss": 0.1, "tokens_merged": 1}
    store.write_json(f"snapshots/{which}.json", record)
    return forged


@pytest.mark.parametrize("which", ["BEST", "FINAL"])
def test_export_refuses_a_pointer_off_the_chain(which, tmp_path, capsys):
    from training import cli

    cfg = small_config("ptr", outer={"method": "nesterov"})
    url = f"file://{tmp_path}/store"
    store = new_store(cfg, url)
    publish_delta(store, cfg, "a", 0, random_delta(store.load_params(), 0))
    Merger(cfg, store).merge_all()
    forged = _forged_pointer(store, which)
    argv = ["export", "--store", url, "--experiment", "ptr", "--out", str(tmp_path / "out")]
    code = cli.main([*argv, "--snapshot", which.lower()])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "out").exists()
    assert f"{forged}, which is not a committed version on the fragment's chain" in err
    assert cli.main([*argv, "--snapshot", "head"]) == 0  # the chain itself exports


def test_finalize_passes_over_a_best_off_the_chain(tmp_path, caplog):
    from training.merge import replay
    from training.model.evaluate import finish_at_best

    cfg = small_config("ptr", outer={"method": "nesterov"})
    store = new_store(cfg, f"file://{tmp_path}/store")
    publish_delta(store, cfg, "a", 0, random_delta(store.load_params(), 0))
    Merger(cfg, store).merge_all()
    _forged_pointer(store, "BEST")
    final = {"loss": 5.0, "versions": [1]}
    with caplog.at_level(logging.WARNING, logger="diloco.eval"):
        out = finish_at_best(cfg, store, final, replay.arrays_of(cfg, store))
    assert out["restored"] is False and store.head(0).version == 1  # nothing restored
    assert any("BEST passed over" in r.getMessage() for r in caplog.records)


def test_a_promoted_outer_state_scaled_1000x_is_passed_over_and_the_cold_start_replays(
    tmp_path, request
):
    # finite, checksummed, and 1000x the momentum the version's merged norms allow (the bound:
    # norm_bounds.check_outer_state_bound): the cold merger replays 5 and 6 from version 4
    # instead and merges the bits of a merger that never saw the promotion
    cfg_a, warm, merger_a = _experiment("file", request, tmp_path / "a", 6, "hvwarm")
    cfg_b, cold, merger_b = _experiment("file", request, tmp_path / "b", 6, "hvcold")
    params, outer, shadow = merger_b._warm[0][1:4]
    outer = {n: v * np.float32(1000.0) for n, v in outer.items()}
    head = cold.head(0)
    assert cold.promote_version(head, cold.fragment_manifest(head), params, outer, shadow)
    ticks = []
    fresh = Merger(cfg_b, cold)
    cold.hit_fault = ticks.append
    _round(warm, cfg_a, merger_a, 6)
    _round(cold, cfg_b, fresh, 6)
    assert ticks.count("merge.cold-replay") == 2
    assert _params_bits(warm, cfg_a) == _params_bits(cold, cfg_b)


def test_promoted_params_that_are_not_the_versions_are_passed_over(tmp_path, request):
    # full.json names params whose checksum is their file's, not the light version's recorded
    # params_crc32c: load_promoted refuses them
    cfg, store, merger = _experiment("file", request, tmp_path, 6)
    params, outer, shadow = merger._warm[0][1:4]
    head = store.head(0)
    manifest = store.fragment_manifest(head)
    assert store.promote_version(head, manifest, params, outer, shadow)
    other = {n: v + np.float32(1.0) for n, v in params.items()}
    parts = tensor_parts(other)
    key = store.object_key(f"{head.dir}/{promoted_payload('params')}")
    store.store.write(key, b"".join(bytes(p) for p in parts))
    record = json.loads(store.store.read(store.object_key(f"{head.dir}/full.json")))
    record["crc32c"]["params"] = checksum(parts)
    store.store.write(store.object_key(f"{head.dir}/full.json"), json.dumps(record).encode())
    assert store.load_promoted(head, manifest) is None
