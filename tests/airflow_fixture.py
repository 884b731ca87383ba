"""A real local Airflow for end-to-end tests (all four components), stopped afterwards."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path

from devtools.local_airflow import LocalAirflow, groups_still_alive, stop_islands


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def island_env(runs: Path, gcs: bool = True) -> dict[str, str]:
    """The environment of a test Airflow's islands: local runs under `runs`, quick retries, one
    compute thread each (they share the cores with Airflow), fake-gcs-server when `gcs`."""
    env = {
        "DILOCO_RUNS_ROOT": str(runs),
        "DILOCO_RETRY_DELAY_S": "2",
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        "OMP_NUM_THREADS": "1",
        "JAX_PLATFORMS": "cpu",
    }
    if gcs:
        env["STORAGE_EMULATOR_HOST"] = os.environ["STORAGE_EMULATOR_HOST"]
        env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    return env


@contextmanager
def running_airflow(tmp_path: Path, **extra_env: str):
    """Airflow on a free port with islands on fake-gcs-server (STORAGE_EMULATOR_HOST must be set);
    asserts on exit that no process group it started outlived it."""

    runs = tmp_path / "islands"
    env = {**island_env(runs), **extra_env}
    af = LocalAirflow(home=tmp_path / "airflow_home", port=free_port(), env=env)
    af.runs = runs
    try:
        af.start()
        yield af
    finally:
        pgids = [p.pid for p in af.procs.values()]
        af.stop()
        island_groups = stop_islands(runs)
        alive = groups_still_alive(pgids + island_groups)
        assert not alive, f"process groups {alive} outlived the test"
