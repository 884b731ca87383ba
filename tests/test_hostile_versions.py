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
3. NaN in a promotion whose checksums match (written through the store's own promote): the
   cold merger passes it over, replays from version 4 and merges the bits of a warm merger.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.gcs_fixture import BACKENDS, gcs_bucket  # noqa: F401  (fixture)
from tests.helpers import new_store, publish_delta, random_delta
from tests.test_light_versions import _cfg, _params_bits, _round
from training.island.process import Island
from training.merge.merger import Merger
from training.protocol import broadcast
from training.store.keys import promoted_payload


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


def _flip_update(store, version: int) -> None:
    head = store.find_version(0, version)
    key = store.object_key(f"{head.dir}/update.safetensors")
    data = bytearray(store.store.read(key))
    data[-1] ^= 1
    store.store.write(key, bytes(data))


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
    _flip_update(store, 6)
    head = store.head(0)
    got = broadcast.read_full(store, head, store.fragment_manifest(head), _shapes(merger))
    assert (got.how, got.updates) == ("full", 0)  # version 6's promoted shadow, no update
    want = merger._warm[0][3]  # the merger's shadow of version 6
    assert {n: v.tobytes() for n, v in got.tensors.items()} == {
        n: v.tobytes() for n, v in want.items()
    }


@pytest.mark.parametrize("kind", BACKENDS[1:])
def test_a_version_nothing_reads_is_passed_over_and_the_island_trains_on(
    kind, request, tmp_path, caplog
):
    cfg, store, merger = _experiment(kind, request, tmp_path, 6)
    _flip_update(store, 6)
    with caplog.at_level(logging.WARNING, logger="diloco.island"):
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
    named = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    # versions 6 and 7, each named once with the reason (6's update fails its checksum)
    assert [m.split(" does not read")[0].rsplit(" ", 1)[1] for m in named] == ["6", "7"]
    assert "crc32c" in named[0]


@pytest.mark.parametrize("kind", BACKENDS[1:])
def test_nan_in_a_promotion_is_passed_over_and_the_cold_start_replays(kind, request, tmp_path):
    cfg_a, warm, merger_a = _experiment(kind, request, tmp_path / "a", 6, "hvwarm")
    cfg_b, cold, merger_b = _experiment(kind, request, tmp_path / "b", 6, "hvcold")
    _, params, outer, shadow, _ = merger_b._warm[0]
    name = sorted(outer)[0]
    outer = {**outer, name: np.full_like(outer[name], np.nan)}
    head = cold.head(0)
    assert cold.promote_version(head, cold.fragment_manifest(head), params, outer, shadow)
    assert cold.load_promoted(head, cold.fragment_manifest(head)) is None  # passed over
    ticks = []
    fresh = Merger(cfg_b, cold)
    fresh.store.hit_fault = ticks.append
    _round(warm, cfg_a, merger_a, 6)
    _round(cold, cfg_b, fresh, 6)
    assert ticks.count("merge.cold-replay") == 2  # versions 5 and 6 replayed from 4
    assert _params_bits(warm, cfg_a) == _params_bits(cold, cfg_b)


def test_nan_in_a_promoted_shadow_is_not_what_an_island_reads(tmp_path, request):
    # the promoted shadow of 6 with NaN and valid checksums: reading 6 whole falls back to 4
    # and the updates of 5 and 6 (the same bits as the merger's shadow)
    cfg, store, merger = _experiment("file", request, tmp_path, 6)
    _, params, outer, shadow, _ = merger._warm[0]
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
