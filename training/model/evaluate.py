"""Held-out evaluation of global versions."""

from __future__ import annotations

import logging
import time

from training.config.experiment import ExperimentConfig
from training.data.batches import eval_batches
from training.model.runtime import corpus_for, loop_for
from training.store.faces import EvaluatorFace
from training.store.layout import Snapshot, iso
from training.store.objectstore import CorruptObject, ObjectNotFound
from training.store.tensorboard import ScalarWriter

log = logging.getLogger("diloco.eval")


def held_out_batches(cfg: ExperimentConfig):
    """The held-out split's fixed, deterministic eval batches of `cfg`."""
    corpus = corpus_for(cfg)
    return eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.seq_len, cfg.data.eval_batches)


def eval_loss(cfg: ExperimentConfig, params) -> float:
    """Mean next-token loss of `params` on the held-out split (`held_out_batches`)."""
    loop = loop_for(cfg)
    return loop.eval_loss(loop.put_params(params), held_out_batches(cfg))


def evaluate_snapshot(
    cfg: ExperimentConfig,
    store,
    snapshot: Snapshot | None = None,
    record: bool = True,
    late: bool = False,
    params_of=None,
) -> dict:
    """Evaluate the model at `snapshot` (default: every fragment's HEAD now).

    With `record`, the snapshot is written to snapshots/, the result to metrics/eval, and it
    becomes snapshots/BEST.json if its loss is the lowest so far and it holds trained tokens
    (version 0, the untrained model, never does). Returns the eval record:
    `loss`, `tokens_merged`, `versions` and `dirs` (the snapshot), `at` and `at_iso`. `late`:
    an older model evaluated now; `at` is when the model was made (snapshot.at, so curves stay
    in model order) and `evaluated_at` when it was evaluated. `params_of`: the params of a
    light version that holds none (store.load_params; training/merge/replay.py `params_of`).
    """
    store = EvaluatorFace(store)  # training/store/faces.py
    snapshot = snapshot or store.current_snapshot()
    if snapshot is None:
        raise RuntimeError(f"experiment {cfg.name!r} has no global version: run init")
    now = time.time()
    at = snapshot.at if late else now
    out = {
        **snapshot.to_dict(),
        "loss": eval_loss(cfg, store.load_params(snapshot, params_of)),
        "at": at,
        "at_iso": iso(at),
        "version": sum(snapshot.versions),  # a scalar that grows with every merge
        **({"evaluated_at": now} if late else {}),
    }
    if record:
        store.record_snapshot(snapshot, {"by": "eval", "loss": out["loss"]})
        store.append_metric("eval", out)
        if cfg.tensorboard.enabled:  # one event file per evaluation (they are minutes apart)
            tb = ScalarWriter(store, "eval", cfg.tensorboard.flush_s)
            tb.add_all(
                {"eval/loss": out["loss"], "eval/tokens_merged": out["tokens_merged"]},
                out["version"],
                at,
            )
            tb.flush()
        # BEST is a trained model (its Asset event exports it): the untrained version 0's
        # evaluation is recorded, never offered
        out["best"] = out["tokens_merged"] > 0 and store.offer_best(out)
    return out


def evaluate_current(cfg: ExperimentConfig, store, params_of=None) -> dict:
    """Evaluate and record the model as it is now (see evaluate_snapshot)."""
    return evaluate_snapshot(cfg, store, params_of=params_of)


def last_unevaluated(history: list[Snapshot], evaluated: set[tuple[int, ...]], limit: int):
    """The models of `history` (store.snapshot_history: one per merge, oldest first) made after
    the last evaluated one (`evaluated`: versions vectors), the newest excluded (the final eval
    covers it): at most `limit` of them, the newest first."""
    return _after_last_eval(history, evaluated)[1][::-1][:limit]


def _after_last_eval(history: list[Snapshot], evaluated: set[tuple[int, ...]]):
    """(the tokens of the last evaluated model of `history`, 0 when none; the models after it,
    the newest excluded, oldest first)."""
    last = history[:-1]
    start = max((i for i, s in enumerate(last) if s.versions in evaluated), default=-1)
    return (last[start].tokens_merged if start >= 0 else 0), last[start + 1 :]


CURVE_POINTS = 8
"""The end of a run evaluates, besides the last merges, a model every 1/CURVE_POINTS of the token
budget after the last eval (`end_of_run_models`)."""


