"""The `chaos_monkey` task: chaos mode's kill monkey for the islands of one run.

The monkey itself (exponential inter-arrival times, the victim, the record) is
`training.faults.chaos.start_monkey`; this module finds the running local islands and stops it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from diloco_airflow import store
from diloco_airflow.island_entry import IslandEntry

log = logging.getLogger(__name__)


def run_chaos_monkey(
    islands: dict[str, list],
    store_url: str,
    experiment: str,
    poll_s: float = 2.0,
    idle_s: float = 600.0,
) -> dict[str, Any]:
    """Chaos mode's kill monkey for the islands of one `diloco_experiment` run (`islands`:
    `init_experiment`'s output, islands by backend; its other keys are ignored).

    A no-op unless the experiment's stored config sets `chaos.kill_mtbi_s`. Otherwise
    `training.faults.chaos.start_monkey` SIGKILLs the process group of a running local island at
    exponential inter-arrival times (mean `kill_mtbi_s`, at most `max_kills`), each kill recorded
    in the store's metrics ("chaos", event "kill"); the islands' wait tasks then retry and
    relaunch them. Stops once every island of this run is done (or none has run for `idle_s`).
    Islands of other backends are not killed (logged: unsupported).
    """
    from diloco_airflow.backends import BACKENDS
    from training.faults.chaos import recorder, start_monkey

    estore = store.open_experiment(store_url, experiment)
    cfg = estore.config()
    if cfg.chaos.kill_mtbi_s is None:
        log.info("%s: chaos.kill_mtbi_s is not set: no kill monkey", experiment)
        return {"kills": []}
    chaos = cfg.chaos
    if chaos.max_kills:  # per experiment: a retried monkey (or a joining run) counts earlier kills
        before = sum(1 for e in estore.read_metrics("chaos") if e.get("event") == "kill")
        if before >= chaos.max_kills:
            log.info("%s: %d kills already, max_kills %d", experiment, before, chaos.max_kills)
            return {"kills": []}
        chaos = chaos.model_copy(update={"max_kills": chaos.max_kills - before})
    local = [IslandEntry.of(i) for i in islands.get("local") or []]
    others = [
        IslandEntry.of(i).name for b in BACKENDS if b != "local" for i in islands.get(b) or []
    ]
    if others:
        log.warning("chaos monkey: killing non-local islands is unsupported: %s", others)
    if not local:
        return {"kills": [], "unsupported": others}
    backends = {i.name: (i.make_backend(), i.spec) for i in local}
    names = set(backends)

    def running() -> dict[str, int]:
        done = set(estore.done())
        out = {}
        for name, (backend, spec) in backends.items():
            if name in done:
                continue
            pgid = backend.running_group(spec)
            if pgid:
                out[name] = pgid
        return out

    log.info(
        "%s: chaos monkey on %s: mean %.1fs between kills, at most %s",
        experiment,
        sorted(names),
        chaos.kill_mtbi_s,
        chaos.max_kills or "unlimited",
    )
    thread, stop, kills = start_monkey(running, chaos, recorder(estore), kill=os.killpg)
    last_alive = time.monotonic()
    try:
        while thread.is_alive():
            thread.join(poll_s)
            try:
                if names <= set(estore.done()):
                    log.info("%s: every island is done: the monkey stops", experiment)
                    break
                if running():
                    last_alive = time.monotonic()
                elif time.monotonic() - last_alive > idle_s:
                    log.warning("%s: no island ran for %.0fs: the monkey stops", experiment, idle_s)
                    break
            except Exception as exc:  # the store blinked: keep the monkey going
                log.warning("chaos monkey: poll failed: %s", exc)
    finally:
        stop.set()
        thread.join(30)
    log.info("%s: chaos monkey killed %d times: %s", experiment, len(kills), kills)
    return {"kills": list(kills), "unsupported": others}
