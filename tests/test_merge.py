"""The merger: exactly-once application, the FedAvg identity, policies and quarantine."""

import numpy as np
import pytest

from tests.helpers import (
    FakeClock,
    new_store,
    publish_delta,
    publish_payload,
    random_delta,
    small_config,
)
from training.codecs import host as codecs
from training.merge.merger import Merger
from training.protocol.pseudograd import delta


def _applied_lists(store):
    return [v["applied"] for v in store.list_fragment_versions(0)]


def test_sync_merge_with_outer_sgd_lr1_averages_island_parameters():
    """End-to-end sign check: islands' params -> pseudo-gradients -> merge == their average."""
    cfg = small_config(outer={"method": "sync", "lr": 1.0, "momentum": 0.0})
    store = new_store(cfg)
    theta = store.load_params()
    islands = {
        i: {k: v + d for k, v in theta.items() for d in [random_delta(theta, n)[k]]}
        for n, i in enumerate(["a", "b"])
    }
    for i, params in islands.items():
        publish_delta(store, cfg, i, 0, {k: delta(theta[k], v) for k, v in params.items()})
    r = Merger(cfg, store).merge_once()
    assert r.version == 1 and len(r.applied) == 2
    new = store.load_params()
    for k in theta:
        np.testing.assert_allclose(new[k], (islands["a"][k] + islands["b"][k]) / 2, atol=1e-6)


def test_sync_waits_for_every_island():
    cfg = small_config(outer={"method": "sync"})
    store = new_store(cfg)
    theta = store.load_params()
    publish_delta(store, cfg, "a", 0, random_delta(theta, 0))
    assert Merger(cfg, store).merge_once().version is None
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1))
    assert Merger(cfg, store).merge_once().version == 1


def test_each_pseudo_gradient_is_applied_once():
    cfg = small_config(outer={"method": "nesterov"})
    store = new_store(cfg)
    theta = store.load_params()
    for seq in range(3):
        publish_delta(store, cfg, "a", seq, random_delta(theta, seq))
    merger = Merger(cfg, store)
    assert len(merger.merge_once().applied) == 3
    again = merger.merge_once()
    assert again.version is None and again.applied == []
    assert sorted(sum(_applied_lists(store), [])) == [f"a/0000000{i}-f000" for i in range(3)]


def test_crash_between_head_swap_and_ledger_is_repaired_without_reapplying():
    cfg = small_config(outer={"method": "nesterov"})
    store = new_store(cfg)
    theta = store.load_params()
    publish_delta(store, cfg, "a", 0, random_delta(theta, 0))
    merger = Merger(cfg, store)
    real_settle = store.settle_ledger  # what publish_fragment records the ledger with
    store.settle_ledger = lambda fragment, ids, version: None  # it "dies" before the ledger
    assert merger.merge_once().version == 1
    store.settle_ledger = real_settle
    assert store.applied() == {}
    r = merger.merge_once()  # a new attempt repairs the ledger from HEAD first
    assert r.version is None
    assert store.applied() == {"a/00000000-f000": 1}


def test_two_mergers_racing_from_the_same_head_apply_once():
    cfg = small_config(outer={"method": "nesterov"})
    store = new_store(cfg)
    theta = store.load_params()
    publish_delta(store, cfg, "a", 0, random_delta(theta, 0))
    m1, m2 = Merger(cfg, store), Merger(cfg, store)
    head = store.head(0)
    real_head, real_record = store.head, store.record_applied
    store.head = lambda p: head  # both read the same head before either publishes
    store.record_applied = lambda ids, version: None  # and both list before any ledger write
    r1 = m1.merge_once()
    r2 = m2.merge_once()
    store.head, store.record_applied = real_head, real_record
    assert r1.version == 1 and r2.lost_race
    assert m2.merge_once().version is None  # after the race: nothing left to apply
    assert sum(_applied_lists(store), []) == ["a/00000000-f000"]


def test_decoupled_merges_at_quorum_when_grace_is_zero():
    cfg = small_config(
        outer={"method": "decoupled", "quorum": 1, "grace_min_steps": 0.0}, inner={"tau": 0}
    )
    store = new_store(cfg)
    theta = store.load_params()
    publish_delta(store, cfg, "a", 0, random_delta(theta, 0))
    r = Merger(cfg, store, clock=lambda: 0.0).merge_once()
    assert r.version == 1 and r.applied == ["a/00000000-f000"]


