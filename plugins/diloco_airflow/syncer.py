"""The syncer on Airflow: merge shards and the evaluator, as deferrable tasks of the experiment's
own DAG run (design: docs/AIRFLOW.md, "The syncer"; the Airflow-free part: training/merge/syncer.py).

- `SyncerShardOperator` (mapped over the shards): in its task process it merges while
  contributions arrive (`ShardSyncer.drain`), defers to `ShardTrigger` after `syncer.idle_s`
  without a merge, resumes in `execute_complete` when new work for its shard arrives, and so on
  until the experiment is finished; then a last drain, and it returns. A shard whose lease a
  live syncer of another run holds stands by in the same trigger.
- `EvaluatorOperator`: evaluates the current model every `syncer.eval_every_s` while merges
  happen, defers to `EvalTrigger` when they stop, returns when the experiment is finished.

Triggers only read the store (they may run twice) and run every store call in a thread.
No training (jax) import at module import: this module is imported by the triggerer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from airflow.sdk import BaseOperator

from diloco_airflow import knobs, store
from diloco_airflow.triggers import PollingTrigger

log = logging.getLogger(__name__)

# A trigger fires no earlier than this after its task deferred. Airflow 3.3 fails a task that
# resumes (RUNNING) before the scheduler has processed the executor's "success" for the process
# that deferred (apache/airflow#72716, #71580; fix proposed in #71579); on a loaded machine that
# took 7 s here. Only a wake-up after an idle period pays it.
DEFER_SETTLE_S = 15.0


def _open(store_url: str, experiment: str, chaos: bool = False, arm_kill: bool = False):
    """The experiment's store; `chaos` (a merge shard): carrying the task's fault plan
    (`knobs.fault_plan`, plus chaos mode's merge kill when `arm_kill`), storage faults on when
    configured."""
    if not chaos:
        return store.open_experiment(store_url, experiment)
    from training.faults.chaos import arm_merge_kill, chaos_store

    estore = store.open_experiment(store_url, experiment, knobs.fault_plan())
    cfg = estore.config()
    if arm_kill:  # chaos.kill_merge_at: one merge process, shard 0's (never two at once)
        estore = estore.with_faults(arm_merge_kill(cfg, estore, estore.faults))
    return chaos_store(estore, cfg.chaos)


class SyncerShardOperator(BaseOperator):
    """One merge shard of an experiment (mapped: one task instance per shard).

    Returns ``{"shard", "merges", "applied", "reason"}`` once the experiment is finished
    (every island done or asked to leave, or this run's islands ended).
    """

    template_fields = ("store_url", "experiment", "run_id")

    def __init__(
        self, *, store_url: str, experiment: str, shard: int, run_id: str = "{{ run_id }}", **kw
    ) -> None:
        super().__init__(**kw)
        self.store_url = store_url
        self.experiment = experiment
        self.shard = shard
        self.run_id = run_id

    def execute(self, context):
        return self._drain(context)

    def execute_complete(self, context, event: dict[str, Any] | None = None):
        event = event or {}
        if event.get("status") == "error":
            raise RuntimeError(f"shard {self.shard}: {event.get('message')}")
        self.log.info("shard %d woken: %s", self.shard, event)
        return self._drain(context)

    def _drain(self, context):
        from training.merge.syncer import ShardSyncer, merge_line

        context["shard_label"] = f"shard {self.shard}"
        estore = _open(self.store_url, self.experiment, chaos=True, arm_kill=self.shard == 0)
        owner = self.run_id  # a retry of this task takes its own lease back at once
        started = time.monotonic()

        def on_merge(r) -> None:  # one line per merge in this task's log
            self.log.info("%s", merge_line(self.shard, r, time.time()))

        syncer = ShardSyncer(
            estore,
            self.shard,
            owner,
            run_id=self.run_id,
            on_merge=on_merge,
            **self._housekeeping(),
        )
        self._syncer = syncer  # on_kill (SIGTERM) asks it to stop
        out = syncer.drain()
        self.log.info(
            "shard %d (fragments %s): %s after %.0fs, %d merges, %d applied",
            self.shard,
            syncer.fragments,
            out.reason,
            time.monotonic() - started,
            out.merges,
            out.applied,
        )
        if out.reason == "finished":
            return {"shard": self.shard, "merges": out.merges, "applied": out.applied}
        if out.reason == "terminated":
            raise RuntimeError(f"shard {self.shard}: stopped by SIGTERM (light HEADs promoted)")
        self.defer(
            trigger=ShardTrigger(
                store_url=self.store_url,
                experiment=self.experiment,
                shard=self.shard,
                owner=owner,
                run_id=self.run_id,
                seen=out.pending,
                poll_s=syncer.settings.poll_s,
                settle_until=time.time() + DEFER_SETTLE_S,
            ),
            method_name="execute_complete",
        )

    def on_kill(self) -> None:
        """SIGTERM (Airflow calls this from the signal handler): the drain ends after the merge
        in progress, promoting the light HEADs it holds (ShardSyncer.request_stop)."""
        syncer = getattr(self, "_syncer", None)
        if syncer is not None:
            syncer.request_stop()

    def _housekeeping(self) -> dict[str, Any]:
        """Shard 0 collects the experiment's garbage while it merges (`knobs.GC_EVERY_S`)."""
        if self.shard != 0:
            return {}
        from diloco_airflow import retention

        plain = store.open_experiment(self.store_url, self.experiment)  # no chaos faults
        return {
            "housekeeping": lambda: retention.collect(plain),
            "housekeeping_every_s": knobs.GC_EVERY_S.get(),
        }


class EvaluatorOperator(BaseOperator):
    """Evaluates the current global model on a time cadence (`syncer.eval_every_s`)."""

    template_fields = ("store_url", "experiment", "run_id")

    def __init__(
        self, *, store_url: str, experiment: str, run_id: str = "{{ run_id }}", **kw
    ) -> None:
        super().__init__(**kw)
        self.store_url = store_url
        self.experiment = experiment
        self.run_id = run_id

    def execute(self, context):
        return self._run(None, 0.0)

    def execute_complete(self, context, event: dict[str, Any] | None = None):
        event = event or {}
        if event.get("status") == "error":
            raise RuntimeError(f"evaluator: {event.get('message')}")
        return self._run(event.get("evaluated"), float(event.get("last_eval_at") or 0.0))

    def _run(self, evaluated: str | None, last_eval_at: float):
        import training.model.evaluate  # noqa: F401 - jax: imported now, not at the first eval
        from training.merge.evaluator import Evaluator

        estore = _open(self.store_url, self.experiment)
        ev = Evaluator(
            estore,
            run_id=self.run_id,
            evaluated=evaluated,
            last_eval_at=last_eval_at,
            on_record=lambda r: self.log.info("eval: %s", r),
        )
        out = ev.run()
        if out.reason == "finished":
            return {"evals": len(out.records), "evaluated": out.evaluated}
        cfg = ev.view.config()
        self.defer(
            trigger=EvalTrigger(
                store_url=self.store_url,
                experiment=self.experiment,
                run_id=self.run_id,
                evaluated=out.evaluated,
                last_eval_at=out.last_eval_at,
                not_before=out.last_eval_at + cfg.syncer.eval_every_s,
                poll_s=max(cfg.syncer.poll_s, 1.0),
                settle_until=time.time() + DEFER_SETTLE_S,
            ),
            method_name="execute_complete",
        )


class ShardTrigger(PollingTrigger):
    """Fires when shard `shard` of `experiment` has work, or the experiment is finished.

    From `settle_until` on. Payloads: ``{"status": "finished"}``; ``{"status": "pending",
    "new": n}`` when a pending pseudo-gradient of this shard not in `seen` (those the syncer
    left unmergeable) exists and the shard's lease is free, expired or `owner`'s (another
    owner's live lease: its syncer merges them); ``{"status": "error", "message"}`` after
    `triggers.MAX_POLL_ERRORS` failed polls in a row.
    """

    def __init__(
        self,
        store_url: str,
        experiment: str,
        shard: int,
        owner: str,
        run_id: str | None = None,
        seen: list[str] | None = None,
        poll_s: float = 1.0,
        settle_until: float = 0.0,
    ) -> None:
        super().__init__()
        self.store_url = store_url
        self.experiment = experiment
        self.shard = int(shard)
        self.owner = owner
        self.run_id = run_id
        self.seen = sorted(seen or [])
        self.poll_s = float(poll_s)
        self.settle_until = float(settle_until)
        self._view = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "diloco_airflow.syncer.ShardTrigger",
            {
                "store_url": self.store_url,
                "experiment": self.experiment,
                "shard": self.shard,
                "owner": self.owner,
                "run_id": self.run_id,
                "seen": self.seen,
                "poll_s": self.poll_s,
                "settle_until": self.settle_until,
            },
        )

    @property
    def label(self) -> str:
        return f"shard {self.shard}"

    def poll(self) -> dict[str, Any] | None:
        from training.merge.syncer import ShardView, lease_action

        if self._view is None:
            estore = store.open_experiment(self.store_url, self.experiment)
            self._view = ShardView(estore, self.shard, self.run_id)
        view = self._view
        cfg = view.config()
        if view.finished(cfg):
            return {"status": "finished"}
        if lease_action(view.lease(), self.owner, time.time()) == "wait":
            return None
        new = set(view.pending(cfg))
        new -= set(self.seen)
        return {"status": "pending", "new": len(new)} if new else None


class EvalTrigger(PollingTrigger):
    """Fires when a merge happened since the model `evaluated` and `not_before` has passed
    (``{"status": "changed", "evaluated", "last_eval_at"}``), or the experiment is finished;
    ``{"status": "error", "message"}`` after `triggers.MAX_POLL_ERRORS` failed polls in a row."""

    def __init__(
        self,
        store_url: str,
        experiment: str,
        run_id: str | None = None,
        evaluated: str | None = None,
        last_eval_at: float = 0.0,
        not_before: float = 0.0,
        poll_s: float = 2.0,
        settle_until: float = 0.0,
    ) -> None:
        super().__init__()
        self.store_url = store_url
        self.experiment = experiment
        self.run_id = run_id
        self.evaluated = evaluated
        self.last_eval_at = float(last_eval_at)
        self.not_before = float(not_before)
        self.poll_s = float(poll_s)
        self.settle_until = float(settle_until)
        self._view = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "diloco_airflow.syncer.EvalTrigger",
            {
                "store_url": self.store_url,
                "experiment": self.experiment,
                "run_id": self.run_id,
                "evaluated": self.evaluated,
                "last_eval_at": self.last_eval_at,
                "not_before": self.not_before,
                "poll_s": self.poll_s,
                "settle_until": self.settle_until,
            },
        )

    @property
    def label(self) -> str:
        return "evaluator"

    def poll(self) -> dict[str, Any] | None:
        from training.merge.evaluator import latest_merge
        from training.merge.syncer import ShardView

        if self._view is None:
            estore = store.open_experiment(self.store_url, self.experiment)
            self._view = ShardView(estore, 0, self.run_id)
        view = self._view
        if view.finished(view.config()):
            return {"status": "finished"}
        if time.time() < self.not_before:
            return None
        if latest_merge(view.estore) in (None, self.evaluated):
            return None
        return {"status": "changed", "evaluated": self.evaluated, "last_eval_at": self.last_eval_at}
