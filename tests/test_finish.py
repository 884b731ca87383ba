"""finish_at_best: a run whose last merges made the model worse ends on its best snapshot."""

from __future__ import annotations

import numpy as np

from tests.helpers import new_store, publish_delta, random_delta, small_config
from training.merge.merger import Merger
from training.model.evaluate import evaluate_current, finish_at_best


def _worse_run():
    """Version 1 (a small step: trained, so it may be BEST; version 0, untrained, never is)
    evaluated and BEST, then a huge pseudo-gradient merged: version 2 is worse."""
    cfg = small_config("finish", islands=("a",), outer={"method": "nesterov"})
    store = new_store(cfg)
    merger = Merger(cfg, store)
    publish_delta(store, cfg, "a", 0, random_delta(store.load_params(), 0, scale=1e-4))
    merger.merge_all()
    assert evaluate_current(cfg, store)["best"]  # version 1 becomes BEST
    params = store.load_params()
    publish_delta(store, cfg, "a", 1, {k: np.full_like(v, 0.5) for k, v in params.items()})
    merger.merge_all()
    final = evaluate_current(cfg, store)
    return cfg, store, params, final


def test_the_best_snapshot_becomes_the_final_model():
    cfg, store, v0, final = _worse_run()
    out = finish_at_best(cfg, store, final)
    restored = store.load_params()
    assert out["restored"] and all(np.array_equal(restored[k], v0[k]) for k in v0)


def test_restoring_keeps_what_was_applied_applied():
    cfg, store, _, final = _worse_run()
    finish_at_best(cfg, store, final)
    head = store.head(0)
    manifest = store.fragment_manifest(head)
    # version 3 restores version 1 and keeps version 2's cursor: a-1 stays applied, once
    assert (head.version, manifest["restored_from"]["version"]) == (3, 1)
    assert manifest["merge_state"]["cursors"] == {"a": 1} and not any(store.pending().values())


def test_a_final_model_at_its_best_is_left_alone():
    cfg = small_config("finish-ok", islands=("a",))
    store = new_store(cfg)
    final = evaluate_current(cfg, store)
    assert not finish_at_best(cfg, store, final)["restored"] and store.head(0).version == 0
