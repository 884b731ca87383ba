"""Every ``DILOCO_*`` environment variable of the Airflow layer, documented once, read here.

*Knobs* are what whoever deploys Airflow may set in the environment of its components (the
dag-processor reads the DAG knobs at parse time, the workers and the triggerer the others when a
task runs). Each is a `Knob`: ``KNOB.get()`` reads it now (unset or empty: its default). Nothing
else in `plugins/`, `dags/` or `devtools/` reads ``os.environ`` for a ``DILOCO_*`` name.

The library has two variables of its own, ``DILOCO_FAULTS`` (fault points of a process:
`training.faults.points`, where it is documented; read by `FaultPlan.from_env` alone, which only
entry points call: ``diloco island``, ``diloco merge``, and here the tasks that merge in their
own process, the syncer's shards and ``finalize``, through `fault_plan` below) and
``DILOCO_NATIVE`` (``0``: the codecs and the outer step never build or load their C loops, nor
the store its C CRC-32C: `training.store.clib`). The backends *set* a few more for the island
process (`ISLAND_ENV`, below); an island gets its arguments on the command line, and reads only
the multi-host three (``DILOCO_NUM_PROCESSES``, ``DILOCO_PROCESS_ID``, ``DILOCO_COORDINATOR``) as
the defaults of ``diloco island``'s multi-host flags (`training.island.multihost.flag_defaults`); logs
and startup scripts use the others.

Standard library only: imported at DAG parse time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def _flag(text: str) -> bool:
    return text.lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, default (None: unset), parser and meaning."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    doc: str

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value now: parsed from the environment, or the default when unset or empty."""
        text = (os.environ if environ is None else environ).get(self.name, "")
        return self.parse(text) if text else self.default


# -- the DAGs (read at parse time) --------------------------------------------------------------
RETRY_DELAY_S = Knob(
    "DILOCO_RETRY_DELAY_S", 30.0, float, "first retry delay of the DAGs' tasks (exponential)"
)
ISLAND_TIMEOUT_H = Knob(
    "DILOCO_ISLAND_TIMEOUT_H", 72.0, float, "execution timeout of an island's wait and the syncer"
)
ISLAND_RETRIES = Knob(
    "DILOCO_ISLAND_RETRIES", 5, int, "retries of an island's launch and wait, the syncer's tasks"
)
HEARTBEAT_TIMEOUT_S = Knob(
    "DILOCO_HEARTBEAT_TIMEOUT_S",
    None,
    float,
    "a running island whose heartbeat is older than this is stalled (default: "
    "max(60, 12 x the config's heartbeat_s))",
)
EXPERIMENT_SCHEDULE = Knob(
    "DILOCO_EXPERIMENT_SCHEDULE", None, str, "cron or preset of diloco_experiment (default: none)"
)


def _json_object(text: str) -> dict:
    import json

    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object of form values, got {text[:80]!r}")
    return value


FORM_DEFAULTS = Knob(
    "DILOCO_FORM_DEFAULTS",
    {},
    _json_object,
    'a JSON object of diloco_experiment form values (e.g. {"token_budget": 10000000, '
    '"model_preset": "125m"}): the defaults of the trigger form, so what a scheduled '
    "run trains (read at parse time; the form's schema checks them)",
)
BUDGET_HORIZON_H = Knob(
    "DILOCO_BUDGET_HORIZON_H",
    24.0,
    float,
    "init (and the run's note) warn when the token budget would take longer than this many "
    "hours on the run's islands (training/config/estimate.py)",
)
BACKENDS = Knob(
    "DILOCO_BACKENDS",
    None,
    str,
    "comma-separated island backends diloco_experiment offers (its graph has a task group per "
    "backend, fixed at parse time; the form's backend choice and init accept only these); "
    "default: every backend (local, tpu_vm, gke). `make airflow` / `make demo` set local",
)
DEFAULT_STORE = Knob(
    "DILOCO_DEFAULT_STORE",
    "file:///tmp/diloco/store",
    str,
    "the trigger form's default store URL; on Composer set gs://<bucket>/<prefix> (a file:// "
    "store exists on one machine only: islands on TPU VMs or GKE cannot reach it)",
)
EXPORT_STORE = Knob(
    "DILOCO_EXPORT_STORE",
    None,
    str,
    "diloco_export_best (an example DAG): the store whose new best models it exports (read at "
    "parse time; default: DILOCO_DEFAULT_STORE)",
)
EXPORT_DIR = Knob(
    "DILOCO_EXPORT_DIR",
    "/tmp/diloco/exports",
    str,
    "diloco_export_best: where exports go, one folder per experiment and snapshot (on Composer "
    "the bucket's mounted data folder, /home/airflow/gcs/data/exports)",
)
ASSET_POLL_S = Knob(
    "DILOCO_ASSET_POLL_S",
    30.0,
    float,
    "how often the triggerer's watcher of a store's models asset looks for a new best snapshot",
)
SCAVENGE_SCHEDULE = Knob(
    "DILOCO_SCAVENGE_SCHEDULE",
    None,
    str,
    "cron or preset of diloco_scavenge: when scavenging windows open (default: none)",
)
MAINTENANCE_SCHEDULE = Knob(
    "DILOCO_MAINTENANCE_SCHEDULE", "*/15 * * * *", str, "cron or preset of diloco_maintenance"
)

