"""The task group of one backend's islands in `diloco_experiment`, mapped over its entries:
provision -> launch -> wait (deferred, `IslandWaitOperator`) -> teardown (an Airflow teardown of
provision: it runs however the others end).

Every task runs in the backend's pool (`pools.pool_for`) and is labelled by the island
(``map_index_template``); launch and wait retry ``DILOCO_ISLAND_RETRIES`` times.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import task, task_group

from diloco_airflow import island_tasks
from diloco_airflow.pools import pool_for


def label_template(backend: str, backends) -> str:
    """The island's label for ``map_index_template``. Airflow renders it once before the task
    runs (then again after it): before, the label comes from the form's islands of this backend
    (init keeps their order), so a running island shows its name, not 0, 1, ...; after, from
    the `island_label` the task set."""
    others = [b for b in backends if b != backend]
    ours = (
        f"params.islands | rejectattr('backend', 'in', {others!r})"
        if backend == "local"
        else f"params.islands | selectattr('backend', 'equalto', {backend!r})"
    )
    return (
        "{{ island_label if island_label is defined else "
        f"(({ours}) | list)[ti.map_index].name ~ ' ({backend})' }}}}"
    )


def _label(island: dict) -> None:
    from airflow.sdk import get_current_context

    get_current_context()["island_label"] = island["label"]


def island_group(
    backend: str,
    islands,
    *,
    retries: int,
    timeout: timedelta,
    heartbeat_timeout_s: float | None,
):
    """Map the island task group of `backend` over `islands` (an XComArg: a list of entry
    dicts); returns the mapped group."""
    from diloco_airflow.backends.registry import BACKENDS

    pool = pool_for(backend)
    label = label_template(backend, BACKENDS)

    @task_group(group_id=f"islands_{backend}")
    def run_island(island: dict):
        @task(pool=pool, map_index_template=label)
        def provision(island: dict) -> dict:
            _label(island)
            return island_tasks.provision_island(island)

        @task(pool=pool, map_index_template=label, retries=retries)
        def launch(island: dict, handle: dict) -> dict:
            _label(island)
            return island_tasks.launch_island(island, handle)

        @task(pool=pool, map_index_template=label)
        def teardown(island: dict) -> None:
            _label(island)
            island_tasks.teardown_island(island)

        prov = provision(island)
        launched = launch(island, prov)
        wait = island_tasks.IslandWaitOperator(
            task_id="wait",
            island=island,
            pool=pool,
            map_index_template=label,
            retries=retries,
            execution_timeout=timeout,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
        down = teardown(island).as_teardown(setups=prov)
        launched >> wait >> down

    return run_island.expand(island=islands)
