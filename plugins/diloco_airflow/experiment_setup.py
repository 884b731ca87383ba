"""The `init` task: validate the form, create the experiment or join it, hand out the islands.

`run_init` is the task: a permanent error (`permanent_reason`: a bad config or budget, a
backend this DAG does not offer, a store URL that cannot work, a store that refuses us) fails it
at once, without retries, with one line; anything else (a store that did not answer) is
retried. Heavy imports (the training package, jax) happen inside the functions, at run time.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from diloco_airflow import knobs, store
from diloco_airflow.backends.registry import enabled_backends
from diloco_airflow.experiment_registry import register_experiment
from diloco_airflow.island_entry import island_entry

log = logging.getLogger(__name__)


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


def run_init(params: dict[str, Any]) -> dict[str, list]:
    """`init_experiment`, with permanent errors raised as `AirflowFailException` (no retry)."""
    try:
        return init_experiment(params)
    except Exception as exc:
        reason = permanent_reason(exc)
        if reason is None:
            raise
        from airflow.sdk.exceptions import AirflowFailException

        log.error("init: %s", reason)
        raise AirflowFailException(reason) from None


def check_backends(cfg, offered: tuple[str, ...]) -> None:
    """ConfigError naming the first island whose backend this DAG does not offer."""
    from training.config.experiment import ConfigError

    for isl in cfg.islands:
        if isl.backend not in offered:
            raise ConfigError(
                f"island {isl.name!r}: backend {isl.backend!r} is not offered here "
                f"({knobs.BACKENDS.name}={','.join(offered)})"
            )


def init_experiment(params: dict[str, Any]) -> dict[str, list]:
    """Validate the form, create the experiment or join it, return the islands by backend
    (``{"local": [...], "tpu_vm": [...], "gke": [...]}``, `IslandEntry.to_dict` each) and the
    syncer's shards (``"shards": [0, ..., S-1]``, one mapped merge task each).

    Joining (the experiment exists): every setting but the island list must equal the stored
    config (`training.config.experiment.check_same_settings`); islands not in it yet are added by compare-and-swap on
    config.json (`ExperimentStore.add_islands`: each needs a free data shard, see
    docs/STORE.md); islands already in it must be asked for with the same settings.
    """
    from diloco_airflow.params import config_from_params
    from training.config.experiment import check_budget, check_same_settings, parse_config
    from training.store.experiment import ExperimentExists
    from training.store.objectstore import ObjectNotFound

    cfg = config_from_params(params)
    check_budget(cfg)
    check_backends(cfg, enabled_backends())
    from training.model.definition import definition

    definition(cfg.model)  # a model.factory that does not resolve: a ConfigError before any write
    hook = store.DilocoStoreHook(store_url=cfg.store_url)
    hook.check()  # unreachable bucket / missing credentials: fail now, with the store's message
    estore = hook.experiment(cfg.name)
    wanted = json.loads(cfg.to_json())
    try:
        existing = estore.read_config()
    except ObjectNotFound:
        existing = None
    if existing is None:
        try:
            estore.write_config(wanted)
            cfg_all = cfg
        except ExperimentExists:  # created by a concurrent trigger in between: join it
            existing = estore.read_config()
    if existing is not None:
        check_same_settings(existing, wanted)  # the same experiment, or a one-line ConfigError
        known = {i["name"] for i in existing.get("islands", [])}
        joined = estore.add_islands([i.model_dump(mode="json") for i in cfg.islands])
        cfg_all = parse_config(joined)
        new = [i.name for i in cfg.islands if i.name not in known]
        log.info(
            "joining experiment %s: new islands %s, relaunching %s",
            cfg.name,
            new,
            sorted(known & {i.name for i in cfg.islands}),
        )
        if estore.stop_requested(None):
            log.warning("experiment %s has a stop marker: its islands stop at once", cfg.name)
    from training.merge.merger import initial_version

    created = initial_version(cfg_all, estore)
    log.info("experiment %s: %s", cfg.name, "created version 0" if created == 0 else "exists")
    if created == 0:
        from training.model.evaluate import evaluate_current

        log.info("initial eval: %s", evaluate_current(cfg_all, estore))
    # only the islands of this trigger run here; islands of earlier runs keep running there
    entries = [island_entry(cfg_all, cfg_all.island(i.name)) for i in cfg.islands]
    register_experiment(cfg.store_url, cfg.name, entries)
    out: dict[str, list] = {b: [] for b in enabled_backends()}
    for e in entries:
        out[e.backend].append(e.to_dict())
    out["shards"] = list(range(cfg_all.syncer.shards))
    return out
