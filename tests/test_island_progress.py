"""Islands keep their progress while the syncer lags, and stop at the budget by themselves."""

import numpy as np

from tests.helpers import new_store, small_config
from training.codecs import host as codecs
from training.island.process import Island
from training.merge.merger import Merger
from training.model import inner


def _cfg(**sections):
    # one island, P = 1, fp32: every publish is exact
    return small_config(islands=("a",), **{"outer": {"method": "nesterov"}, **sections})


def test_a_stalled_syncer_loses_nothing_and_counts_nothing_twice():
    """Three intervals without any merge: the island keeps training on its own parameters (no
    reset to version 0), each pseudo-gradient holds only its own interval, and together they
    are exactly version 0 minus the island's parameters."""
    cfg = _cfg(inner={"H": 4, "tau": 0})
    store = new_store(cfg)
    theta0 = store.load_params()
    island = Island(cfg, "a", store)
    island.start()
    for _ in range(3 * cfg.inner.H):
        island.step()
    refs = store.list_pseudograds("a")
    assert [r.seq for r in refs] == [0, 1, 2]
    assert all(r.manifest["steps"] == cfg.inner.H and r.manifest["base_version"] == 0 for r in refs)
    deltas = [codecs.decode(store.load_pseudograd(r), "fp32") for r in refs]
    local = inner.to_host(island.params)
    for name in theta0:
        total = sum(d[name] for d in deltas)
        np.testing.assert_allclose(total, theta0[name] - local[name], atol=1e-5)
    assert island.base_version == [0]


def test_late_merge_of_the_pending_increments_reaches_the_islands_parameters():
    """FedAvg identity for one island over a lagging syncer: outer SGD lr 1 without momentum
    applied to the sum of its pending increments gives exactly its parameters."""
    cfg = _cfg(inner={"H": 4, "tau": 0}, outer={"method": "decoupled", "lr": 1.0, "momentum": 0.0})
    store = new_store(cfg)
    island = Island(cfg, "a", store)
    island.start()
    for _ in range(3 * cfg.inner.H):
        island.step()
    r = Merger(cfg, store).merge_once()
    assert len(r.applied) == 3 and r.version == 1
    merged = store.load_params()
    local = inner.to_host(island.params)
    for name in merged:
        np.testing.assert_allclose(merged[name], local[name], atol=1e-5)


def test_an_island_adopts_only_a_version_newer_than_its_own():
    cfg = _cfg(inner={"H": 4, "tau": 1})
    store = new_store(cfg)
    island = Island(cfg, "a", store)
    island.start()
    for _ in range(cfg.inner.H + 1):  # publish, then the adopt step finds nothing newer
        island.step()
    assert island.base_version == [0] and island.bytes_received == _model_bytes(store)
    local = inner.to_host(island.params)
    assert any(not np.array_equal(local[n], v) for n, v in store.load_params().items())


def test_a_merge_that_lands_after_tau_steps_is_adopted_at_the_next_step():
    """tau = 1, but the syncer merges the publish only two steps after it: the island looks
    again every step until HEAD holds its publish, then adopts it (the overlap steps kept), so
    it does not train a whole interval on a stale base. Before, one look at step H + 1 found
    nothing and the island kept version 0 until its next publish."""
    cfg = _cfg(inner={"H": 8, "tau": 1})
    store = new_store(cfg)
    island = Island(cfg, "a", store)
    island.start()
    for _ in range(cfg.inner.H + 2):  # publish at step H, nothing merged at H + 1 or H + 2
        island.step()
    assert island.base_version == [0]
    Merger(cfg, store).merge_once()
    island.step()  # its look at this step finds version 1 holding seq 0
    assert island.base_version == [1]
    assert island.bytes_received == 2 * _model_bytes(store)  # version 0 at start, version 1


def test_a_version_without_the_islands_publish_is_not_downloaded_while_it_waits():
    """Island b's publish is merged first (version 1 without a's seq 0): a reads HEAD's
    manifest, skips version 1's parameters, and downloads only version 2, which holds its own
    publish: one fragment read per adopted merge of its own."""
    cfg = small_config(islands=("a", "b"), outer={"method": "nesterov"}, inner={"H": 8, "tau": 1})
    store = new_store(cfg)
    a, b = (Island(cfg, n, store) for n in ("a", "b"))
    a.start(), b.start()
    for _ in range(cfg.inner.H):
        b.step()
    Merger(cfg, store).merge_once()  # version 1: b's seq 0 only
    for _ in range(cfg.inner.H + 2):
        a.step()  # publishes at step H; looks at H + 1 and H + 2: version 1 lacks its publish
    assert a.base_version == [0] and a.bytes_received == _model_bytes(store)
    Merger(cfg, store).merge_once()  # version 2: a's seq 0
    a.step()
    assert a.base_version == [2] and a.bytes_received == 2 * _model_bytes(store)


def _model_bytes(store):
    return sum(int(v.nbytes) for v in store.load_params().values())
