"""Where the DiLoCo page learns which stores to read and what Airflow knows about each run.

`StaticSource` serves fixed store URLs (tests, `DILOCO_PAGE_STORES`); `AirflowSource` adds the
stores of the `diloco_experiments` registry Variable and of the `diloco_experiment` DAG runs'
conf (or the form's default), and reads the runs and the islands' wait-task states from
Airflow's database. Only stores named here are ever opened: the API never opens a URL a
client sends.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from diloco_airflow import knobs

log = logging.getLogger(__name__)

DAG_ID = "diloco_experiment"
STORES_ENV = knobs.PAGE_STORES.name  # comma-separated store URLs the page always shows
RUNS_SCANNED = 200  # newest DAG runs looked at


def env_stores() -> list[str]:
    return [s.strip() for s in knobs.PAGE_STORES.get().split(",") if s.strip()]


class StaticSource:
    """Fixed stores, no Airflow runs or tasks."""

    def __init__(self, stores: list[str] | None = None) -> None:
        self._stores = list(stores or [])

    def stores(self) -> list[str]:
        return list(dict.fromkeys(self._stores + env_stores()))

    def runs(self, store_url: str, experiment: str) -> list[dict[str, Any]]:
        return []

    def tasks(self, run_id: str | None, islands: list[tuple[str, str]]) -> dict[str, dict]:
        return {}

    def resolve_run(self, run_id: str) -> dict[str, str] | None:
        """{"store", "experiment", "init_error"} of a `diloco_experiment` run (None: unknown);
        `init_error`: the one-line reason its init failed, else None."""
        return None


def _default_store() -> str | None:
    try:
        from diloco_airflow.params import experiment_params

        return experiment_params()["store_url"].value
    except Exception:  # the form moved or failed: its default is only a convenience
        return None


def _state(value: Any) -> str | None:
    return None if value is None else str(getattr(value, "value", value))


def run_link(run_id: str) -> str:
    """The run's page in the Airflow UI, relative to the Airflow root."""
    from urllib.parse import quote

    return f"dags/{DAG_ID}/runs/{quote(run_id, safe='')}"


class AirflowSource(StaticSource):
    """Stores and runs from Airflow's metadata database (the api-server's session)."""

    def _recent_runs(self) -> list[Any]:
        from airflow.models.dagrun import DagRun
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            query = (
                select(DagRun)
                .where(DagRun.dag_id == DAG_ID)
                .order_by(DagRun.id.desc())
                .limit(RUNS_SCANNED)
            )
            runs = list(session.scalars(query))
            session.expunge_all()
        return runs

    def _run_rows(self) -> list[dict[str, Any]]:
        from diloco_airflow.params import experiment_of

        default = _default_store()
        rows = []
        for r in self._recent_runs():
            conf = r.conf if isinstance(r.conf, Mapping) else {}
            rows.append(
                dict(
                    run_id=r.run_id,
                    state=_state(r.state),
                    start_date=r.start_date.isoformat() if r.start_date else None,
                    end_date=r.end_date.isoformat() if r.end_date else None,
                    experiment=experiment_of(conf, r.run_id),
                    store=conf.get("store_url", default),
                    link=run_link(r.run_id),
                )
            )
        return rows

    def stores(self) -> list[str]:
        out = [*env_stores()]
        try:
            from airflow.models import Variable

            from diloco_airflow.experiment_registry import REGISTRY_VARIABLE

            registry = Variable.get(REGISTRY_VARIABLE, default_var={}, deserialize_json=True)
            if isinstance(registry, Mapping):
                out += [e.get("store_url") for e in registry.values() if isinstance(e, Mapping)]
        except Exception as exc:
            log.warning("DiLoCo page: cannot read the experiment registry: %s", exc)
        try:
            out += [r["store"] for r in self._run_rows()]
        except Exception as exc:
            log.warning("DiLoCo page: cannot read the DAG runs: %s", exc)
        default = _default_store()
        if default:
            out.append(default)
        return [s for s in dict.fromkeys(out) if isinstance(s, str) and s]

    def runs(self, store_url: str, experiment: str) -> list[dict[str, Any]]:
        try:
            rows = self._run_rows()
        except Exception as exc:
            log.warning("DiLoCo page: cannot read the DAG runs: %s", exc)
            return []
        return [r for r in rows if r["experiment"] == experiment and r["store"] == store_url]

    def resolve_run(self, run_id: str) -> dict[str, str] | None:
        try:
            rows = self._run_rows()
        except Exception as exc:
            log.warning("DiLoCo page: cannot read the DAG runs: %s", exc)
            return None
        row = next((r for r in rows if r["run_id"] == run_id), None)
        if row is None:
            return None
        return dict(
            store=row["store"], experiment=row["experiment"], init_error=self.init_error(run_id)
        )

    def init_error(self, run_id: str) -> str | None:
        """The reason run `run_id`'s init failed (its XCom `INIT_ERROR_KEY`), else None."""
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session
        from sqlalchemy import select

        from diloco_airflow.experiment_setup import INIT_ERROR_KEY

        try:
            with create_session() as session:
                query = select(XComModel.value).where(
                    XComModel.dag_id == DAG_ID,
                    XComModel.run_id == run_id,
                    XComModel.task_id == "init",
                    XComModel.key == INIT_ERROR_KEY,
                )
                value = session.scalars(query).first()
        except Exception as exc:
            log.warning("DiLoCo page: cannot read init's reason of %s: %s", run_id, exc)
            return None
        if value is None:
            return None
        value = XComModel.deserialize_value(SimpleNamespace(value=value))
        return str(value)[:500] if value else None

    def tasks(self, run_id: str | None, islands: list[tuple[str, str]]) -> dict[str, dict]:
        """island -> {"state", "try_number"} of its wait task in run `run_id`. `islands`:
        (name, backend) in config order; a mapped task without its rendered label is matched
        by its position among the islands of its backend."""
        if not run_id:
            return {}
        from airflow.models.taskinstance import TaskInstance as TI
        from airflow.utils.session import create_session
        from sqlalchemy import select

        out: dict[str, dict] = {}
        try:
            with create_session() as session:
                query = select(TI).where(
                    TI.dag_id == DAG_ID, TI.run_id == run_id, TI.task_id.like("islands_%.wait")
                )
                tis = list(session.scalars(query))
                for ti in tis:
                    backend = ti.task_id[len("islands_") : -len(".wait")]
                    names = [n for n, b in islands if b == backend]
                    label = (ti.rendered_map_index or "").split(" (")[0]  # "name (backend)"
                    if label not in names:
                        label = names[ti.map_index] if 0 <= ti.map_index < len(names) else None
                    if label:
                        out[label] = dict(state=_state(ti.state), try_number=ti.try_number)
        except Exception as exc:
            log.warning("DiLoCo page: cannot read task instances of %s: %s", run_id, exc)
        return out