def end_of_run_models(
    history: list[Snapshot],
    evaluated: set[tuple[int, ...]],
    limit: int,
    budget: int,
    points: int = CURVE_POINTS,
) -> list[Snapshot]:
    """What the end of a run evaluates before its final eval, oldest first: the last `limit`
    merges no eval saw (`last_unevaluated`), and the curve's gaps since the last eval: for each
    target of the last evaluated model's tokens plus k x `budget` / `points`, the first later
    model with at least that many tokens. A short run's evaluator may have seen one model
    between version 0 and the end (its cadence is wall time, its evaluations take a while, it
    ends with the islands): the eval curve then still has a point every 1/`points` of the
    budget. Oldest first: the TensorBoard run "eval" never goes back."""
    base, after = _after_last_eval(history, evaluated)
    chosen = {s.versions for s in after[::-1][:limit]}
    gap, target = budget / points, base + budget / points
    for s in after:
        if s.tokens_merged >= target:
            chosen.add(s.versions)
            while target <= s.tokens_merged:
                target += gap
    return [s for s in after if s.versions in chosen]


def evaluate_recent_merges(cfg: ExperimentConfig, store, params_of=None) -> list[dict]:
    """At the end of a run (no island trains, no merger runs), before the final eval: evaluate
    and record the models the last merges made that no eval saw (`syncer.final_evals` at most, `last_unevaluated`), so
    that `finish_at_best` chooses among every recent merge, not only among the evaluator's
    periodic snapshots (issue 24: a bad last merge made finalize restore an eval 4 merges
    older, discarding three healthy merges never evaluated), and a model every 1/CURVE_POINTS
    of the budget since the last eval (`end_of_run_models`; `syncer.final_evals` 0: none of
    either). Returns their eval records, oldest first: the order they are evaluated and
    recorded in, so that the TensorBoard run "eval" (step: the sum of the snapshot's versions)
    never goes back. `params_of`: as evaluate_snapshot's."""
    store = EvaluatorFace(store)  # training/store/faces.py
    limit = cfg.syncer.final_evals
    if limit == 0:
        return []
    evaluated = {
        tuple(e["versions"])
        for e in store.read_metrics("eval")
        if isinstance(e.get("versions"), list)
    }
    out = []
    history = store.snapshot_history()
    for snapshot in end_of_run_models(history, evaluated, limit, cfg.token_budget):
        try:
            out.append(evaluate_snapshot(cfg, store, snapshot, late=True, params_of=params_of))
        except ObjectNotFound:  # collected since: the others are still worth a look
            continue
    return out


def end_of_run_report(store) -> dict:
    """The final eval against the best and the first (version 0) ones, with a warning when the
    run ended worse than its best or than where it started (what `finalize` and `status` say)."""
    store = EvaluatorFace(store)  # training/store/faces.py
    evals = store.read_metrics("eval")
    if not evals:
        return {"warning": None}
    final, first = evals[-1], evals[0]
    best = store.best() or final
    warning = None
    if final["loss"] > best["loss"] * 1.001:
        warning = (
            f"final eval loss {final['loss']:.4f} is worse than the best {best['loss']:.4f} "
            f"(snapshot versions {best.get('versions')}); use snapshots/BEST.json"
        )
    if all(v == 0 for v in first.get("versions", [1])) and final["loss"] > first["loss"]:
        warning = (
            f"final eval loss {final['loss']:.4f} is worse than version 0 ({first['loss']:.4f})"
        )
    return {"final": final, "best": best, "warning": warning}


RESTORE_MARGIN = 1e-3  # restore the best snapshot when the final eval is this much worse


def finish_at_best(cfg: ExperimentConfig, store, final: dict, state_of=None) -> dict:
    """The end of a run is as good as its best: when the final eval (`final`, a record of
    evaluate_snapshot) is worse than snapshots/BEST.json by more than RESTORE_MARGIN, publish
    the best snapshot's fragments as new versions (`restore_snapshot`) and evaluate again.
    Call only when no island trains and no merger runs (finalize). Returns {"restored": bool,
    "final": the eval of the model the run ends with, "before": `final`}. `state_of`: the
    params and outer state of a light version (store.restore_snapshot)."""
    store = EvaluatorFace(store)  # training/store/faces.py
    best = store.best()
    out = {"restored": False, "final": final, "before": final}
    if not best or not best["loss"] < final["loss"] * (1 - RESTORE_MARGIN):
        return out
    try:
        snapshot = store.on_chain(store.snapshot_of(best))
    except CorruptObject as err:  # BEST off the chain: the run ends on its last model
        log.warning("BEST passed over, not restored: %s", err)
        return out
    reason = f"final eval {final['loss']:.4f} worse than the best {best['loss']:.4f}"
    if store.restore_snapshot(snapshot, reason, state_of) is None:
        return out
    out.update(restored=True, final=evaluate_current(cfg, store), restored_from=best)
    return out
