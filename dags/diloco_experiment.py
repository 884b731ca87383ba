"""diloco_experiment: create (or join) an experiment, run its islands and its syncer until done.

Trigger from the UI (the Params form maps one to one onto training.config.ExperimentConfig) or on
a schedule (DILOCO_EXPERIMENT_SCHEDULE, cron or preset; the defaults form a valid config).
Everything a run needs is in this run: `init`, the islands (one mapped task group each), the
syncer (`syncer`: one mapped deferrable task per merge shard, merging as contributions arrive),
`evaluate` (the current model on a time cadence), `islands_ended`, then `finalize` (final eval).
Nothing else needs unpausing. Structure only: the work is in plugins/diloco_airflow.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import dag, task, task_group
from diloco_airflow import operators as ops
from diloco_airflow.params import experiment_params
from diloco_airflow.syncer import EvaluatorOperator, SyncerShardOperator

RETRY_DELAY = timedelta(seconds=float(os.environ.get("DILOCO_RETRY_DELAY_S", "30")))
ISLAND_TIMEOUT = timedelta(hours=float(os.environ.get("DILOCO_ISLAND_TIMEOUT_H", "72")))
ISLAND_RETRIES = int(os.environ.get("DILOCO_ISLAND_RETRIES", "5"))
# stalled island = heartbeat older than this while its process runs (default: from heartbeat_s)
HEARTBEAT_TIMEOUT_S = float(os.environ.get("DILOCO_HEARTBEAT_TIMEOUT_S") or 0) or None

default_args = {
    "retries": 2,
    "retry_delay": RETRY_DELAY,
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=30),
    "execution_timeout": timedelta(minutes=30),
    "pool": ops.CONTROL_POOL,
}


@dag(
    dag_id="diloco_experiment",
    schedule=os.environ.get("DILOCO_EXPERIMENT_SCHEDULE") or None,
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
        return ops.init_experiment(dict(params))

    islands = init()

    @task
    def select(islands: dict, backend: str) -> list:
        return islands[backend]

    def island_group(backend: str):
        # Airflow renders map_index_template once before the task runs (then again after it):
        # before, the label comes from the form's islands of this backend (init keeps their
        # order), so a running island shows its name, not 0, 1, ...; after, from the task
        others = [b for b in ops.BACKENDS if b != backend]
        ours = (
            f"params.islands | rejectattr('backend', 'in', {others!r})"
            if backend == "local"
            else f"params.islands | selectattr('backend', 'equalto', {backend!r})"
        )
        label = (
            "{{ island_label if island_label is defined else "
            f"(({ours}) | list)[ti.map_index].name ~ ' ({backend})' }}}}"
        )

        @task_group(group_id=f"islands_{backend}")
        def run_island(island: dict):
            @task(pool=ops.pool_for(backend), map_index_template=label)
            def provision(island: dict) -> dict:
                from airflow.sdk import get_current_context

                get_current_context()["island_label"] = island["label"]
                return ops.provision_island(island)

            @task(
                pool=ops.pool_for(backend),
                map_index_template=label,
                retries=ISLAND_RETRIES,
            )
            def launch(island: dict, handle: dict) -> dict:
                from airflow.sdk import get_current_context

                get_current_context()["island_label"] = island["label"]
                return ops.launch_island(island, handle)

            @task(pool=ops.pool_for(backend), map_index_template=label)
            def teardown(island: dict) -> None:
                from airflow.sdk import get_current_context

                get_current_context()["island_label"] = island["label"]
                ops.teardown_island(island)

            prov = provision(island)
            launched = launch(island, prov)
            wait = ops.IslandWaitOperator(
                task_id="wait",
                island=island,
                pool=ops.pool_for(backend),
                map_index_template=label,
                retries=ISLAND_RETRIES,
                execution_timeout=ISLAND_TIMEOUT,
                heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            )
            down = teardown(island).as_teardown(setups=prov)
            launched >> wait >> down

        return run_island.expand(
            island=select.override(task_id=f"select_{backend}")(islands, backend)
        )

    groups = [island_group(b) for b in ops.BACKENDS]

    @task(execution_timeout=ISLAND_TIMEOUT, retries=ISLAND_RETRIES)
    def chaos_monkey(islands: dict, params=None) -> dict:
        """Chaos mode (chaos.kill_mtbi_s): SIGKILL running islands until all are done."""
        return ops.run_chaos_monkey(islands, params["store_url"], params["experiment_name"])

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

    @task(trigger_rule="all_done")
    def islands_ended(params=None, run_id=None) -> dict:
        """The island tasks of this run are over: the syncer and evaluator may end."""
        names = [i["name"] for i in params["islands"]]
        return ops.islands_ended(params["store_url"], params["experiment_name"], run_id, names)

    @task(trigger_rule="all_done")
    def finalize(params=None) -> dict:
        return ops.finalize_experiment(params["store_url"], params["experiment_name"])

    ended = islands_ended()
    [*groups, monkey] >> ended
    islands >> evaluate
    [ended, syncer, evaluate] >> finalize()


diloco_experiment()
