"""DAG integrity: no import errors, retries / timeouts / pools on every task, fast parsing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DAGS = ROOT / "dags"
DAG_IDS = {"diloco_experiment", "diloco_maintenance", "diloco_scavenge", "diloco_export_best"}


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    import os

    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow_home")))
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) >= DAG_IDS


def test_every_task_has_retries_timeout_and_pool(dagbag):
    for dag_id in DAG_IDS:
        for t in dagbag.dags[dag_id].tasks:
            assert t.retries and t.retries > 0, f"{dag_id}.{t.task_id}: no retries"
            assert t.execution_timeout is not None, f"{dag_id}.{t.task_id}: no execution_timeout"
            assert t.pool and t.pool != "default_pool", f"{dag_id}.{t.task_id}: no pool"


def test_island_tasks_use_backend_pools_and_backoff(dagbag):
    dag = dagbag.dags["diloco_experiment"]
    for backend in ("local", "tpu_vm", "gke"):
        wait = dag.get_task(f"islands_{backend}.wait")
        assert wait.pool == f"diloco_{backend}"
        assert wait.retry_exponential_backoff
        assert wait.map_index_template
        assert dag.get_task(f"islands_{backend}.teardown").is_teardown


def test_the_syncer_runs_inside_the_experiments_own_run(dagbag):
    """No merge DAG to unpause: the shards and the evaluator are tasks of diloco_experiment."""
    assert "diloco_merge" not in dagbag.dag_ids
    dag = dagbag.dags["diloco_experiment"]
    syncer, evaluate = dag.get_task("syncer"), dag.get_task("evaluate")
    assert type(syncer).__name__ == "MappedOperator"  # one task instance per shard
    assert syncer.upstream_task_ids == {"select_shards"} and evaluate.upstream_task_ids == {"init"}
    assert dag.get_task("finalize").upstream_task_ids == {"syncer", "evaluate", "islands_ended"}
    assert dag.get_task("islands_ended").trigger_rule == "all_done"


def test_scavenge_islands_join_wait_leave_and_always_tear_down(dagbag):
    dag = dagbag.dags["diloco_scavenge"]
    assert dag.max_active_runs == 1  # one window at a time: its slots are the next one's
    for backend in ("local", "tpu_vm", "gke"):
        g = f"scavenge_{backend}"
        assert dag.get_task(f"{g}.wait").upstream_task_ids >= {f"{g}.join"}
        assert dag.get_task(f"{g}.leave").upstream_task_ids >= {f"{g}.wait"}
        assert dag.get_task(f"{g}.leave").trigger_rule == "all_done"
        assert dag.get_task(f"{g}.teardown").is_teardown
        assert type(dag.get_task(f"{g}.wait")).__name__ == "ScavengeWaitOperator"


def test_scavenge_offers_the_backends_the_experiment_offers(monkeypatch, tmp_path):
    """plan joins through init, which returns only the offered backends' islands: a scavenge
    group for any other backend would fail its select task (a KeyError, found end to end with
    DILOCO_BACKENDS=local, what `make airflow` sets)."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("DILOCO_BACKENDS", "local")
    # the package's DAG modules read the deployment's knobs when imported, once per parsing
    # process in Airflow (the dag-processor forks one per file): parse afresh here too
    for name in [m for m in sys.modules if m.startswith("diloco_airflow.dags.")]:
        monkeypatch.delitem(sys.modules, name)
    bag = DagBag(dag_folder=str(DAGS))

    def groups(dag_id: str, prefix: str) -> set[str]:
        ids = bag.dags[dag_id].task_ids
        return {t.split(".")[0][len(prefix) :] for t in ids if t.startswith(prefix) and "." in t}

    assert groups("diloco_experiment", "islands_") == {"local"}
    assert groups("diloco_scavenge", "scavenge_") == {"local"}


