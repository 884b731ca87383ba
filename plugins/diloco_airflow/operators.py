"""What the DiLoCo DAG tasks do. The DAG files stay thin: they wire these together.

Heavy imports (the training package, jax, cloud clients) happen inside the functions, at task run
time, never at DAG parse time.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from diloco_airflow import hooks

log = logging.getLogger(__name__)

BACKENDS = ("local", "tpu_vm", "gke")


def pool_for(backend: str) -> str:
    """The pool bounding concurrent islands of one backend (create it with include_deferred)."""
    return f"diloco_{backend}"


CONTROL_POOL = "diloco_control"


# ------------------------------------------------------------------ registry of experiments
def _registry() -> dict[str, dict[str, Any]]:
    from airflow.sdk import Variable

    try:
        value = Variable.get(hooks.REGISTRY_VARIABLE, deserialize_json=True)
    except Exception:  # not set yet
        return {}
    return value if isinstance(value, dict) else {}


def registered_experiments() -> list[dict[str, Any]]:
    return list(_registry().values())


def register_experiment(store_url: str, experiment: str, islands: list[dict]) -> None:
    from airflow.sdk import Variable

    reg = _registry()
    key = f"{store_url}|{experiment}"
    entry = reg.get(key) or {"store_url": store_url, "experiment": experiment, "islands": {}}
    entry["islands"].update({i["name"]: i for i in islands})
    entry["registered_at"] = entry.get("registered_at") or time.time()
    reg[key] = entry
    Variable.set(hooks.REGISTRY_VARIABLE, reg, serialize_json=True)


def unregister_experiment(store_url: str, experiment: str) -> None:
    from airflow.sdk import Variable

    reg = _registry()
    if reg.pop(f"{store_url}|{experiment}", None) is not None:
        Variable.set(hooks.REGISTRY_VARIABLE, reg, serialize_json=True)


# ------------------------------------------------------------------ experiment setup
def _project_root() -> str | None:
    spec = importlib.util.find_spec("training")
    if spec is None or not spec.origin:
        return None
    return str(Path(spec.origin).resolve().parent.parent)


def island_command(backend: str, store_url: str, experiment: str, island: str) -> list[str]:
    args = ["island", "--store", store_url, "--experiment", experiment, "--island", island]
    if backend == "local":
        return [sys.executable, "-m", "training.cli", *args]
    return ["diloco", *args]  # the installed console script on the TPU VM / in the image


def backend_kwargs(backend: str) -> dict[str, Any]:
    """Constructor arguments of a backend, JSON-serializable (they travel to the triggerer)."""
    if backend == "local":
        kw: dict[str, Any] = {}
        if os.environ.get("DILOCO_RUNS_ROOT"):
            kw["runs_root"] = os.environ["DILOCO_RUNS_ROOT"]
        root = _project_root()
        if root:
            kw["cwd"] = root
        return kw
    return {}


def island_entry(cfg, isl, ttl_hours: float = 24.0) -> dict[str, Any]:
    """Everything the island tasks need, JSON-serializable (XCom, trigger kwargs)."""
    from diloco_airflow.backends import IslandSpec

    env = {}
    if isl.backend == "local":
        root = _project_root()
        if root:
            parts = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
        for key in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "XLA_FLAGS"):
            if os.environ.get(key):
                env[key] = os.environ[key]
    spec = IslandSpec(
        experiment=cfg.name,
        island=isl.name,
        store_url=cfg.store_url,
        command=island_command(isl.backend, cfg.store_url, cfg.name, isl.name),
        env=env,
        hardware=dict(isl.hardware),
        ttl_hours=ttl_hours,
    )
    return {
        "name": isl.name,
        "experiment": cfg.name,
        "store_url": cfg.store_url,
        "backend": isl.backend,
        "backend_kwargs": backend_kwargs(isl.backend),
        "label": f"{isl.name} ({isl.backend})",
        "heartbeat_s": cfg.heartbeat_s,
        "spec": spec.to_dict(),
    }


def merge_configs(existing: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Join: `new` must equal `existing` except for the island list; islands are united.

    Raises ConfigError naming the first field that differs. Existing islands keep their entry.
    """
    from training.config import ConfigError

    for key in sorted(set(existing) | set(new)):
        if key == "islands":
            continue
        if existing.get(key) != new.get(key):
            raise ConfigError(
                f"experiment {existing.get('name')!r} exists with a different {key!r}: "
                f"{json.dumps(existing.get(key))[:120]} != {json.dumps(new.get(key))[:120]}"
            )
    islands = list(existing.get("islands", []))
    known = {i["name"] for i in islands}
    islands += [i for i in new.get("islands", []) if i["name"] not in known]
    return {**existing, "islands": islands}


