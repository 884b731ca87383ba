"""The syncer's Airflow operators, called as Airflow calls them (no Airflow running): a shard task
merges in its process, defers to its trigger when idle, and returns once the run is finished."""

from __future__ import annotations

import numpy as np
import pytest
from airflow.sdk.exceptions import TaskDeferred
from diloco_airflow.syncer import EvalTrigger, EvaluatorOperator, ShardTrigger, SyncerShardOperator

from tests.helpers import new_store, publish_delta, small_config
from training.config.experiment import with_overrides

FAST = {"shards": 2, "idle_s": 0.3, "poll_s": 0.05, "eval_every_s": 0.1}


@pytest.fixture
def exp(tmp_path):
    url = f"file://{tmp_path / 'store'}"
    cfg = small_config("op", fragments={"count": 2}, syncer=FAST)
    return url, new_store(cfg, url), cfg


def _publish(store, cfg, fragment):
    from training.model.runtime import fragment_names

    params = store.load_params()
    delta = {n: np.full(params[n].shape, 1e-3, np.float32) for n in fragment_names(cfg)[fragment]}
    return publish_delta(store, cfg, "a", 0, delta, fragment=fragment).id


def _shard(url, cfg, shard=0):
    return SyncerShardOperator(
        task_id="syncer", store_url=url, experiment=cfg.name, shard=shard, run_id="run-1"
    )


def test_a_shard_task_merges_then_defers_to_its_trigger_when_idle(exp):
    url, store, cfg = exp
    mine, theirs = _publish(store, cfg, 0), _publish(store, cfg, 1)
    context = {}
    with pytest.raises(TaskDeferred) as deferred:
        _shard(url, cfg).execute(context)
    assert set(store.applied()) == {mine} and theirs not in store.applied()
    trigger = deferred.value.trigger
    assert isinstance(trigger, ShardTrigger)
    assert (trigger.shard, trigger.owner, trigger.seen) == (0, "run-1", [])
    assert deferred.value.method_name == "execute_complete"
    assert context["shard_label"] == "shard 0"


def test_a_shard_task_returns_after_a_last_drain_once_its_runs_islands_ended(exp):
    url, store, cfg = exp
    pg = _publish(store, cfg, 1)
    store.mark_run_ended("run-1", ["a", "b"])
    out = _shard(url, cfg, shard=1).execute_complete({}, {"status": "finished"})
    assert out == {"shard": 1, "merges": 1, "applied": 1} and pg in store.applied()


def test_a_trigger_error_fails_the_shard_task_so_that_it_retries(exp):
    url, _, cfg = exp
    with pytest.raises(RuntimeError, match="cannot poll"):
        _shard(url, cfg).execute_complete({}, {"status": "error", "message": "cannot poll"})


def test_the_evaluator_evaluates_a_new_merge_then_defers_until_the_next(exp):
    url, store, cfg = exp
    _publish(store, cfg, 0)
    from training.merge.merger import Merger

    # one pass merges at once (no grace floor: b, the other island, would be waited for)
    assert Merger(with_overrides(cfg, {"outer.grace_min_steps": 0.0}), store).merge_once().applied
    op = EvaluatorOperator(task_id="evaluate", store_url=url, experiment=cfg.name, run_id="r")
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    [record] = store.read_metrics("eval")
    assert record["version"] == 1 and np.isfinite(record["loss"]) and "at" in record
    trigger = deferred.value.trigger
    assert isinstance(trigger, EvalTrigger) and trigger.evaluated is not None
    assert trigger.not_before == pytest.approx(trigger.last_eval_at + FAST["eval_every_s"])
