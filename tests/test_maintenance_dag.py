"""diloco_maintenance runs for real (`dag.test()` in a fresh Airflow home, a subprocess).

One run must: stop an island whose heartbeat is stale while its process still runs (its wait
task's retry then relaunches it), leave an island with a fresh heartbeat alone, delete the TPU
queued resource past its `diloco-ttl` label (fake TPU API, the real client library) but not a
fresh one, and garbage-collect the store by the retention policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from diloco_airflow.backends import IslandSpec, get_backend
from diloco_airflow.backends.base import ResourceState
from diloco_airflow.island_entry import IslandEntry
from google.auth.credentials import AnonymousCredentials

from tests.fake_tpu_api import FakeTpuApi
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
PROJECT, ZONE = "proj", "us-east5-a"

SCRIPT = """
import json, os, sys
from airflow.dag_processing.dagbag import DagBag
from airflow.models import Variable

Variable.set("diloco_experiments", json.loads(os.environ["REGISTRY"]), serialize_json=True)
bag = DagBag(dag_folder=sys.argv[1])
assert not bag.import_errors, bag.import_errors
run = bag.dags["diloco_maintenance"].test()
states = {ti.task_id: str(ti.state) for ti in run.get_task_instances()}
print("RESULT " + json.dumps({"state": str(run.state), "tasks": states}))
"""


def _island(name: str, backend: str, spec: IslandSpec, **kwargs) -> dict:
    """A registry entry of one island (`IslandEntry.to_dict`, as `init` registers it)."""
    return IslandEntry(
        name=name,
        experiment=spec.experiment,
        store_url=spec.store_url,
        backend=backend,
        backend_kwargs=kwargs,
        heartbeat_s=2.0,
        spec=spec,
    ).to_dict()


def test_maintenance_dag_relaunch_ttl_and_gc(tmp_path):
    url = f"file://{tmp_path}/store"
    runs = tmp_path / "runs"
    estore = ExperimentStore(open_store(url), "maint")
    estore.write_config({"name": "maint"})
    head = estore.publish_fragment(0, 0, {"w": np.zeros(4, np.float32)}, {}, expected=None)
    for v in range(1, 9):
        ref = estore.publish_pseudograd(
            "fine", v - 1, 0, {"d": np.ones(2, np.float32)}, {"base_version": [v - 1]}
        )
        head = estore.publish_fragment(
            0, v, {"w": np.full(4, v, np.float32)}, {}, applied=[ref.id], expected=head
        )

    # a stalled island (process alive, heartbeat 1000 s old) and a healthy one
    local = get_backend("local", runs_root=str(runs), grace_s=2)
    specs = {
        name: IslandSpec(
            experiment="maint",
            island=name,
            store_url=url,
            command=[sys.executable, "-c", "import time; time.sleep(600)"],
        )
        for name in ("stuck", "fine")
    }
    for spec in specs.values():
        local.launch(spec, local.provision(spec))
    now = time.time()
    estore.write_heartbeat("stuck", {"time": now - 1000, "base_version": [8]})
    estore.write_heartbeat("fine", {"time": now, "base_version": [8]})

    with FakeTpuApi() as fake:
        tpu = get_backend(
            "tpu_vm",
            api_endpoint=fake.url,
            transport="rest",
            credentials=AnonymousCredentials(),
            poll_s=0.01,
        )
        hardware = {"project": PROJECT, "zone": ZONE, "accelerator_type": "v5p-8"}
        hardware["runtime_version"] = "v2-alpha-tpuv5"
        old = IslandSpec(
            experiment="maint",
            island="tpu-old",
            store_url=url,
            command=["diloco", "island"],
            hardware=hardware,
            ttl_hours=1,
            created_at=now - 7200,
        )
        fresh = IslandSpec(
            experiment="maint",
            island="tpu-new",
            store_url=url,
            command=["diloco", "island"],
            hardware=hardware,
        )
        tpu.provision(old)
        tpu.provision(fresh)
        assert fake.exists(old.resource_id) and fake.exists(fresh.resource_id)

        registry = {
            f"{url}|maint": {
                "store_url": url,
                "experiment": "maint",
                "islands": {
                    "stuck": _island("stuck", "local", specs["stuck"], runs_root=str(runs)),
                    "fine": _island("fine", "local", specs["fine"], runs_root=str(runs)),
                    "tpu-old": _island("tpu-old", "tpu_vm", old),
                    "tpu-new": _island("tpu-new", "tpu_vm", fresh),
                },
            }
        }
        home = tmp_path / "airflow_home"
        env = {
            **os.environ,
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
            "DILOCO_TPU_API_ENDPOINT": fake.url,
            "DILOCO_GC_KEEP_LAST": "3",
            "REGISTRY": json.dumps(registry),
        }
        airflow = Path(sys.executable).with_name("airflow")
        migrate = subprocess.run(
            [str(airflow), "db", "migrate"], env=env, capture_output=True, text=True, timeout=120
        )
        assert migrate.returncode == 0, migrate.stderr[-3000:]
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(ROOT / "dags" / "diloco_maintenance.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        assert out.returncode == 0 and lines, (out.stdout[-3000:], out.stderr[-3000:])
        result = json.loads(lines[-1][len("RESULT ") :])
        assert result["state"] == "success", result
        assert set(result["tasks"].values()) == {"success"}, result

        # TTL: the expired queued resource is gone, the fresh one stays
        assert not fake.exists(old.resource_id)
        assert fake.exists(fresh.resource_id)
        tpu.teardown(fresh, {})

    try:
        # relaunch decision: the stalled island's process was stopped, the healthy one runs on
        assert local.status(specs["stuck"], {}).state == ResourceState.FAILED
        assert local.status(specs["fine"], {}).state == ResourceState.RUNNING
    finally:
        for spec in specs.values():
            local.teardown(spec, {})

    # garbage collection: versions 1..5 of fragment 0 lost their payloads (HEAD 8, keep 3, 0 kept)
    plan = estore.plan_gc(keep_last=3)
    assert plan.empty, plan
    kept = [k for k in estore.store.list("maint/fragments/") if k.endswith("params.safetensors")]
    assert len(kept) == 4  # versions 0, 6, 7, 8
    assert [m["version"] for m in estore.list_fragment_versions(0)] == list(range(9))
    assert {r.id for r in estore.list_pseudograds()} == {f"fine/{s:08d}-f000" for s in (5, 6, 7)}