@pytest.mark.parametrize("path", sorted(DAGS.glob("*.py")), ids=lambda p: p.name)
def test_parse_fast_and_without_jax(path, tmp_path):
    """Each DAG file parses in a fresh interpreter (after airflow is imported) in < 1 s, no jax."""
    code = f"""
import sys, time
sys.path.insert(0, {str(ROOT / "plugins")!r})
import airflow.sdk  # the framework's own import time is not the DAG's
t = time.perf_counter()
import runpy
runpy.run_path({str(path)!r})
print(time.perf_counter() - t, "jax" in sys.modules)
"""
    env = {"AIRFLOW_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, jax_loaded = out.stdout.split()[-2:]
    assert float(seconds) < 1.0, f"{path.name} parsed in {seconds}s"
    assert jax_loaded == "False", f"{path.name} imports jax at parse time"


def test_params_match_config_presets():
    from diloco_airflow import params

    from training.config.experiment import GEMMA_PRESETS, PRESETS

    assert [*PRESETS, *GEMMA_PRESETS] == params.PRESETS


def test_default_params_make_a_valid_config():
    from diloco_airflow.params import config_from_params, experiment_params

    values = {k: p.value for k, p in experiment_params().items()} | {"experiment_name": "t"}
    cfg = config_from_params(values)
    assert values["H"] == cfg.inner.H and cfg.fragments.count == values["fragments"]


def test_syncer_params_are_derived_from_the_config():
    from diloco_airflow import params as form
    from diloco_airflow.params import config_from_params, experiment_params

    from training.config.experiment import SyncerConfig

    params = experiment_params()
    for name, info in SyncerConfig.model_fields.items():
        p = params[f"syncer_{name}"]
        default = form.FORM_DEFAULTS.get(f"syncer_{name}", info.default)
        assert p.value == default and p.description == info.description, name
    values = {k: p.value for k, p in params.items()} | {"experiment_name": "t"}
    cfg = config_from_params({**values, "fragments": 2, "syncer_shards": 2})
    assert cfg.syncer.shards == 2


def test_bad_params_fail_with_one_line():
    from diloco_airflow.params import config_from_params, experiment_params

    from training.config.experiment import ConfigError

    values = {k: p.value for k, p in experiment_params().items()} | {"experiment_name": "t"}
    values["overrides"] = {"data.seq_len": 10_000}
    with pytest.raises(ConfigError) as err:
        config_from_params(values)
    assert "\n" not in str(err.value) and "seq_len" in str(err.value)


def test_finalize_never_runs_after_a_failed_init(dagbag):
    """init failed: islands_ended (downstream of init) fails at once and the syncer and evaluator
    are upstream_failed, so finalize, which needs one successful upstream task, never runs."""
    dag = dagbag.dags["diloco_experiment"]
    assert dag.get_task("finalize").trigger_rule == "all_done_min_one_success"
    assert "init" in dag.get_task("islands_ended").upstream_task_ids


def test_unused_backends_are_absent_from_the_graph(tmp_path):
    """DILOCO_BACKENDS=local (what `make airflow` sets): no tpu_vm / gke task groups, and the
    form offers only local islands."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT / "plugins")!r})
from airflow.dag_processing.dagbag import DagBag
dag = DagBag(dag_folder={str(DAGS / "diloco_experiment.py")!r}).dags["diloco_experiment"]
print(sorted({{t.task_id.split(".")[0] for t in dag.tasks}}))
print(dag.params.get_param("islands").schema["items"]["properties"]["backend"]["enum"])
"""
    env = {"AIRFLOW_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "DILOCO_BACKENDS": "local"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    groups, enum = out.stdout.strip().splitlines()[-2:]
    assert "islands_local" in groups and "select_local" in groups
    assert not [g for g in ("tpu_vm", "gke") if g in groups], groups
    assert enum == "['local']"


def test_the_export_example_is_scheduled_on_the_watched_models_asset_of_the_default_store(dagbag):
    from diloco_airflow import knobs
    from diloco_airflow.assets import store_uri

    (asset,) = dagbag.dags["diloco_export_best"].timetable.asset_condition.objects
    assert asset.uri == store_uri(knobs.DEFAULT_STORE.get())
    (watcher,) = asset.watchers
    assert type(watcher.trigger).__name__ == "ModelEventTrigger"


def test_finalize_emits_through_the_models_alias(dagbag):
    from diloco_airflow.assets import MODELS_ALIAS

    assert dagbag.dags["diloco_experiment"].get_task("finalize").outlets == [MODELS_ALIAS]
