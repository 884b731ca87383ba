"""Garbage collection of the store (the maintenance DAG's `collect_garbage`).

Retention policy (`ExperimentStore.plan_gc`, docs/STORE.md "Garbage collection"), per fragment:
keep the payloads of its HEAD, of the newest ``keep_last`` versions of its chain, of version 0
(the baseline evaluations compare against), of the version an island's heartbeat or latest
checkpoint names as its base for that fragment, and of the BEST snapshot's version; delete the
payloads of its other versions (their manifests stay), its directories that lost the HEAD race,
and the merged pseudo-gradients of that fragment applied outside its window (their ledger entries
stay). Also deleted: payloads no marker names, and checkpoints older than each island's LATEST.

The report of `collect` is JSON (an Airflow XCom): the plan (`GCPlan.to_dict`: `heads` and
`protected` keyed by the fragment as a string, `versions` as fragment version directories), plus
`dry_run` and `deleted` (counts per kind).

Knobs (`diloco_airflow.knobs`): ``DILOCO_GC_KEEP_LAST``, ``DILOCO_GC_DRY_RUN``.
"""

from __future__ import annotations

import logging
from typing import Any

from diloco_airflow import knobs, store

log = logging.getLogger(__name__)


def keep_last_default() -> int:
    return knobs.GC_KEEP_LAST.get()


def dry_run_default() -> bool:
    return knobs.GC_DRY_RUN.get()


def collect(estore, keep_last: int | None = None, dry_run: bool | None = None) -> dict[str, Any]:
    """Plan the garbage collection of one experiment and, unless ``dry_run``, carry it out.

    Returns the JSON report described in the module docstring."""
    from training.store.faces import MaintenanceFace

    estore = MaintenanceFace(estore)  # training/store/faces.py
    keep_last = keep_last_default() if keep_last is None else keep_last
    dry_run = dry_run_default() if dry_run is None else dry_run
    plan = estore.plan_gc(keep_last=keep_last)
    report: dict[str, Any] = {**plan.to_dict(), "dry_run": dry_run, "deleted": {}}
    if dry_run or plan.empty:
        log.info("%s: gc plan%s: %s", estore.experiment, " (dry run)" if dry_run else "", report)
        return report
    report["deleted"] = estore.collect_garbage(plan)
    log.info(
        "%s: gc deleted %s (heads %s, protected %s)",
        estore.experiment,
        report["deleted"],
        report["heads"],
        report["protected"],
    )
    return report


def collect_all(
    experiments: list[dict[str, Any]], keep_last: int | None = None, dry_run: bool | None = None
) -> list[dict[str, Any]]:
    """`collect` for each registered experiment; one that fails reports {"error": ...}."""
    out = []
    for e in experiments:
        try:
            estore = store.open_experiment(e["store_url"], e["experiment"])
            out.append({"experiment": e["experiment"], **collect(estore, keep_last, dry_run)})
        except Exception as exc:  # one experiment's problem must not stop the others
            log.exception("gc of %s failed", e["experiment"])
            out.append({"experiment": e["experiment"], "error": str(exc)})
    return out
