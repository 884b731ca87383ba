"""Maintenance of running experiments: stop stalled islands (their wait task's retry relaunches
them) and delete expired TPU resources. Both work on the experiment registry's entries.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from diloco_airflow import store
from diloco_airflow.island_entry import IslandEntry
from training.protocol import stall

log = logging.getLogger(__name__)


def stop_stalled_islands(
    experiments: list[dict[str, Any]], stale_after_s: float | None = None
) -> list[str]:
    """Kill islands whose heartbeat stopped while their process still runs.

    The island's wait task then sees it dead and its retry relaunches it (resuming from the
    store). Returns ``experiment/island`` of the islands stopped.
    """
    from diloco_airflow.backends import ResourceState

    stopped = []
    now = time.time()
    for e in experiments:
        estore = store.open_experiment(e["store_url"], e["experiment"])
        beats, done = estore.heartbeats(), set(estore.done())
        for name, raw in (e.get("islands") or {}).items():
            if name in done or name not in beats:
                continue
            isl = IslandEntry.of(raw)
            limit = stale_after_s or stall.maintenance_timeout_s(isl.heartbeat_s)
            beat_time = float(beats[name].get("time") or now)
            if not stall.beat_too_old(beat_time, now, limit):
                continue
            age = now - beat_time
            backend, spec = isl.make_backend(), isl.spec
            if backend.status(spec, {}).state == ResourceState.RUNNING:
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
        for isl in map(IslandEntry.of, (e.get("islands") or {}).values()):
            hw = isl.spec.hardware
            if isl.backend == "tpu_vm" and hw.get("project") and hw.get("zone"):
                zones.add((hw["project"], hw["zone"]))
    deleted = []
    for project, zone in sorted(zones):
        backend = get_backend("tpu_vm", project=project, zone=zone)
        for res in backend.expired_resources():
            log.warning("deleting expired %s (ttl %s)", res["name"], res["ttl"])
            backend.delete_resource(res["name"])
            deleted.append(res["name"])
    return deleted