def init_experiment(params: dict[str, Any]) -> dict[str, list]:
    """Validate the form, create the experiment or join it, return the islands by backend
    (``{"local": [...], "tpu_vm": [...], "gke": [...]}``) and the syncer's shards
    (``"shards": [0, ..., S-1]``, one mapped merge task each).

    Joining (the experiment exists): every setting but the island list must equal the stored
    config (`merge_configs`); islands not in it yet are added by compare-and-swap on
    config.json (`ExperimentStore.add_islands`: each needs a free data shard, see
    docs/STORE.md); islands already in it must be asked for with the same settings.
    """
    from diloco_airflow.params import config_from_params
    from training.config import parse_config
    from training.store.experiment import ExperimentExists
    from training.store.objectstore import ObjectNotFound

    cfg = config_from_params(params)
    hook = hooks.DilocoStoreHook(store_url=cfg.store_url)
    hook.check()  # unreachable bucket / missing credentials: fail now, with the store's message
    estore = hook.experiment(cfg.name)
    wanted = json.loads(cfg.to_json())
    try:
        existing = estore.read_config()
    except ObjectNotFound:
        existing = None
    if existing is None:
        try:
            estore.write_config(wanted)
            cfg_all = cfg
        except ExperimentExists:  # created by a concurrent trigger in between: join it
            existing = estore.read_config()
    if existing is not None:
        merge_configs(existing, wanted)  # same experiment settings, or a one-line ConfigError
        known = {i["name"] for i in existing.get("islands", [])}
        joined = estore.add_islands([i.model_dump(mode="json") for i in cfg.islands])
        cfg_all = parse_config(joined)
        new = [i.name for i in cfg.islands if i.name not in known]
        log.info(
            "joining experiment %s: new islands %s, relaunching %s",
            cfg.name,
            new,
            sorted(known & {i.name for i in cfg.islands}),
        )
        if estore.stop_requested(None):
            log.warning("experiment %s has a stop marker: its islands stop at once", cfg.name)
    from training.merge import initial_version

    created = initial_version(cfg_all, estore)
    log.info("experiment %s: %s", cfg.name, "created version 0" if created == 0 else "exists")
    if created == 0:
        from training.evaluate import evaluate_current

        log.info("initial eval: %s", evaluate_current(cfg_all, estore))
    # only the islands of this trigger run here; islands of earlier runs keep running there
    entries = [island_entry(cfg_all, cfg_all.island(i.name)) for i in cfg.islands]
    register_experiment(cfg.store_url, cfg.name, entries)
    out: dict[str, list] = {b: [] for b in BACKENDS}
    for e in entries:
        out[e["backend"]].append(e)
    out["shards"] = list(range(cfg_all.syncer.shards))
    return out


# ------------------------------------------------------------------ island tasks
def _spec(island: dict[str, Any]):
    from diloco_airflow.backends import IslandSpec

    return IslandSpec.from_dict(island["spec"])


def _backend(island: dict[str, Any]):
    from diloco_airflow.backends import get_backend

    return get_backend(island["backend"], **island.get("backend_kwargs", {}))


def _raise_backend(exc) -> None:
    if not exc.retryable:
        raise AirflowFailException(f"permanent backend error: {exc.message}") from exc
    raise RuntimeError(f"backend error (will retry): {exc.message}") from exc


def provision_island(island: dict[str, Any]) -> dict[str, Any]:
    from diloco_airflow.backends import BackendError

    try:
        return _backend(island).provision(_spec(island))
    except BackendError as exc:
        _raise_backend(exc)
        raise  # unreachable


def _island_done(island: dict[str, Any]) -> bool:
    return island["name"] in hooks.open_experiment(island["store_url"], island["experiment"]).done()


