"""Asset events of DiLoCo experiments: "a better model exists" and "a run finished".

Airflow declares assets when it parses DAG files; experiments are made at run time, under any
store URL a run's form names. So the asset is the **store**: `models_asset(url)` is one asset per
store URL (name ``diloco-models:<url>``, URI the store's URL), and each event's extra names the
experiment, its URL and the snapshot. Two producers, each where Airflow offers one:

- **"best"**: a new `snapshots/BEST.json` is recorded inside the long-running evaluator task (an
  outlet would only fire when the task ends), so an `AssetWatcher` reports it:
  `ModelEventTrigger` runs in the triggerer while a DAG scheduled on the asset is unpaused, polls
  the store's experiments (`observe`) and yields one event per new BEST (`new_events`, a pure
  function). Its cursor (the BEST each experiment had at the last event) is kept in Airflow's
  asset state store, so a restarted triggerer reports only what changed meanwhile; a first start
  reports nothing for what already exists. Events are at least once: the cursor is written after
  the event, so a crash in between repeats one event (the example export is idempotent).
- **"finished"**: `finalize` of `diloco_experiment` emits it when it ended the experiment, as a
  task outlet through the asset alias `MODELS_ALIAS` (`finished_event`): the alias resolves to
  the run's store asset, so a DAG scheduled on that store's asset gets both kinds.

The extra of an event: ``{"event": "best" | "finished", "store_url", "experiment",
"experiment_url", "loss", "versions", "tokens_merged", "snapshot"}``, and for "finished"
``"over"`` (every island of the experiment is done: no later run continues it) (from the watcher, Airflow
nests it as ``{"from_trigger": true, "payload": {...}}``; `payloads_of` reads both).
The example consumer is `diloco_airflow.dags.export_best`. Nothing here imports jax.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from airflow.sdk import Asset, AssetAlias, AssetWatcher
from airflow.triggers.base import BaseEventTrigger, TriggerEvent

log = logging.getLogger(__name__)

MODELS_ALIAS = AssetAlias("diloco-models")  # finalize's outlet: resolves to the run's store asset
CURSOR_KEY = "diloco_best_cursor"  # the watcher's key in the asset state store
EVENTS = ("best", "finished")


def store_uri(store_url: str) -> str:
    """The asset URI of a store: its URL with a plain path made ``file://`` and no trailing /."""
    url = str(store_url).rstrip("/")
    if "://" not in url:
        url = "file://" + os.path.abspath(url)
    return url


def models_asset(store_url: str, poll_s: float | None = None) -> Asset:
    """The store's asset; with `poll_s`, watched by a `ModelEventTrigger` polling that often
    (what a DAG scheduled on new models declares; finalize's events need no watcher)."""
    uri = store_uri(store_url)
    watchers = []
    if poll_s is not None:
        trigger = ModelEventTrigger(store_url=uri, poll_s=poll_s)
        watchers = [AssetWatcher(name="diloco_models_watcher", trigger=trigger)]
    return Asset(name=f"diloco-models:{uri}", uri=uri, watchers=watchers)


def snapshot_id(record: Mapping[str, Any]) -> str:
    """A short stable id of the snapshot an eval record names (its fragment directories, which
    are immutable names), for cursors and export folder names."""
    dirs = record.get("dirs") or record.get("versions") or []
    return hashlib.sha256(json.dumps(list(dirs)).encode()).hexdigest()[:16]


def payload(event: str, store_url: str, experiment: str, record: Mapping[str, Any]) -> dict:
    """An event's extra (JSON only, bounded: no fragment directory list)."""
    loss = record.get("loss")
    return {
        "event": event,
        "store_url": store_uri(store_url),
        "experiment": experiment,
        "experiment_url": f"{store_uri(store_url)}/{experiment}",
        "loss": float(loss) if isinstance(loss, int | float) else None,
        "versions": [int(v) for v in record.get("versions") or []],
        "tokens_merged": record.get("tokens_merged"),
        "snapshot": snapshot_id(record),
        **({"over": bool(record["over"])} if "over" in record else {}),
    }


def new_events(
    store_url: str, cursor: Mapping[str, str], bests: Mapping[str, Mapping[str, Any]]
) -> tuple[list[dict], dict[str, str]]:
    """The "best" events of one poll and the cursor after them (pure).

    `cursor`: experiment -> snapshot id of the BEST last reported; `bests`: experiment -> its
    BEST record now. An experiment whose BEST id differs from the cursor's gets one event; an
    experiment that vanished (deleted) leaves the cursor."""
    events, after = [], {k: v for k, v in cursor.items() if k in bests}
    for name in sorted(bests):
        sid = snapshot_id(bests[name])
        if cursor.get(name) != sid:
            events.append(payload("best", store_url, name, bests[name]))
        after[name] = sid
    return events, after


