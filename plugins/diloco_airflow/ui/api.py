"""The DiLoCo page: a FastAPI app mounted in Airflow's api-server at /diloco (plugin.py).

    GET  /diloco/                     the page (static HTML + JS; it calls the API below)
    GET  /diloco/api/me               who is asking, and whether they may act
    GET  /diloco/api/experiments      every experiment of the known stores, summarised
    GET  /diloco/api/experiment?store=URL&experiment=NAME     everything the page shows
    POST /diloco/api/stop   {"store", "experiment", "island": null | NAME}   stop markers
    POST /diloco/api/kill   {"store", "experiment", "island"}   chaos mode, local islands only

Every /api route needs a valid Airflow token (401) of a user who may read the
`diloco_experiment` DAG (403); the POST routes need one who may edit it (403): auth.py. Only
stores the source names (sources.py) are opened: any other `store` is a 404. The data logic is
training/views/dashboard.py; this module only routes, checks and maps errors.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, status
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field

from diloco_airflow import knobs
from diloco_airflow.ui.auth import Editor, Reader, can
from diloco_airflow.ui.sources import AirflowSource, StaticSource

log = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("page.html")
STORES_TTL_S = 10.0  # the list of known stores is re-read at most this often


class StopBody(BaseModel):
    store: str = Field(min_length=1, max_length=2000)
    experiment: str = Field(min_length=1, max_length=63)
    island: str | None = Field(None, max_length=63)


class KillBody(StopBody):
    island: str = Field(min_length=1, max_length=63)


def _user_name(user: Any) -> str:
    get = getattr(user, "get_name", None)
    return str(get() if callable(get) else getattr(user, "username", "?"))


def create_app(source: StaticSource | None = None) -> FastAPI:
    """The app; `source` says which stores exist and what Airflow knows (default: Airflow's
    database, see sources.AirflowSource)."""
    from training.views import dashboard

    source = source or AirflowSource()
    cache = dashboard.MetricCache()
    stores_cache: dict[str, Any] = {"at": 0.0, "stores": []}
    app = FastAPI(title="DiLoCo", docs_url=None, redoc_url=None, openapi_url=None)

    def known_stores() -> list[str]:
        if time.monotonic() - stores_cache["at"] > STORES_TTL_S:
            stores_cache.update(at=time.monotonic(), stores=source.stores())
        return stores_cache["stores"]

    def open_known(store: str, experiment: str):
        """(cfg, estore) of a known store's experiment; 404 otherwise, 502 if unreadable."""
        from diloco_airflow.store import open_experiment
        from training.config.experiment import ConfigError
        from training.store.objectstore import ObjectNotFound, StoreError

        if store not in known_stores():
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown store {store!r}")
        try:
            estore = open_experiment(store, experiment)
            return estore.config(), estore
        except (ValueError, ObjectNotFound):
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, f"no experiment {experiment!r} in {store}"
            ) from None
        except (StoreError, ConfigError) as exc:
            raise HTTPException(status.HTTP_502_BAD_GATEWAY, str(exc).splitlines()[0]) from None

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        # no data in it: the page's script calls the API, which checks the user
        return HTMLResponse(PAGE.read_text(), headers={"Cache-Control": "no-cache"})

    @app.get("/api/me")
    def me(user: Reader) -> dict:
        return dict(user=_user_name(user), can_edit=can(user, "PUT"))

    @app.get("/api/experiments")
    def experiments(user: Reader, run_id: str | None = Query(None, max_length=250)) -> dict:
        from diloco_airflow.store import open_experiment
        from training.store.registry import open_store
        from training.views.catalog import list_experiments

        out, errors = [], []
        for store in known_stores():
            try:
                names = list_experiments(open_store(store))
            except Exception as exc:  # one bad store must not hide the others
                errors.append(dict(store=store, error=str(exc).splitlines()[0][:300]))
                continue
            for name in names:
                try:
                    estore = open_experiment(store, name)
                    cfg = estore.config()
                    row = dashboard.experiment_summary(cfg, estore)
                except Exception as exc:
                    row = dict(experiment=name, store=store, error=str(exc).splitlines()[0][:300])
                out.append(row)
        out.sort(key=lambda r: -(r.get("updated_at") or 0))
        run = source.resolve_run(run_id) if run_id else None
        return dict(experiments=out, errors=errors, stores=known_stores(), run=run)

    @app.get("/api/experiment")
    def experiment(
        user: Reader,
        store: str = Query(min_length=1, max_length=2000),
        experiment: str = Query(min_length=1, max_length=63),
    ) -> dict:
        cfg, estore = open_known(store, experiment)
        runs = source.runs(store, experiment)
        latest = runs[0]["run_id"] if runs else None
        tasks = source.tasks(latest, [(i.name, i.backend) for i in cfg.islands])
        # the wait task's heartbeat limit where the deployment sets one: the page calls an
        # island stalled exactly when its wait task stops it (training/protocol/stall.py)
        limit = knobs.HEARTBEAT_TIMEOUT_S.get()
        view = dashboard.experiment_view(
            cfg, estore, cache, tasks=tasks, runs=runs, stall_after_s=limit
        )
        view["can_edit"] = can(user, "PUT")
        return view

    @app.post("/api/stop")
    def stop(body: StopBody, user: Editor) -> dict:
        cfg, estore = open_known(body.store, body.experiment)
        if body.island is not None and body.island not in {i.name for i in cfg.islands}:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no island {body.island!r}")
        estore.request_stop(body.island)
        what = f"island {body.island}" if body.island else "every island"
        log.info("DiLoCo page: %s asked %s of %s to stop", _user_name(user), what, cfg.name)
        return dict(ok=True, stopped=body.island or "experiment", by=_user_name(user))

    @app.post("/api/kill")
    def kill(body: KillBody, user: Editor) -> dict:
        from training.faults.chaos import recorder

        cfg, estore = open_known(body.store, body.experiment)
        if not dashboard.chaos_mode(cfg):
            raise HTTPException(
                status.HTTP_409_CONFLICT, "kill is for chaos mode only (set chaos settings)"
            )
        isl = next((i for i in cfg.islands if i.name == body.island), None)
        if isl is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no island {body.island!r}")
        if isl.backend != "local":
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"kill works on local islands only ({isl.backend})"
            )
        pgid = kill_local_island(cfg.store_url, cfg.name, isl.name)
        if pgid is None:
            raise HTTPException(status.HTTP_409_CONFLICT, f"island {isl.name} is not running")
        recorder(estore)(
            dict(
                event="kill",
                island=isl.name,
                pgid=pgid,
                by=f"page:{_user_name(user)}",
                at=time.time(),
            )
        )
        return dict(ok=True, killed=isl.name, pgid=pgid)

    return app


def kill_local_island(store_url: str, experiment: str, island: str) -> int | None:
    """SIGKILL the process group of a running local island (what the chaos monkey does);
    its wait task then retries and relaunches it. The pgid, or None if it does not run."""
    from diloco_airflow.backends.base import IslandSpec
    from diloco_airflow.backends.local import LocalBackend

    spec = IslandSpec(experiment=experiment, island=island, store_url=store_url, command=["-"])
    return LocalBackend().kill_running(spec)