def launch_island(island: dict[str, Any], handle: dict | None = None) -> dict[str, Any]:
    """Start the island unless it already runs (or is done). Returns the handle."""
    from diloco_airflow.backends import BackendError, IslandState

    backend, spec = _backend(island), _spec(island)
    try:
        if _island_done(island):
            log.info("island %s is already done", island["name"])
            return dict(handle or {})
        st = backend.status(spec, handle or {})
        if st.state in (IslandState.RUNNING, IslandState.PROVISIONING):
            log.info("island %s already %s: %s", island["name"], st.state.value, st.message)
            return dict(handle or {})
        if st.state.terminal:
            handle = backend.provision(spec)
        return backend.launch(spec, handle or {})
    except BackendError as exc:
        _raise_backend(exc)
        raise


def teardown_island(island: dict[str, Any]) -> None:
    from diloco_airflow.backends import BackendError

    try:
        _backend(island).teardown(_spec(island), {})
    except BackendError as exc:
        _raise_backend(exc)


class IslandWaitOperator(BaseOperator):
    """Waits (deferred) until the island is done; fails fast when it is dead.

    On a retry (the island died or stalled) it relaunches the island first; the island process
    resumes from its checkpoint in the store. A stalled island (process alive, heartbeat older
    than ``heartbeat_timeout_s``; default ``max(60, 12 x heartbeat_s)``, the DAG passes
    ``DILOCO_HEARTBEAT_TIMEOUT_S`` when set) is stopped before the task fails, so that the retry
    relaunches it.
    """

    template_fields = ("island",)

    def __init__(
        self,
        *,
        island: Any,
        heartbeat_timeout_s: float | None = None,
        startup_timeout_s: float = 600.0,
        poll_s: float = 3.0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.island = island
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s

    def execute(self, context):
        from diloco_airflow.backends import BackendError, IslandState
        from diloco_airflow.triggers import IslandTrigger

        island = self.island
        context["island_label"] = island["label"]
        if _island_done(island):
            self.log.info("island %s is done", island["name"])
            return {"status": "done"}
        backend, spec = _backend(island), _spec(island)
        try:
            st = backend.status(spec, {})
            self.log.info("island %s: %s %s", island["name"], st.state.value, st.message)
            if st.state not in (IslandState.RUNNING, IslandState.PROVISIONING):
                self.log.warning("island %s is not running: relaunching it", island["name"])
                launch_island(island)
        except BackendError as exc:
            _raise_backend(exc)
        timeout = self.heartbeat_timeout_s or max(60.0, 12 * float(island.get("heartbeat_s", 5)))
        self.defer(
            trigger=IslandTrigger(
                spec=island["spec"],
                backend=island["backend"],
                backend_kwargs=island.get("backend_kwargs", {}),
                launched_at=time.time(),
                heartbeat_timeout_s=timeout,
                startup_timeout_s=self.startup_timeout_s,
                poll_s=self.poll_s,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context, event: dict[str, Any] | None = None):
        context["island_label"] = self.island["label"]
        event = event or {}
        if event.get("status") == "done":
            self.log.info("island %s is done", self.island["name"])
            return event
        message = event.get("message", f"unexpected event {event!r}")
        if event.get("stalled"):
            # alive but silent (hung, or chaos.stall_island): stop this copy now, so that the
            # retry finds the island not running and relaunches it from its checkpoint
            self.log.warning("island %s stalled: stopping it: %s", self.island["name"], message)
            try:
                teardown_island(self.island)
            except Exception as exc:  # the retry's launch kills a leftover copy anyway
                self.log.warning("could not stop island %s: %s", self.island["name"], exc)
        if event.get("retryable", True) is False:
            raise AirflowFailException(f"island {self.island['name']}: {message}")
        raise RuntimeError(f"island {self.island['name']}: {message}")


# ------------------------------------------------------------------ merge (finalize, tests)
def merge_experiments(experiments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`Merger.merge_all()` of each experiment, in this (task) process.

    Chaos mode applies: the store goes through `training.chaos.for_process(..., "merge")`, so
    storage faults are injected, and `chaos.kill_merge_at` SIGKILLs this process at that fault
    point the first time any merge of the experiment runs (the task's retry is not armed again:
    the event is in the store's metrics; it repairs the ledger and merges on).
    """
    from training.chaos import for_process
    from training.config import parse_config
    from training.merge import Merger

    out = []
    for e in experiments:
        estore = hooks.open_experiment(e["store_url"], e["experiment"])
        cfg = parse_config(estore.read_config())
        faults_before = os.environ.get("DILOCO_FAULTS")
        try:
            estore = for_process(cfg, estore, "merge")
            versions, applied, quarantined = [], 0, 0
            for r in Merger(cfg, estore).merge_all():
                if r.version is not None:
                    versions.append(r.version)
                applied += len(r.applied)
                quarantined += len(r.quarantined)
        finally:  # an armed kill belongs to this experiment's merge only
            if faults_before is None:
                os.environ.pop("DILOCO_FAULTS", None)
            else:
                os.environ["DILOCO_FAULTS"] = faults_before
        log.info(
            "%s: versions %s, applied %d, quarantined %d", cfg.name, versions, applied, quarantined
        )
        out.append({**e, "versions": versions, "applied": applied, "quarantined": quarantined})
    return out


def islands_ended(store_url: str, experiment: str, run_id: str, islands: list[str]) -> dict:
    """Mark the island tasks of this DAG run as over (successful or not): its syncer shards and
    evaluator then end (after a last drain), so that `finalize` runs after them."""
    from training.syncer import mark_run_ended

    names = sorted(islands)
    estore = hooks.open_experiment(store_url, experiment)
    mark_run_ended(estore, run_id, {"islands": names})
    return {"run_id": run_id, "islands": names}


def finalize_experiment(store_url: str, experiment: str) -> dict[str, Any]:
    """After the islands and the syncer: a last merge of anything a failed shard left (a no-op
    normally), a final eval of the current model, and drop the experiment from the registry
    once every island of its config is done."""
    from training.config import parse_config
    from training.evaluate import end_of_run_report, evaluate_current

    merged = merge_experiments([{"store_url": store_url, "experiment": experiment}])
    estore = hooks.open_experiment(store_url, experiment)
    cfg = parse_config(estore.read_config())
    record = evaluate_current(cfg, estore)
    log.info("%s: final eval %s", experiment, record)
    report = end_of_run_report(estore)
    if report["warning"]:
        log.warning("%s: %s", experiment, report["warning"])
    done = set(estore.done())
    if {i.name for i in cfg.islands} <= done:
        unregister_experiment(store_url, experiment)
    return {
        "merged": merged,
        "eval": record,
        "best": report.get("best"),
        "warning": report["warning"],
        "done": sorted(done),
    }


# ------------------------------------------------------------------ chaos
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
    `training.chaos.run_monkey` SIGKILLs the process group of a running local island at
    exponential inter-arrival times (mean `kill_mtbi_s`, at most `max_kills`), each kill recorded
    in the store's metrics ("chaos", event "kill"); the islands' wait tasks then retry and
    relaunch them. Stops once every island of this run is done (or none has run for `idle_s`).
    Islands of other backends are not killed (logged: unsupported).
    """
    import threading

    from training.chaos import recorder, run_monkey
    from training.config import parse_config

    estore = hooks.open_experiment(store_url, experiment)
    cfg = parse_config(estore.read_config())
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
    local = list(islands.get("local") or [])
    others = [i["name"] for b in BACKENDS if b != "local" for i in islands.get(b) or []]
    if others:
        log.warning("chaos monkey: killing non-local islands is unsupported: %s", others)
    if not local:
        return {"kills": [], "unsupported": others}
    backends = {i["name"]: (_backend(i), _spec(i)) for i in local}
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

    def killpg(pgid: int, sig: int) -> None:
        os.killpg(pgid, sig)

    stop = threading.Event()
    kills: list[dict[str, Any]] = []

    def target() -> None:
        kills.extend(run_monkey(running, chaos, recorder(estore), stop=stop, kill=killpg))

    log.info(
        "%s: chaos monkey on %s: mean %.1fs between kills, at most %s",
        experiment,
        sorted(names),
        chaos.kill_mtbi_s,
        chaos.max_kills or "unlimited",
    )
    thread = threading.Thread(target=target, name="chaos-monkey", daemon=True)
    thread.start()
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
    return {"kills": kills, "unsupported": others}