def observe(store_url: str) -> dict[str, dict]:
    """experiment -> its snapshots/BEST.json, for every experiment of the store that has one
    (blocking: the trigger runs it in a thread). A BEST that does not parse is skipped with
    one log line: the bucket is untrusted, and one bad object must not silence the others."""
    from diloco_airflow.store import open_root
    from training.store.experiment import ExperimentStore
    from training.views.catalog import list_experiments

    store = open_root(store_url)
    out = {}
    for name in list_experiments(store):
        try:
            best = ExperimentStore(store, name).best()
        except Exception as exc:  # noqa: BLE001 - any unreadable object: skip, say which
            log.warning("%s/%s: snapshots/BEST.json skipped: %s", store_url, name, exc)
            continue
        if best is not None:
            out[name] = dict(best)
    return out


class ModelEventTrigger(BaseEventTrigger):
    """Watches a store for new best snapshots (see the module docstring). Yields one
    `TriggerEvent(payload)` per new BEST, for as long as the triggerer runs it. A failed poll
    (the store blinked) is logged on one line and retried at the next poll."""

    def __init__(self, store_url: str, poll_s: float = 30.0) -> None:
        super().__init__()
        self.store_url = store_url
        self.poll_s = float(poll_s)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "diloco_airflow.assets.ModelEventTrigger",
            {"store_url": self.store_url, "poll_s": self.poll_s},
        )

    async def _load_cursor(self) -> dict[str, str] | None:
        state = getattr(self, "asset_state_store", None)
        if state is None:
            return None
        try:
            got = await state.aget(CURSOR_KEY)
        except Exception as exc:  # noqa: BLE001 - no state store: start from what exists now
            self.log.warning("no asset state store (%s): reporting changes from now on", exc)
            return None
        return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else None

    async def _save_cursor(self, cursor: dict[str, str]) -> None:
        state = getattr(self, "asset_state_store", None)
        if state is None:
            return
        try:
            await state.aset(CURSOR_KEY, cursor)
        except Exception as exc:  # noqa: BLE001 - the next restart repeats these events
            self.log.warning("cursor not saved (%s): a restart may repeat events", exc)

    async def run(self):
        cursor = await self._load_cursor()
        while True:
            try:
                bests = await asyncio.to_thread(observe, self.store_url)
            except Exception as exc:  # noqa: BLE001 - the store blinked: poll again
                self.log.warning("%s: poll failed: %s", self.store_url, exc)
                await asyncio.sleep(self.poll_s)
                continue
            if cursor is None:  # first start: what exists now is not news
                _, cursor = new_events(self.store_url, {}, bests)
                await self._save_cursor(cursor)
            events, after = new_events(self.store_url, cursor, bests)
            for event in events:
                self.log.info("new best: %s", json.dumps(event, sort_keys=True))
                yield TriggerEvent(event)
            if after != cursor:
                cursor = after
                await self._save_cursor(cursor)
            await asyncio.sleep(self.poll_s)


def finished_event(outlet_events, store_url: str, experiment: str, record: Mapping) -> dict:
    """Emit "finished" for `experiment` through finalize's outlet alias; returns the extra.
    `record`: the eval record of the model the run ends with."""
    extra = payload("finished", store_url, experiment, record)
    outlet_events[MODELS_ALIAS].add(
        Asset(name=f"diloco-models:{store_uri(store_url)}", uri=store_uri(store_url)), extra=extra
    )
    return extra


def payloads_of(triggering_asset_events: Mapping[Any, Iterable[Any]] | None) -> list[dict]:
    """The DiLoCo payloads of a run's triggering asset events, newest per (experiment, event)
    last wins; events of other assets and extras that are not ours are left out."""
    found: dict[tuple[str, str], dict] = {}
    for events in (triggering_asset_events or {}).values():
        for ev in events:
            extra = getattr(ev, "extra", None) or {}
            data = extra.get("payload", extra) if extra.get("from_trigger") else extra
            if isinstance(data, dict) and data.get("event") in EVENTS and data.get("experiment"):
                found[(data["experiment"], data["event"])] = data
    return [found[k] for k in sorted(found)]
