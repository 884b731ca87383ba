"""Maintenance: stalled islands, expired cloud resources, and garbage collection of the store.

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

Knobs (environment of the workers): ``DILOCO_GC_KEEP_LAST`` (5), ``DILOCO_GC_DRY_RUN`` (set to
1 to only report the plan).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from diloco_airflow import hooks

log = logging.getLogger(__name__)


def keep_last_default() -> int:
    return int(os.environ.get("DILOCO_GC_KEEP_LAST", "5"))


def dry_run_default() -> bool:
    return os.environ.get("DILOCO_GC_DRY_RUN", "").lower() in ("1", "true", "yes")


def collect(estore, keep_last: int | None = None, dry_run: bool | None = None) -> dict[str, Any]:
    """Plan the garbage collection of one experiment and, unless ``dry_run``, carry it out.

    Returns the JSON report described in the module docstring."""
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
            estore = hooks.open_experiment(e["store_url"], e["experiment"])
            out.append({"experiment": e["experiment"], **collect(estore, keep_last, dry_run)})
        except Exception as exc:  # one experiment's problem must not stop the others
            log.exception("gc of %s failed", e["experiment"])
            out.append({"experiment": e["experiment"], "error": str(exc)})
    return out


def stop_stalled_islands(
    experiments: list[dict[str, Any]], stale_after_s: float | None = None
) -> list[str]:
    """Kill islands whose heartbeat stopped while their process still runs.

    The island's wait task then sees it dead and its retry relaunches it (resuming from the
    store). Returns ``experiment/island`` of the islands stopped.
    """
    from diloco_airflow.backends import IslandSpec, IslandState, get_backend

    stopped = []
    now = time.time()
    for e in experiments:
        estore = hooks.open_experiment(e["store_url"], e["experiment"])
        beats, done = estore.heartbeats(), set(estore.done())
        for name, isl in (e.get("islands") or {}).items():
            if name in done or name not in beats:
                continue
            limit = stale_after_s or max(120.0, 24 * float(isl.get("heartbeat_s", 5)))
            age = now - float(beats[name].get("time") or now)
            if age <= limit:
                continue
            backend = get_backend(isl["backend"], **isl.get("backend_kwargs", {}))
            spec = IslandSpec.from_dict(isl["spec"])
            if backend.status(spec, {}).state == IslandState.RUNNING:
                log.warning(
                    "%s/%s: heartbeat %.0fs old, process alive: stopping it",
                    e["experiment"],
                    name,
                    age,
                )
                backend.teardown(spec, {})
                stopped.append(f"{e['experiment']}/{name}")
    return stopped


def delete_expired_resources(experiments: list[dict[str, Any]]) -> list[str]:
    """Delete TPU queued resources past their ``diloco-ttl`` label, in every known zone."""
    from diloco_airflow.backends import get_backend

    zones = set()
    for e in experiments:
        for isl in (e.get("islands") or {}).values():
            hw = isl.get("spec", {}).get("hardware", {})
            if isl.get("backend") == "tpu_vm" and hw.get("project") and hw.get("zone"):
                zones.add((hw["project"], hw["zone"]))
    deleted = []
    for project, zone in sorted(zones):
        backend = get_backend("tpu_vm", project=project, zone=zone)
        for res in backend.expired_resources():
            log.warning("deleting expired %s (ttl %s)", res["name"], res["ttl"])
            backend.delete_resource(res["name"])
            deleted.append(res["name"])
    return deleted
