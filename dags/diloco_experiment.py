"""diloco_experiment: create (or join) an experiment, run its islands and its syncer until done.

Trigger from the UI (the Params form maps one to one onto training.config.ExperimentConfig) or on
a schedule (DILOCO_EXPERIMENT_SCHEDULE, cron or preset; the defaults form a valid config).
Everything a run needs is in this run: `init`, the islands (one mapped task group each), the
syncer (`syncer`: one mapped deferrable task per merge shard, merging as contributions arrive),
`evaluate` (the current model on a time cadence), `islands_ended`, then `finalize` (final eval).
Nothing else needs unpausing. Structure only: the work is in plugins/diloco_airflow.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task
from diloco_airflow import knobs
from diloco_airflow.backends.registry import BACKENDS
from diloco_airflow.chaos_monkey import run_chaos_monkey
from diloco_airflow.experiment_end import finalize_experiment, islands_ended
from diloco_airflow.experiment_setup import init_experiment
from diloco_airflow.island_group import island_group
from diloco_airflow.params import experiment_params
from diloco_airflow.pools import CONTROL_POOL
from diloco_airflow.syncer import EvaluatorOperator, SyncerShardOperator

RETRY_DELAY = timedelta(seconds=knobs.RETRY_DELAY_S.get())
ISLAND_TIMEOUT = timedelta(hours=knobs.ISLAND_TIMEOUT_H.get())
ISLAND_RETRIES = knobs.ISLAND_RETRIES.get()

default_args = {
    "retries": 2,
    "retry_delay": RETRY_DELAY,
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=30),
    "execution_timeout": timedelta(minutes=30),
    "pool": CONTROL_POOL,
}


@dag(
    dag_id="diloco_experiment",
    schedule=knobs.EXPERIMENT_SCHEDULE.get(),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    params=experiment_params(),
    default_args=default_args,
    tags=["diloco"],
    render_template_as_native_obj=True,
    doc_md=__doc__,
)
def diloco_experiment():
    @task
    def init(params=None) -> dict:
        return init_experiment(dict(params))

    islands = init()

    @task
    def select(islands: dict, key: str) -> list:
        return islands[key]

    groups = [
        island_group(
            b,
            select.override(task_id=f"select_{b}")(islands, b),
            retries=ISLAND_RETRIES,
            timeout=ISLAND_TIMEOUT,
            heartbeat_timeout_s=knobs.HEARTBEAT_TIMEOUT_S.get(),
        )
        for b in BACKENDS
    ]

    @task(execution_timeout=ISLAND_TIMEOUT, retries=ISLAND_RETRIES)
    def chaos_monkey(islands: dict, params=None) -> dict:
        """Chaos mode (chaos.kill_mtbi_s): SIGKILL running islands until all are done."""
        return run_chaos_monkey(islands, params["store_url"], params["experiment_name"])

    monkey = chaos_monkey(islands)

    store_url, experiment = "{{ params.store_url }}", "{{ params.experiment_name }}"
    syncer = SyncerShardOperator.partial(
        task_id="syncer",
        store_url=store_url,
        experiment=experiment,
        map_index_template="{{ shard_label }}",
        retries=ISLAND_RETRIES,
        execution_timeout=ISLAND_TIMEOUT,
    ).expand(shard=select.override(task_id="select_shards")(islands, "shards"))
    evaluate = EvaluatorOperator(
        task_id="evaluate",
        store_url=store_url,
        experiment=experiment,
        retries=ISLAND_RETRIES,
        execution_timeout=ISLAND_TIMEOUT,
    )

    @task(task_id="islands_ended", trigger_rule="all_done")
    def end_islands(params=None, run_id=None) -> dict:
        """The island tasks of this run are over: the syncer and evaluator may end."""
        names = [i["name"] for i in params["islands"]]
        return islands_ended(params["store_url"], params["experiment_name"], run_id, names)

    @task(trigger_rule="all_done")
    def finalize(params=None) -> dict:
        return finalize_experiment(params["store_url"], params["experiment_name"])

    ended = end_islands()
    [*groups, monkey] >> ended
    islands >> evaluate
    [ended, syncer, evaluate] >> finalize()


diloco_experiment()
