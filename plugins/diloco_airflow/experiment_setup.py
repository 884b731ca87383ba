"""The `init` task: validate the form, create the experiment or join it, hand out the islands.

`run_init` is the task: a permanent error (`permanent_reason`: a bad config or budget, a
backend this DAG does not offer, a store URL that cannot work, a store that refuses us) fails it
at once, without retries, with one line; anything else (a store that did not answer) is
retried. Heavy imports (the training package, jax) happen inside the functions, at run time.
"""

from __future__ import annotations

import logging
from typing import Any

from diloco_airflow import knobs, store
from diloco_airflow.backends.registry import enabled_backends
from diloco_airflow.experiment_registry import register_experiment
from diloco_airflow.island_entry import island_entry

log = logging.getLogger(__name__)

# jax probes for a TPU on first use and logs "Unable to initialize backend 'tpu': ... libtpu.so"
# at INFO, the first line of every init log on a worker without one: only its warnings show.
# Every task of diloco_experiment imports this module (the DAG file does).
JAX_PROBE_LOGGER = "jax._src.xla_bridge"
logging.getLogger(JAX_PROBE_LOGGER).setLevel(logging.WARNING)


def permanent_reason(exc: BaseException) -> str | None:
    """The one-line reason when `exc` is an error no retry can fix, else None (retry it):
    `ConfigError`, a bad store URL (ValueError from `open_store`), and `StoreUnreachable` but
    for `StoreConnectionError` (the endpoint did not answer)."""
    from training.config.experiment import ConfigError
    from training.store.objectstore import StoreConnectionError, StoreUnreachable

    if isinstance(exc, StoreConnectionError):
        return None
    if isinstance(exc, ConfigError | StoreUnreachable | ValueError):
        lines = str(exc).strip().splitlines()
        return lines[0][:500] if lines else type(exc).__name__
    return None


INIT_ERROR_KEY = "init_error"
"""The XCom key of a failed init's one-line reason (the DiLoCo tab of its run shows it)."""


def run_init(params: dict[str, Any]) -> dict[str, list]:
    """`init_experiment`, with permanent errors raised as `AirflowFailException` (no retry),
    their reason also pushed as the XCom `INIT_ERROR_KEY` (in a task)."""
    try:
        return init_experiment(params)
    except Exception as exc:
        reason = permanent_reason(exc)
        if reason is None:
            raise
        from airflow.sdk.exceptions import AirflowFailException

        log.error("init: %s", reason)
        _push_reason(reason)
        raise AirflowFailException(reason) from None


def _push_reason(reason: str) -> None:
    from airflow.sdk import get_current_context

    try:
        ti = get_current_context()["ti"]
    except Exception:  # not in a task (tests, `dag.test` without a context)
        return
    ti.xcom_push(key=INIT_ERROR_KEY, value=reason)


def check_backends(cfg, offered: tuple[str, ...]) -> None:
    """ConfigError naming the first island whose backend this DAG does not offer."""
    from training.config.experiment import ConfigError

    for isl in cfg.islands:
        if isl.backend not in offered:
            raise ConfigError(
                f"island {isl.name!r}: backend {isl.backend!r} is not offered here "
                f"({knobs.BACKENDS.name}={','.join(offered)})"
            )


def budget_warning(cfg) -> str | None:
    """The warning of a budget that would take longer than `knobs.BUDGET_HORIZON_H` hours on
    the config's islands (`training.config.estimate`), or None."""
    from training.config.estimate import budget_warning as estimate

    return estimate(cfg, knobs.BUDGET_HORIZON_H.get())


def init_experiment(params: dict[str, Any]) -> dict[str, list]:
    """Validate the form, create the experiment or join it, return the islands by backend
    (``{"local": [...], "tpu_vm": [...], "gke": [...]}``, `IslandEntry.to_dict` each) and the
    syncer's shards (``"shards": [0, ..., S-1]``, one mapped merge task each).

    The checks, the create-or-join, version 0 and its first eval are the library's
    (`training.usecases.create.create_or_join`, also `diloco init`), with this DAG's own check that
    it offers every island's backend. Joining (the experiment exists): every setting but the
    island list must equal the stored config; islands not in it yet are added by
    compare-and-swap on config.json (each needs a free data shard, see docs/STORE.md); islands
    already in it must be asked for with the same settings.
    """
    from diloco_airflow.params import config_from_params
    from training.usecases.create import create_or_join

    cfg = config_from_params(params)
    warning = budget_warning(cfg)
    if warning:
        log.warning("init: %s", warning)
    offered = enabled_backends()
    estore = store.DilocoStoreHook(store_url=cfg.store_url).experiment(cfg.name)
    result = create_or_join(cfg, estore, checks=[lambda c: check_backends(c, offered)])
    cfg_all = result.config
    # only the islands of this trigger run here; islands of earlier runs keep running there
    entries = [island_entry(cfg_all, cfg_all.island(name)) for name in result.islands]
    register_experiment(cfg.store_url, cfg.name, entries)
    out: dict[str, list] = {b: [] for b in offered}
    for e in entries:
        out[e.backend].append(e.to_dict())
    out["shards"] = list(range(cfg_all.syncer.shards))
    return out
