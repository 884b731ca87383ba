"""The end of a run keeps its healthy merges (issue 24 item 4), on the virtual clock.

What the chaos run showed: the last merge applied only a just-rejoined island's contribution,
computed from its checkpoint's old base (staleness 4), and raised the eval loss 13%; `finalize`
then restored the evaluator's last snapshot, four merges older, discarding three healthy merges
no eval had seen, and the status kept reporting the discarded merges' tokens.

Here, with the production Island and Merger on a virtual clock: islands a and b train and merge
while c stalls two steps into its first interval (base version 0); the budget is merged at
version 8, and only then c comes back and sends its last interval, cut short, from base 0:
staleness 8 at the end.
"""

from __future__ import annotations

import uuid

import numpy as np
from diloco_airflow.experiment_end import finalize_experiment

from tests.helpers import new_store, small_config
from training.bench.sim import VirtualClock
from training.island.process import Island
from training.merge.merger import Merger
from training.model.evaluate import eval_loss, evaluate_current, last_unevaluated
from training.store.versions import FRAGMENT_RESERVED

STEP_TOKENS = 4 * 32  # small_config: batch 4 x seq 32
INTERVAL = 4 * STEP_TOKENS  # H = 4: one contribution, 512 tokens
BUDGET = 8 * INTERVAL  # a and b, four rounds each: 4,096 tokens, version 8


def _config(**outer):
    return small_config(
        name="stale-end",
        islands=("a", "b", "c"),
        outer={"quorum": 1, "grace_gamma": 0.0, "grace_min_steps": 0.0, **outer},
        token_budget=BUDGET,
    )


def _run_to_end(cfg, url: str, evaluate_at_version: int | None = None):
    """a, b and c step in turn (one virtual second a step) and a merge follows every publish;
    c stalls after two steps (t = 2: alive, silent: a paused VM, a hung host); once the
    budget's STOP is written, every island finishes as `Island.run` does: its last interval,
    cut short, is sent (`publish_remainder`). Returns the store."""
    store = new_store(cfg, url)
    clock = VirtualClock()
    islands = {n: Island(cfg, n, store, clock=clock) for n in ("a", "b", "c")}
    for isl in islands.values():
        isl.start()
    merger = Merger(cfg, store, clock=clock)
    t = 0
    while not store.stop_requested():
        t += 1
        clock.t = float(t)
        for name in ("a", "b", "c") if t <= 2 else ("a", "b"):
            if islands[name].step().published:
                merger.merge_all()
        if evaluate_at_version is not None and sum(store.current_snapshot().versions) == (
            evaluate_at_version
        ):
            evaluate_current(cfg, store)  # the evaluator's periodic look: BEST
            evaluate_at_version = None
    for name, isl in islands.items():
        assert isl.finished()
        isl.publish_remainder()
        store.mark_done(name, {"step": isl.step_count})
    merger.merge_all()
    return store


def _url() -> str:
    return f"memory://stale-end-{uuid.uuid4().hex[:8]}"


def _last_merge(store):
    """(island, staleness, final) of what HEAD's version applied."""
    contributions = store.fragment_manifest(store.head(0))["contributions"]
    return [(c["island"], c["staleness"], c["final"]) for c in contributions]


def test_without_the_bound_the_rejoined_islands_stale_contribution_is_the_last_merge():
    # the behaviour before the fix, kept reachable with end_max_staleness = null: c's two steps
    # from version 0 are merged alone as version 9, at staleness 8 (versions 1..8 since its base:
    # a and b publish together every 4 s, one version each, 4 rounds x 512 tokens x 2 = budget)
    store = _run_to_end(_config(end_max_staleness=None), _url())
    assert store.head(0).version == 9
    assert _last_merge(store) == [("c", 8, True)]


def test_at_the_end_a_contribution_staler_than_the_bound_is_held_back_with_its_reason():
    store = _run_to_end(_config(), _url())  # end_max_staleness: 2 by default
    assert store.head(0).version == 8  # the budget's last merge stays the model
    reasons = {pg: store.quarantine_reason(pg) for pg in store.quarantine_ids()}
    assert reasons == {  # c's first contribution (seq 0) to fragment 0
        "c/00000000-f000": "held back at the end of the run: staleness 8 > "
        "outer.end_max_staleness 2"
    }
    assert not any(store.pending().values())  # nothing left for finalize to wait for


def test_finalize_restores_the_best_of_the_last_merges_and_reports_the_models_tokens():
    """The evaluator last looked at version 2 (BEST); versions 3..8 are healthy and never
    evaluated; then a bad last merge (version 9: version 8's parameters plus unit noise, with
    c's 256 tokens). finalize evaluates the last `syncer.final_evals` = 4 merges no eval saw
    (versions 5..8) and restores the best of them, not version 2 (what it did before); the
    model's tokens are then the restored version's."""
    url = _url()
    cfg = _config()
    store = _run_to_end(cfg, url, evaluate_at_version=2)
    assert store.best()["versions"] == [2]
    head = store.head(0)
    assert head.version == 8
    fv = store.load_fragment(head, outer_state=True)
    manifest = store.fragment_manifest(head)
    rng = np.random.default_rng(0)
    bad = {k: v + rng.standard_normal(v.shape).astype(v.dtype) for k, v in fv.params.items()}
    extra = {k: v for k, v in manifest.items() if k not in FRAGMENT_RESERVED}
    extra.pop("update_codec", None)
    extra["tokens_merged"] = tokens_before = BUDGET + 2 * STEP_TOKENS
    store.publish_fragment(0, head.version + 1, bad, fv.outer_state, extra, expected=head)

    losses = {}
    for v in (5, 6, 7, 8):
        params = store.load_fragment(store.find_version(0, v)).params
        losses[v] = eval_loss(cfg, params)
    best = min(losses, key=losses.get)

    out = finalize_experiment(url, cfg.name, run_id="manual__1")
    assert out["restored_best"]
    now = store.current_snapshot()
    restored = store.fragment_manifest(store.head(0))["restored_from"]
    assert restored["version"] == best  # one of the last merges, not the evaluator's version 2
    best_tokens = int(store.fragment_manifest(store.find_version(0, best))["tokens_merged"])
    assert now.tokens_merged == best_tokens == store.final()["tokens_merged"]
    assert restored["tokens_discarded"] == tokens_before - best_tokens


def test_last_unevaluated_are_the_merges_after_the_last_eval_newest_first_at_most_the_limit():
    from training.store.layout import Snapshot

    history = [Snapshot((v, w), ("d", "d")) for v, w in ((0, 0), (1, 0), (1, 1), (2, 1), (2, 2))]
    history += [Snapshot((3, 2), ("d", "d")), Snapshot((3, 3), ("d", "d"))]
    # evaluated: (1, 1), index 2; the newest, (3, 3), is the final eval's: (3, 2), (2, 2), (2, 1)
    got = last_unevaluated(history, {(0, 0), (1, 1)}, 4)
    assert [s.versions for s in got] == [(3, 2), (2, 2), (2, 1)]
    assert [s.versions for s in last_unevaluated(history, {(1, 1)}, 2)] == [(3, 2), (2, 2)]
    # nothing evaluated yet: every merge but the newest is a candidate
    assert len(last_unevaluated(history, set(), 64)) == 6