# -- tasks (read when they run) -----------------------------------------------------------------
GC_KEEP_LAST = Knob(
    "DILOCO_GC_KEEP_LAST", 5, int, "versions of each fragment's chain garbage collection keeps"
)
GC_EVERY_S = Knob(
    "DILOCO_GC_EVERY_S",
    60.0,
    float,
    "seconds between garbage collections of an experiment by its syncer (shard 0) while it "
    "merges; 0: only diloco_maintenance and finalize collect",
)
GC_DRY_RUN = Knob("DILOCO_GC_DRY_RUN", False, _flag, "1 / true / yes: gc only reports its plan")
RUNS_ROOT = Knob(
    "DILOCO_RUNS_ROOT", None, str, "local backend: where island run directories go (./runs)"
)
TPU_API_ENDPOINT = Knob(
    "DILOCO_TPU_API_ENDPOINT",
    None,
    str,
    "tpu_vm backend: send every TPU API call to this http://127.0.0.1:PORT (a local fake, "
    "anonymous credentials), as STORAGE_EMULATOR_HOST does for GCS; unset in production",
)

PAGE_STORES = Knob(
    "DILOCO_PAGE_STORES",
    "",
    str,
    "comma-separated store URLs the DiLoCo page always shows (besides the registry and runs)",
)


def fault_plan():
    """The fault points of a task that merges in its own process (``DILOCO_FAULTS``, parsed by
    the library's one reader, `training.faults.points.FaultPlan.from_env`), or None. Imported
    when called: this module stays standard library only at parse time."""
    from training.faults.points import FaultPlan

    return FaultPlan.from_env()


# -- developer tools (devtools/) ----------------------------------------------------------------
AIRFLOW_PORT = Knob("DILOCO_AIRFLOW_PORT", 8080, int, "port of the local Airflow's API server/UI")
DEMO_TOKENS = Knob("DILOCO_DEMO_TOKENS", 2_000_000, int, "token budget of `make demo`")
DEMO_PROFILE = Knob(
    "DILOCO_DEMO_PROFILE", "default", str, "`make demo`'s settings: default, or paper (P = 24)"
)
DEMO_TIMEOUT_S = Knob("DILOCO_DEMO_TIMEOUT_S", 600.0, float, "how long `make demo` waits")
WORKER_HOSTNAME = Knob(
    "DILOCO_WORKER_HOSTNAME",
    None,
    str,
    "the Celery setup's worker name (devtools/celery_airflow: its `hostname_callable`)",
)

KNOBS: tuple[Knob, ...] = (
    RETRY_DELAY_S,
    ISLAND_TIMEOUT_H,
    ISLAND_RETRIES,
    HEARTBEAT_TIMEOUT_S,
    EXPERIMENT_SCHEDULE,
    FORM_DEFAULTS,
    BUDGET_HORIZON_H,
    BACKENDS,
    DEFAULT_STORE,
    EXPORT_STORE,
    EXPORT_DIR,
    ASSET_POLL_S,
    SCAVENGE_SCHEDULE,
    MAINTENANCE_SCHEDULE,
    GC_KEEP_LAST,
    GC_EVERY_S,
    GC_DRY_RUN,
    RUNS_ROOT,
    TPU_API_ENDPOINT,
    PAGE_STORES,
    AIRFLOW_PORT,
    DEMO_TOKENS,
    DEMO_PROFILE,
    DEMO_TIMEOUT_S,
    WORKER_HOSTNAME,
)

# -- what the backends set for the island process ----------------------------------------------
ISLAND_ENV: dict[str, str] = {
    "DILOCO_EXPERIMENT": "the experiment's name",
    "DILOCO_ISLAND": "the island's name",
    "DILOCO_STORE_URL": "the store's URL",
    "DILOCO_NUM_PROCESSES": "hosts of the island's slice (`diloco island --num-processes`)",
    "DILOCO_PROCESS_ID": "tpu_vm, gke JobSet: this host's worker number (`--process-id`)",
    "DILOCO_COORDINATOR": "tpu_vm, gke JobSet: host 0's address:port (jax.distributed "
    "coordinator, `--coordinator`)",
    "DILOCO_INSTALL": "tpu_vm: a pip requirement spec the startup script installs first "
    "(from hardware['install'] or the spec's env)",
}