def test_decoupled_waits_inside_the_grace_window():
    # tau 4 steps x step_time 1 s, gamma 0.5: grace = 0.5 * (4 * 1 - 0 - sync) <= 2 s
    cfg = small_config(
        outer={"method": "decoupled", "grace_gamma": 0.5, "grace_min_steps": 0.0},
        inner={"tau": 4},
    )
    store = new_store(cfg)
    theta = store.load_params()
    publish_delta(store, cfg, "a", 0, random_delta(theta, 0))  # published_at 0.0
    waiting = Merger(cfg, store, clock=lambda: 0.5).merge_once()
    assert waiting.version is None and 0.5 < waiting.waiting_until <= 2.0
    assert Merger(cfg, store, clock=lambda: 2.5).merge_once().version == 1


def _floor_merger(t: float):
    """tau 0 (the adaptive window is 0: the syncer is "too slow"), grace_min_steps 2, islands
    a and b; a has published (published_at 0.0, step_time 1 s); the merger's clock at `t`."""
    cfg = small_config(outer={"method": "decoupled", "grace_min_steps": 2.0}, inner={"tau": 0})
    store = new_store(cfg)
    theta = store.load_params()
    clock = FakeClock(t)
    publish_delta(store, cfg, "a", 0, random_delta(theta, 0))
    return cfg, store, theta, clock, Merger(cfg, store, clock=clock)


def test_the_grace_floor_waits_two_steps_for_an_island_of_the_same_round():
    # the floor: 2 x step_time 1 s = 2 s after the merger first saw a (t = 1.0)
    cfg, store, theta, clock, merger = _floor_merger(1.0)
    assert merger.merge_once().waiting_until == 3.0
    clock.t = 2.5
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1))  # inside the window
    merged = merger.merge_once()
    assert sorted(merged.applied) == ["a/00000000-f000", "b/00000000-f000"]
    assert merged.versions == {0: 1}  # one outer step for both


def test_the_grace_floor_counts_from_the_first_sight_not_the_publish():
    # a published at 0.0, seen at 10.0 (a slow upload): the floor still waits 2 x 1 s from
    # 10.0 (the adaptive window alone, from the publish, would have merged at once)
    _, _, _, clock, merger = _floor_merger(10.0)
    assert merger.merge_once().waiting_until == 12.0
    clock.t = 11.9
    assert merger.merge_once().waiting_until == 12.0  # the same window, not a new one
    clock.t = 12.0
    assert merger.merge_once().applied == ["a/00000000-f000"]  # b never came: a alone


def test_token_weights_favor_the_island_with_more_tokens():
    # weights tokens^2/steps: a = 1000^2/8, b = 400^2/8 (within the 8x weight cap)
    cfg = small_config(outer={"method": "decoupled", "lr": 1.0, "momentum": 0.0, "rda": False})
    store = new_store(cfg)
    theta = store.load_params()
    one = {k: np.ones_like(v) for k, v in theta.items()}
    publish_delta(store, cfg, "a", 0, one, tokens=1000, steps=8)
    publish_delta(store, cfg, "b", 0, {k: -v for k, v in one.items()}, tokens=400, steps=8)
    Merger(cfg, store, clock=lambda: 1e9).merge_once()
    new = store.load_params()
    k = "blocks/0/mlp_up/kernel"
    # delta = (1 * w_a - 1 * w_b) / (w_a + w_b) = (1000^2 - 400^2) / (1000^2 + 400^2) = 0.724138
    np.testing.assert_allclose(theta[k] - new[k], 840 / 1160, rtol=1e-5)


def test_a_weight_over_8x_the_others_is_capped():
    # weights a = 1024^2/8 = 131072, b = 100^2/8 = 1250: a is capped at 8 x 1250 = 10000
    cfg = small_config(outer={"method": "decoupled", "lr": 1.0, "momentum": 0.0, "rda": False})
    store = new_store(cfg)
    theta = store.load_params()
    one = {k: np.ones_like(v) for k, v in theta.items()}
    publish_delta(store, cfg, "a", 0, one, tokens=1024, steps=8)
    publish_delta(store, cfg, "b", 0, {k: -v for k, v in one.items()}, tokens=100, steps=8)
    Merger(cfg, store, clock=lambda: 1e9).merge_once()
    new = store.load_params()
    k = "blocks/0/mlp_up/kernel"
    # delta = (10000 - 1250) / (10000 + 1250) = 0.777778 (uncapped it would be 0.981107)
    np.testing.assert_allclose(theta[k] - new[k], 8750 / 11250, rtol=1e-5)


def _anchor_config(anchor: str):
    """Plain outer SGD at lr 1, one contribution per merge, nothing rescaled."""
    outer = {"method": "decoupled", "lr": 1.0, "momentum": 0.0, "rda": False}
    return small_config(
        outer={**outer, "partial_scaling": False, "grace_min_steps": 0.0, "anchor": anchor}
    )


