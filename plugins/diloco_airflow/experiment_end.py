"""The end of a `diloco_experiment` run: mark its islands over (`islands_ended`: the syncer and
evaluator then stop), then `finalize` (a last merge, a final eval, the registry).

`merge_experiments` is also the merge of tests and of a finalize after a failed shard.
Heavy imports happen inside the functions, at task run time.
"""

from __future__ import annotations

import logging
from typing import Any

from diloco_airflow import knobs, store
from diloco_airflow.experiment_registry import unregister_experiment

log = logging.getLogger(__name__)


def merge_experiments(experiments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`Merger.merge_all()` of each experiment, in this (task) process.

    The task's fault plan (`knobs.fault_plan`: DILOCO_FAULTS) and chaos mode apply: the store
    goes through `training.faults.chaos.for_process(..., "merge")`, so storage faults are
    injected, and `chaos.kill_merge_at` SIGKILLs this process at that fault point the first time
    any merge of the experiment runs (the task's retry is not armed again: the event is in the
    store's metrics; it repairs the ledger and merges on). An armed kill is in this experiment's
    store only: the next experiment's merge starts from the task's plan again.
    """
    from training.faults.chaos import for_process
    from training.merge.merger import Merger

    out = []
    faults = knobs.fault_plan()
    for e in experiments:
        estore = store.open_experiment(e["store_url"], e["experiment"], faults)
        cfg = estore.config()
        estore = for_process(cfg, estore, "merge")
        versions, applied, quarantined = [], 0, 0
        for r in Merger(cfg, estore).merge_all():
            if r.version is not None:
                versions.append(r.version)
            applied += len(r.applied)
            quarantined += len(r.quarantined)
        log.info(
            "%s: versions %s, applied %d, quarantined %d", cfg.name, versions, applied, quarantined
        )
        out.append({**e, "versions": versions, "applied": applied, "quarantined": quarantined})
    return out


def islands_ended(store_url: str, experiment: str, run_id: str, islands: list[str]) -> dict:
    """Mark the island tasks of this DAG run as over (successful or not): its syncer shards and
    evaluator then end (after a last drain), so that `finalize` runs after them."""
    names = sorted(islands)
    store.open_experiment(store_url, experiment).mark_run_ended(run_id, names)
    return {"run_id": run_id, "islands": names}


def finalize_experiment(store_url: str, experiment: str, run_id: str | None = None) -> dict:
    """After the islands and the syncer: a last merge of anything a failed shard left (a no-op
    normally), a final eval of the current model, a garbage collection, and drop the
    experiment from the registry once every island of its config is done.

    The run that finds every island done and nothing pending ends the experiment once:
    it claims `control/finalized.json` (create-only, `ExperimentStore.claim_finalize`) before its final eval
    and restore; a finalize of another run (two runs of one experiment ending together, or a
    later run) then evaluates and restores nothing."""
    from training.merge.replay import arrays_of, params_of
    from training.model.evaluate import (
        end_of_run_report,
        evaluate_current,
        evaluate_recent_merges,
        finish_at_best,
    )

    merged = merge_experiments([{"store_url": store_url, "experiment": experiment}])
    estore = store.open_experiment(store_url, experiment)
    cfg = estore.config()
    over = {i.name for i in cfg.islands} <= set(estore.done()) and not any(
        estore.pending().values()
    )
    holder = estore.claim_finalize(run_id) if over and run_id else None
    if holder is not None:
        log.info("%s: already finalized by run %s: no second eval or restore", experiment, holder)
        return {"merged": merged, "finalized_by": holder, "done": sorted(estore.done())}
    if over:  # the last merges no eval saw, before the final eval (which stays the last one)
        recent = evaluate_recent_merges(cfg, estore, params_of(cfg, estore))
        if recent:
            log.info(
                "%s: evaluated the last merges %s",
                experiment,
                [(r["versions"], round(r["loss"], 4)) for r in recent],
            )
    record = evaluate_current(cfg, estore, params_of(cfg, estore))
    log.info("%s: final eval %s", experiment, record)
    restored = False
    if over:
        # nobody trains or merges any more: the run ends on the best of its evaluated snapshots,
        # the last merges included
        finish = finish_at_best(cfg, estore, record, arrays_of(cfg, estore))
        restored = finish["restored"]
        if restored:
            best = finish["restored_from"]
            log.warning(
                "%s: final eval %.4f was worse than the best %.4f: restored the best snapshot "
                "%s as the final model (eval %.4f)",
                experiment,
                record["loss"],
                best["loss"],
                best.get("versions"),
                finish["final"]["loss"],
            )
            record = finish["final"]
        # the model the run ends with, for `--snapshot final` and whoever reads the bucket
        estore.record_final({**record, "run_id": run_id})
    from diloco_airflow import retention

    try:  # what the run left beyond the retention rules (its islands pruned their checkpoints)
        retention.collect(store.open_experiment(store_url, experiment))
    except Exception as exc:  # the maintenance DAG collects later
        log.warning("%s: garbage collection failed: %s", experiment, exc)
    report = end_of_run_report(estore)
    if report["warning"]:
        log.warning("%s: %s", experiment, report["warning"])
    done = set(estore.done())
    if {i.name for i in cfg.islands} <= done:
        unregister_experiment(store_url, experiment)
    return {
        "merged": merged,
        "eval": record,
        "restored_best": restored,
        "best": report.get("best"),
        "warning": report["warning"],
        "done": sorted(done),
        "over": over,
    }
