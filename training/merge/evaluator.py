"""The evaluator: the current global model evaluated on a time cadence, in a process of its own
(the experiment DAG's evaluate task, `plugins/diloco_airflow/syncer.py`), so it never delays a
merge. `Evaluator.run` evaluates at most every `syncer.eval_every_s` seconds while merges happen
(`eval_due`: a merge record newer than the model last evaluated, `latest_merge`), and returns
"idle" after `syncer.idle_s` without a merge (the caller defers) or "finished" with the
experiment (`ShardView.finished`, training/merge/syncer.py). Imports no jax until it evaluates:
Airflow triggers import it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from training.config.experiment import ExperimentConfig
from training.merge.syncer import ShardView
from training.store.experiment import ExperimentStore


def latest_merge(estore: ExperimentStore) -> str | None:
    """The name of the newest merge record (a listing, no reads): changes with every merge."""
    return estore.newest_metric("merge")


def eval_due(now: float, last_eval_at: float, evaluated: str | None, latest: str | None, every_s):
    """Evaluate now: a merge happened since the model last evaluated, `every_s` have passed."""
    return latest is not None and latest != evaluated and now - last_eval_at >= every_s


@dataclass
class EvalOutcome:
    reason: Literal["idle", "finished"]
    evaluated: str | None  # the merge record of the last model evaluated
    last_eval_at: float
    records: list[dict] = field(default_factory=list)


class Evaluator:
    """Evaluates the current global model every `eval_every_s` seconds while it changes.

    `run()` returns "idle" after `idle_s` without a merge (the caller defers), or "finished".
    `evaluate(cfg)` defaults to `training.model.evaluate.evaluate_current` (which records the eval).
    """

    def __init__(
        self,
        estore: ExperimentStore,
        *,
        run_id: str | None = None,
        evaluated: str | None = None,
        last_eval_at: float = 0.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        evaluate: Callable[[ExperimentConfig], dict] | None = None,
        on_record: Callable[[dict], None] | None = None,
    ):
        self.estore = estore
        self.view = ShardView(estore, 0, run_id)
        self.evaluated = evaluated
        self.last_eval_at = last_eval_at
        self.clock = clock
        self.sleep = sleep
        self.evaluate = evaluate or self._evaluate_current
        self.on_record = on_record or (lambda record: None)

    def _evaluate_current(self, cfg: ExperimentConfig) -> dict:
        from training.merge.replay import params_of  # jax: only in the evaluating process
        from training.model.evaluate import evaluate_current

        return evaluate_current(cfg, self.estore, params_of(cfg, self.estore))

    def run(self) -> EvalOutcome:
        records: list[dict] = []
        seen, changed_at = latest_merge(self.estore), self.clock()
        while True:
            cfg = self.view.config()
            s = cfg.syncer
            if self.view.finished(cfg):
                return EvalOutcome("finished", self.evaluated, self.last_eval_at, records)
            latest = latest_merge(self.estore)
            now = self.clock()
            if latest != seen:
                seen, changed_at = latest, now
            if eval_due(now, self.last_eval_at, self.evaluated, latest, s.eval_every_s):
                record = self.evaluate(cfg)
                self.evaluated, self.last_eval_at = latest, self.clock()
                records.append(record)
                self.on_record(record)
                continue
            if now - changed_at >= s.idle_s:
                return EvalOutcome("idle", self.evaluated, self.last_eval_at, records)
            self.sleep(max(s.poll_s, min(s.eval_every_s / 4, 5.0)))