def _stale_pair(anchor: str):
    """Island a's delta merged as version 1, then island b's, computed against version 0
    (staleness 1)."""
    cfg = _anchor_config(anchor)
    store = new_store(cfg)
    theta = store.load_params()
    da, db = random_delta(theta, 0), random_delta(theta, 1)
    merger = Merger(cfg, store, clock=lambda: 1e9)
    publish_delta(store, cfg, "a", 0, da)
    assert merger.merge_once().version == 1
    publish_delta(store, cfg, "b", 0, db, base_version=0)
    assert merger.merge_once().version == 2
    return store, theta, da, db


@pytest.mark.parametrize("anchor", ["base", "now"])
def test_a_stale_contribution_is_anchored_where_outer_anchor_says(anchor):
    # v1 = theta - da. base: v2 = v1 - db = theta - da - db (a's progress kept).
    # now: v2 = v1 - (db + v1 - theta) = theta - db, b's own parameters (appendix D.2's rule).
    store, theta, da, db = _stale_pair(anchor)
    new = store.load_params()
    for k in theta:
        want = theta[k] - db[k] - (da[k] if anchor == "base" else 0)
        np.testing.assert_allclose(new[k], want, atol=1e-6, err_msg=k)


def test_anchor_now_falls_back_to_the_base_anchor_when_the_base_is_unreadable():
    cfg = _anchor_config("now")
    store = new_store(cfg)
    theta = store.load_params()
    da, db = random_delta(theta, 0), random_delta(theta, 1)
    merger = Merger(cfg, store, clock=lambda: 1e9)
    publish_delta(store, cfg, "a", 0, da)
    merger.merge_once()
    base = store.find_version(0, 0)
    store.store.delete(
        store.object_key(f"{base.dir}/params.safetensors")
    )  # version 0's payload gone
    publish_delta(store, cfg, "b", 0, db, base_version=0)
    assert merger.merge_once().applied == ["b/00000000-f000"]
    k = "blocks/0/mlp_up/kernel"
    np.testing.assert_allclose(store.load_params()[k], theta[k] - da[k] - db[k], atol=1e-6)


def _hostile(store, cfg, theta, kind):
    good = random_delta(theta, 7)
    if kind == "shape":
        bad = dict(good, **{"blocks/0/mlp_up/kernel": np.zeros((3, 3), np.float32)})
        return publish_delta(store, cfg, "a", 0, bad)
    if kind == "tree":
        bad = dict(good)
        bad.pop("blocks/0/mlp_up/kernel")
        return publish_delta(store, cfg, "a", 0, bad)
    if kind == "nan":  # committed with its checksum: only the merger's own check can catch it
        payload, _ = codecs.encode(good, cfg.codec)
        payload["blocks/0/mlp_up/kernel"][0, 0] = np.nan
        return publish_payload(store, cfg, "a", 0, payload)
    if kind == "corrupt":  # the payload changed after its commit: the checksum catches it
        ref = publish_delta(store, cfg, "a", 0, good)
        payload = {k: v.copy() for k, v in good.items()}
        payload["blocks/0/mlp_up/kernel"][0, 0] = np.nan
        from training.store.tensors import encode_tensors

        store.store.write(store.object_key(ref.payload_key), encode_tensors(payload))
        return ref
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("shape", "wrong shape"),
        ("tree", "wrong tree"),
        ("nan", "non-finite values"),
        ("corrupt", "unreadable payload"),
    ],
)
def test_hostile_pseudo_gradients_are_quarantined_and_merging_goes_on(kind, reason):
    cfg = small_config(outer={"method": "nesterov"})
    store = new_store(cfg)
    theta = store.load_params()
    bad = _hostile(store, cfg, theta, kind)
    publish_delta(store, cfg, "b", 0, random_delta(theta, 1))
    r = Merger(cfg, store).merge_once()
    assert r.applied == ["b/00000000-f000"]
    assert reason in store.quarantined()[bad.id]


def test_a_contribution_staler_than_max_staleness_is_quarantined():
    cfg = small_config(outer={"method": "nesterov", "max_staleness": 1})
    store = new_store(cfg)
    theta = store.load_params()
    merger = Merger(cfg, store)
    for seq in range(3):
        publish_delta(store, cfg, "a", seq, random_delta(theta, seq), base_version=0)
        merger.merge_once()
    # island a's seq 2 was based on version 0 while head was 2: staleness 2 > 1
    assert "stale" in store.quarantined()["a/00000002-f000"]


def test_replayed_sequence_number_is_never_listed_nor_applied():
    cfg = small_config(outer={"method": "nesterov"})
    store = new_store(cfg)
    theta = store.load_params()
    merger = Merger(cfg, store)
    publish_delta(store, cfg, "a", 5, random_delta(theta, 0))
    merger.merge_once()
    # island a is merged up to seq 5 (the fragment's cursor); a seq-3 commit appearing later is
    # a replay: the merger's listing starts after the cursor, so it is never even read
    publish_delta(store, cfg, "a", 3, random_delta(theta, 1), base_version=1)
    assert merger.pending() == {0: []}
    assert merger.merge_once().applied == []


