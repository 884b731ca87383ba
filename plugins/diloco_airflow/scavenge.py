"""The `diloco_scavenge` DAG's work: extra islands join a running experiment for a window.

    plan  -> per backend, mapped over its scavenged islands:
             join (clear the slot's markers, provision, launch, record the join)
             -> wait (deferred: `ScavengeTrigger`; ends when the window closes, the capacity is
                reclaimed or the island finishes; a crash inside the window is retried)
             -> leave (the island's stop marker, its done marker awaited, the leave recorded)
             -> teardown (an Airflow teardown of join: runs however the others end)

Joining reuses `experiment_setup.init_experiment` (the join by compare-and-swap on config.json,
the registry, the island entries); leaving reuses the stop marker of `diloco stop` and the
page (`ExperimentStore.request_stop`). The decisions are `training.config.scavenge`'s pure functions.
Heavy imports (the training package's jax parts) happen at task run time only.
"""

from __future__ import annotations

import logging
import time
from typing import Any, get_args

from airflow.sdk import Param
from airflow.sdk.exceptions import AirflowSkipException

from diloco_airflow import island_tasks, store
from diloco_airflow.island_entry import IslandEntry
from diloco_airflow.island_tasks import IslandWaitOperator
from diloco_airflow.triggers import IslandTrigger
from training.config import scavenge as rules

log = logging.getLogger(__name__)


# -- the form -------------------------------------------------------------------------------------
def scavenge_params() -> dict[str, Param]:
    """One Param per `training.config.scavenge.ScavengeConfig` field (its default, bounds and
    description): the form cannot drift from the settings it is validated against."""
    from annotated_types import Ge, Gt, Le

    out: dict[str, Param] = {}
    for name, info in rules.ScavengeConfig.model_fields.items():
        default = info.get_default(call_default_factory=True)
        ann = info.annotation
        schema: dict[str, Any] = {}
        if ann is int:
            schema["type"] = "integer"
        elif ann is float:
            schema["type"] = "number"
        elif ann is dict or getattr(ann, "__origin__", None) is dict:
            schema["type"] = "object"
        elif get_args(ann):
            schema.update(type="string", enum=list(get_args(ann)))
        else:
            schema["type"] = "string"
        for m in info.metadata:
            if isinstance(m, Gt):
                schema["exclusiveMinimum"] = m.gt
            elif isinstance(m, Ge):
                schema["minimum"] = m.ge
            elif isinstance(m, Le):
                schema["maximum"] = m.le
        if name in ("experiment", "name_prefix"):
            schema["pattern"] = rules.NAME_PATTERN.pattern
        out[name] = Param(default, title=name, description=info.description, **schema)
    return out


# -- plan ---------------------------------------------------------------------------------------
def plan_scavenge(params: dict[str, Any], opened_at: float | None = None) -> dict[str, Any]:
    """Validate the settings, check that the experiment runs (else skip the run: nothing to
    join), join the scavenged islands to it (`init_experiment`) and return
    ``{"window": {"opens_at", "closes_at"}, "local": [entry, ...], "tpu_vm": [...],
    "gke": [...]}``. The window opens at `opened_at` (the DAG run's start, so a retried plan
    keeps it; default now)."""
    from diloco_airflow.experiment_setup import init_experiment
    from training.store.objectstore import ObjectNotFound

    cfg = rules.parse_scavenge_config(params)
    win = rules.window(time.time() if opened_at is None else opened_at, cfg)
    estore = store.open_experiment(cfg.store_url, cfg.experiment)
    try:
        stored = estore.read_config()
    except ObjectNotFound:
        stored = None
    running, why = rules.experiment_running(
        stored is not None,
        estore.stop_requested(None),
        [i["name"] for i in (stored or {}).get("islands", [])],
        estore.done() if stored is not None else {},
        cfg.name_prefix,
    )
    if not running:
        raise AirflowSkipException(f"no running experiment {cfg.experiment!r} to join: {why}")
    if not rules.window_open(time.time(), win):
        raise AirflowSkipException(f"the window closed at {win['closes_at']:.0f}")
    log.info("experiment %s: %s; window until %.0f", cfg.experiment, why, win["closes_at"])
    joined = init_experiment(rules.join_params(stored, rules.scavenged_islands(cfg)))
    joined.pop("shards", None)  # the experiment's own run merges: no syncer here
    return {"window": win, **joined}


# -- join -----------------------------------------------------------------------------------------
def join_island(entry: dict, win: dict, run_id: str) -> dict[str, Any]:
    """Rejoin the slot (remove its stop and done markers of an earlier window), start it and
    record the join. Skipped when the window has closed (e.g. capacity never came)."""
    island = IslandEntry.of(entry)
    if not rules.window_open(time.time(), win):
        raise AirflowSkipException(f"window closed before {island.name} could join")
    estore = store.open_experiment(island.store_url, island.experiment)
    estore.clear_stop(island.name)
    estore.clear_done(island.name)
    handle = island_tasks.provision_island(island)
    handle = island_tasks.launch_island(island, handle)
    estore.append_metric(
        rules.METRIC, rules.join_record(island.name, island.backend, win, run_id, time.time())
    )
    log.info("island %s joined %s until %.0f", island.name, island.experiment, win["closes_at"])
    return handle


