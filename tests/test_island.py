"""The island loop in-process: what it publishes, how it adopts merges, and that it resumes."""

import numpy as np

from tests.helpers import new_store, small_config
from training.codecs import host as codecs
from training.island.process import Island
from training.merge.merger import Merger
from training.model import inner


def _island(**sections):
    cfg = small_config(outer={"method": "nesterov"}, **sections)
    store = new_store(cfg)
    island = Island(cfg, "a", store)
    island.start()
    return cfg, store, island


def test_published_pseudo_gradient_is_global_minus_local():
    cfg, store, island = _island()
    theta0 = store.load_params()
    for _ in range(cfg.inner.H):
        island.step()
    (ref,) = store.list_pseudograds("a")
    delta = codecs.decode(store.load_pseudograd(ref), "fp32")
    local = island.state.anchor  # a publish moves the anchor to the published parameters
    for name, value in delta.items():
        np.testing.assert_allclose(value, theta0[name] - local[name], atol=1e-6)
    assert ref.manifest["steps"] == cfg.inner.H and ref.manifest["base_version"] == 0


def test_adopting_a_merge_keeps_the_overlap_steps():
    cfg, store, island = _island(inner={"tau": 1})
    for _ in range(cfg.inner.H + 1):  # publish, then one overlap step
        island.step()
    at_publish = dict(island.state.anchor)
    before = inner.to_host(island.params)
    Merger(cfg, store).merge_once()
    merged = store.load_params()
    island.adopt([0])
    after = inner.to_host(island.params)
    for name in merged:
        expected = merged[name] + (before[name] - at_publish[name])
        np.testing.assert_allclose(after[name], expected, atol=1e-6)
    assert island.base_version == [1]


def test_restart_resumes_counters_cursor_and_sequence_from_the_checkpoint():
    cfg, store, island = _island()
    for _ in range(cfg.inner.H):
        island.step()  # publishes seq 0 and checkpoints
    expected_batch = island.state.loader.next_batch()
    restarted = Island(cfg, "a", store)
    restarted.start()
    assert restarted.resumed and restarted.seq == 1 and restarted.step_count == cfg.inner.H
    np.testing.assert_array_equal(restarted.state.loader.next_batch()[0], expected_batch[0])


def test_a_finishing_island_publishes_its_last_partial_interval():
    cfg = small_config(
        outer={"method": "nesterov"}, islands=({"name": "a", "max_tokens": 6 * 128},)
    )
    store = new_store(cfg)
    # H = 4 steps of 4 x 32 = 128 tokens: seq 0 after step 4, then the 2-step remainder as seq 1
    info = Island(cfg, "a", store).run()
    refs = store.list_pseudograds("a")
    assert [r.seq for r in refs] == [0, 1]
    assert [r.manifest["steps"] for r in refs] == [4, 2]
    assert info["tokens"] == 6 * 128 and "a" in store.done()