def test_a_merger_reuses_the_arrays_of_the_version_it_published():
    """Its next merge of that fragment reads neither params nor outer state from the store and
    gives the bits a fresh merger (reading and verifying them) gives; after another writer
    moved HEAD it reads the store again."""
    cfg = small_config(outer={"method": "nesterov"})
    stores = [new_store(cfg), new_store(cfg)]
    mergers = [Merger(cfg, s) for s in stores]
    theta = stores[0].load_params()
    for s, m in zip(stores, mergers, strict=True):
        publish_delta(s, cfg, "a", 0, random_delta(theta, 0))
        assert m.merge_once().version == 1
        publish_delta(s, cfg, "a", 1, random_delta(theta, 1), base_version=1)
    real = stores[0].load_fragment
    stores[0].load_fragment = lambda *a, **k: pytest.fail("read what it published itself")
    assert mergers[0].merge_once().version == 2
    stores[0].load_fragment = real
    assert Merger(cfg, stores[1]).merge_once().version == 2  # cold: reads and verifies
    for k, v in stores[0].load_params().items():
        np.testing.assert_array_equal(v, stores[1].load_params()[k])
    publish_delta(stores[0], cfg, "a", 2, random_delta(theta, 2), base_version=2)
    assert Merger(cfg, stores[0]).merge_once().version == 3  # another writer moves HEAD
    publish_delta(stores[0], cfg, "a", 3, random_delta(theta, 3), base_version=3)
    calls = []
    stores[0].load_fragment = lambda *a, **k: calls.append(1) or real(*a, **k)
    assert mergers[0].merge_once().version == 4 and calls == [1]


def test_a_warm_merge_carries_its_norms_and_gives_a_cold_merges_bits(monkeypatch):
    """The params norm comes from the outer step that wrote them and the averaging step's norm
    from the last vote's fold (no pass over either): the bits of a fresh merger, which reads
    the version back and computes both by a pass (int4 votes of two islands, RDA)."""
    from training.merge import stream as merge_stream

    cfg = small_config(codec="int4", outer={"method": "decoupled", "quorum": 2})
    stores = [new_store(cfg), new_store(cfg)]
    warm = Merger(cfg, stores[0])
    theta = stores[0].load_params()
    real, passes = merge_stream.chunk_sq_of, []

    def counted(*args, **kwargs):
        passes.append(1)
        return real(*args, **kwargs)

    for version in range(3):
        for s in stores:
            for n, island in enumerate("ab"):
                delta = random_delta(theta, 10 * version + n)
                publish_delta(s, cfg, island, version, delta, base_version=version)
        passes.clear()
        monkeypatch.setattr(merge_stream, "chunk_sq_of", counted)
        assert len(warm.merge_once().applied) == 2
        monkeypatch.setattr(merge_stream, "chunk_sq_of", real)
        # version 0 is read (its norm by a pass); then the merger's own versions: none
        assert passes == ([1] if version == 0 else [])
        assert len(Merger(cfg, stores[1]).merge_once().applied) == 2  # cold: reads, passes
        want = stores[1].load_params()
        for k, v in stores[0].load_params().items():
            assert v.tobytes() == want[k].tobytes(), (version, k)


def test_a_merger_reads_its_payloads_into_the_same_buffers_merge_after_merge(tmp_path):
    """file:// reads into the merger's pool (training/store/buffers.py): the second merge of
    two contributions takes the first merge's two buffers again, and gives the bits a fresh
    merger gives (its own new buffers)."""
    cfg = small_config(codec="int8", outer={"method": "decoupled", "quorum": 2})
    stores = [new_store(cfg, f"file://{tmp_path}/{k}") for k in ("pool", "fresh")]
    merger = Merger(cfg, stores[0])
    theta = stores[0].load_params()
    sizes = []
    for version in range(2):
        for s in stores:
            for n, island in enumerate("ab"):
                delta = random_delta(theta, 10 * version + n)
                publish_delta(s, cfg, island, version, delta, base_version=version)
        assert len(merger.merge_once().applied) == 2
        sizes.append(merger._buffers.nbytes)
        assert len(Merger(cfg, stores[1]).merge_once().applied) == 2
    assert sizes[0] > 0 and sizes[1] == sizes[0]  # no new buffer the second time
    want = stores[1].load_params()
    for k, v in stores[0].load_params().items():
        assert v.tobytes() == want[k].tobytes(), k
