"""# diloco_experiment: train one model on several islands with Decoupled DiLoCo

**What a run does.** `init` checks the form and creates the experiment in the store (or joins
it: the same name again adds the islands listed). Each island then trains on its own data shard
(a task group per backend: provision, launch, wait, teardown) and publishes pseudo-gradients to
the store every H steps; the `syncer` merges them into the global model as they arrive (one
task per merge shard) and `evaluate` measures that model on held-out data every
`syncer_eval_every_s` seconds. When the islands are done (the token budget is merged, or they
were stopped), `islands_ended` and `finalize` run a last merge and a final eval; the run ends on
its best evaluated snapshot.

**Where to watch it.** The DiLoCo page (Browse -> DiLoCo, or the "DiLoCo" tab of this run, or
the "DiLoCo page" link of any task): loss curve, islands, merges, with "stop island" and "stop
experiment". Each island's `wait` task logs a progress line every 10 s; each `syncer` task one
line per merge; `diloco status --store URL --experiment NAME` shows the same from a shell.

**What success means.** The run is green when every island finished its share and `finalize`
wrote the final eval: the model in the store (`fragments/*/HEAD.json`, `snapshots/`) is the
trained one, and the page's eval curve went down. A red `init` means the form's values cannot
work (its log says why in one line); nothing was created then, and nothing else runs. A red
island whose retries ran out leaves the others training; `finalize` still runs.

Settings of the deployment (environment, read when the DAG is parsed): `DILOCO_BACKENDS` (the
backends offered: their task groups exist only for these), `DILOCO_DEFAULT_STORE`, and the
others in plugins/diloco_airflow/knobs.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from diloco_airflow import knobs
from diloco_airflow.assets import MODELS_ALIAS, finished_event
from diloco_airflow.backends.registry import enabled_backends
from diloco_airflow.chaos_monkey import run_chaos_monkey
from diloco_airflow.experiment_end import finalize_experiment, islands_ended
from diloco_airflow.experiment_setup import run_init
from diloco_airflow.island_group import island_group
from diloco_airflow.params import experiment_of, experiment_params, run_params
from diloco_airflow.pools import CONTROL_POOL
from diloco_airflow.syncer import EvaluatorOperator, SyncerShardOperator

RETRY_DELAY = timedelta(seconds=knobs.RETRY_DELAY_S.get())
ISLAND_TIMEOUT = timedelta(hours=knobs.ISLAND_TIMEOUT_H.get())
ISLAND_RETRIES = knobs.ISLAND_RETRIES.get()
# Only these backends' task groups are in the graph (DILOCO_BACKENDS, read at parse time: an
# Airflow 3 DAG's structure is fixed then); init refuses islands on any other backend.
OFFERED_BACKENDS = enabled_backends()

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
    user_defined_macros={"experiment_of": experiment_of},
    doc_md=__doc__,
)
def diloco_experiment():
    @task
    def init(params=None, run_id=None) -> dict:
        return run_init(run_params(dict(params), run_id))

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
        for b in OFFERED_BACKENDS
    ]

    @task(execution_timeout=ISLAND_TIMEOUT, retries=ISLAND_RETRIES)
    def chaos_monkey(islands: dict, params=None, run_id=None) -> dict:
        """Chaos mode (chaos.kill_mtbi_s): SIGKILL running islands until all are done."""
        return run_chaos_monkey(islands, params["store_url"], experiment_of(params, run_id))

    monkey = chaos_monkey(islands)

    store_url, experiment = "{{ params.store_url }}", "{{ experiment_of(params, run_id) }}"
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
    def end_islands(params=None, run_id=None, ti=None) -> dict:
        """The island tasks of this run are over: the syncer and evaluator may end. Fails at
        once (no retry) when init did not finish: there is no experiment of this run to end,
        and `finalize` (none of its upstream tasks succeeded) does not run."""
        if ti.xcom_pull(task_ids="init") is None:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException("init did not finish: this run created no experiment")
        names = [i["name"] for i in params["islands"]]
        return islands_ended(params["store_url"], experiment_of(params, run_id), run_id, names)

    # all done, at least one of islands_ended / syncer / evaluate successful: never after a
    # failed init (then islands_ended fails and the others are upstream_failed)
    # its outlet: the "finished" asset event of the run's store (diloco_airflow/assets.py)
    @task(trigger_rule="all_done_min_one_success", outlets=[MODELS_ALIAS])
    def finalize(params=None, run_id=None, outlet_events=None) -> dict:
        experiment = experiment_of(params, run_id)
        out = finalize_experiment(params["store_url"], experiment, run_id)
        if out.get("eval"):  # this run ended the experiment's run (not another run's finalize)
            extra = {**out["eval"], "over": out["over"]}
            out["asset_event"] = finished_event(
                outlet_events, params["store_url"], experiment, extra
            )
        return out

    ended = end_islands()
    islands >> ended
    [*groups, monkey] >> ended
    islands >> evaluate
    [ended, syncer, evaluate] >> finalize()