# -- wait -----------------------------------------------------------------------------------------
class ScavengeTrigger(IslandTrigger):
    """`IslandTrigger` that also ends when the window closes or the capacity is reclaimed
    (`training.config.scavenge.watch_outcome`): ``{"status": "window closed" | "reclaimed" |
    "finished", "island"}``; failures and stalls as `IslandTrigger`'s."""

    def __init__(self, closes_at: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.closes_at = float(closes_at)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return ("diloco_airflow.scavenge.ScavengeTrigger", {**kwargs, "closes_at": self.closes_at})

    def check(self, estore, backend, spec, now: float) -> dict[str, Any] | None:
        done = spec.island in estore.done()
        state = "RUNNING" if done else backend.status(spec, {}).state.value
        outcome = rules.watch_outcome(state, done, now, self.closes_at)
        if outcome == "reclaimed" and spec.island in estore.done():
            outcome = "finished"  # it wrote its done marker just before exiting
        if outcome is not None:
            return {"status": outcome, "island": spec.island}
        return super().check(estore, backend, spec, now)


class ScavengeWaitOperator(IslandWaitOperator):
    """`IslandWaitOperator` for a scavenged island: succeeds when the window closes, the
    capacity is reclaimed or the island finishes; a crash inside the window fails the try, and
    the retry relaunches the island (as in `diloco_experiment`)."""

    template_fields = ("island", "window")

    def __init__(self, *, window: Any, **kwargs) -> None:
        super().__init__(**kwargs)
        self.window = window

    def execute(self, context):
        island = IslandEntry.of(self.island)
        context["island_label"] = island.label
        self.poll_s = float(context["params"].get("poll_s") or self.poll_s)
        estore = store.open_experiment(island.store_url, island.experiment)
        done = island.name in estore.done()
        st = island.make_backend().status(island.spec, {})
        outcome = rules.watch_outcome(
            st.state.value, done, time.time(), float(self.window["closes_at"])
        )
        if outcome is not None:
            self.log.info("island %s: %s", island.name, outcome)
            return {"status": outcome, "island": island.name}
        if st.state.value not in ("RUNNING", "PROVISIONING"):
            self.log.warning("island %s is %s: relaunching it", island.name, st.state.value)
            island_tasks.launch_island(island)
        self.defer(
            trigger=ScavengeTrigger(
                closes_at=float(self.window["closes_at"]), **self.trigger_kwargs(island)
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context, event: dict[str, Any] | None = None):
        # the label of map_index_template: a resumed task has a fresh context
        context["island_label"] = IslandEntry.of(self.island).label
        if (event or {}).get("status") in rules.LEAVE_REASONS:
            self.log.info("island %s: %s", event.get("island"), event["status"])
            return event
        return super().execute_complete(context, event)


# -- leave ----------------------------------------------------------------------------------------
def leave_island(
    entry: dict,
    win: dict,
    run_id: str,
    timeout_s: float,
    poll_s: float,
    outcome: str | None = None,
) -> dict[str, Any]:
    """The island leaves: write its stop marker (it publishes its last interval, checkpoints
    and writes its done marker; the merger counts it inactive from the marker on), wait up to
    `timeout_s` for the done marker while it runs, and record the leave if it joined in this
    run. `outcome`: the wait's (None when it failed). Returns ``{"island", "reason", "clean",
    "recorded"}``."""
    island = IslandEntry.of(entry)
    estore = store.open_experiment(island.store_url, island.experiment)
    backend, now = island.make_backend(), time.time()
    done = island.name in estore.done()
    state = backend.status(island.spec, {}).state.value
    reason = rules.leave_reason(outcome, done, state, now, float(win["closes_at"]))
    estore.request_stop(island.name)
    deadline = now + timeout_s
    while rules.needs_stop_wait(state, done) and time.time() < deadline:
        time.sleep(poll_s)
        done = island.name in estore.done()
        state = backend.status(island.spec, {}).state.value
    joined = any(
        r.get("event") == "join" and r.get("island") == island.name and r.get("run_id") == run_id
        for r in estore.read_metrics(rules.METRIC)
    )
    if joined:
        record = rules.leave_record(island.name, reason, done, win, run_id, time.time())
        estore.append_metric(rules.METRIC, record)
    log.info("island %s left: %s (%s)", island.name, reason, "clean" if done else "not clean")
    return {"island": island.name, "reason": reason, "clean": done, "recorded": joined}
