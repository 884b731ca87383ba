"""Maintenance: stalled islands, expired cloud resources, and garbage collection of the store.

Retention policy (`plan_gc`): keep version 0 (the baseline evaluations compare against), the
newest ``keep_last`` global versions, and every version still referenced (an island's heartbeat
names its base version). Merged pseudo-gradients are deleted once the version that applied them
is older than every kept version. The newest version is never deleted.

Deletion needs the store to offer ``delete_global_version(version)`` and
``delete_pseudograd(ref)``; where it does not, the plan is reported and nothing is deleted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from diloco_airflow import hooks

log = logging.getLogger(__name__)


def _version_of(v: Any) -> int:
    return int(getattr(v, "version", v))


def plan_gc(
    versions: list[int], referenced: set[int], keep_last: int = 5
) -> tuple[list[int], int | None]:
    """(versions to delete, oldest kept version). Never the newest, 0, or a referenced one."""
    versions = sorted(set(versions))
    if not versions:
        return [], None
    keep = set(versions[-max(1, keep_last) :]) | {0} | (set(referenced) & set(versions))
    delete = [v for v in versions if v not in keep]
    kept_after = [v for v in versions if v in keep and v != 0]
    return delete, (min(kept_after) if kept_after else None)


def collect(estore, keep_last: int = 5, dry_run: bool = False) -> dict[str, Any]:
    versions = [_version_of(v) for v in estore.list_global_versions()]
    done = set(estore.done())
    referenced = {
        int(b["base_version"])
        for isl, b in estore.heartbeats().items()
        if isl not in done and b.get("base_version") is not None
    }
    delete, oldest_kept = plan_gc(versions, referenced, keep_last)
    applied = estore.applied()
    applied_at = applied if isinstance(applied, dict) else {}
    old_pgs = [
        r
        for r in estore.list_pseudograds()
        if oldest_kept is not None
        and isinstance(applied_at.get(r.id), int)
        and applied_at[r.id] < oldest_kept
    ]
    can_delete = hasattr(estore, "delete_global_version") and hasattr(estore, "delete_pseudograd")
    report = {
        "versions": len(versions),
        "delete_versions": delete,
        "delete_pseudograds": [r.id for r in old_pgs],
        "deleted": False,
    }
    if dry_run or not can_delete:
        if not can_delete:
            log.warning("store has no delete API: nothing deleted (plan: %s)", report)
        return report
    for v in delete:
        estore.delete_global_version(v)
    for r in old_pgs:
        estore.delete_pseudograd(r)
    report["deleted"] = True
    return report


def collect_all(experiments: list[dict[str, Any]], keep_last: int = 5) -> list[dict[str, Any]]:
    out = []
    for e in experiments:
        try:
            estore = hooks.open_experiment(e["store_url"], e["experiment"])
            out.append({"experiment": e["experiment"], **collect(estore, keep_last)})
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
