"""LocalBackend: the island as its own OS process."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from diloco_airflow.backends import (
    BackendError,
    IslandSpec,
    ResourceState,
    get_backend,
    resource_id,
)
from diloco_airflow.backends.local import LocalBackend, group_members, process_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")


def _spec(code: str, island: str = "i0", env: dict | None = None) -> IslandSpec:
    return IslandSpec(
        experiment="exp1",
        island=island,
        store_url="file:///tmp/store",
        command=[sys.executable, "-c", code],
        env=env or {},
    )


def _wait(backend, spec, handle, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        st = backend.status(spec, handle)
        if st.state.terminal or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    b = get_backend("local", runs_root=tmp_path / "runs", grace_s=2)
    assert isinstance(b, LocalBackend)
    return b


def test_success_records_exit_code_and_env(backend, tmp_path):
    out = tmp_path / "out.txt"
    spec = _spec(
        f"import os; open({str(out)!r}, 'w').write(os.environ['DILOCO_TEST_VALUE']); print('hi')",
        env={"DILOCO_TEST_VALUE": "42"},
    )
    handle = backend.provision(spec)
    assert Path(handle["run_dir"]) == tmp_path / "runs" / "exp1" / "i0"
    assert backend.status(spec, handle).state == ResourceState.PENDING
    handle = backend.launch(spec, handle)
    json.dumps(handle)  # JSON-serializable
    assert {"pid", "pgid", "log_path", "exit_path", "start_ticks", "started_at"} <= set(handle)
    st = _wait(backend, spec, handle)
    assert st.state == ResourceState.SUCCEEDED, st.message
    assert out.read_text() == "42"
    assert Path(handle["exit_path"]).read_text() == "0"
    assert "hi" in Path(handle["log_path"]).read_text()
    # a different backend object (another Airflow task) sees the same, from the files alone
    other = LocalBackend(runs_root=tmp_path / "runs")
    assert other.status(spec, {}).state == ResourceState.SUCCEEDED


def test_failure_reports_exit_code_and_log_tail(backend):
    spec = _spec("import sys; print('loss went NaN at step 7', file=sys.stderr); sys.exit(3)")
    handle = backend.launch(spec, backend.provision(spec))
    st = _wait(backend, spec, handle)
    assert st.state == ResourceState.FAILED
    assert "exit code 3" in st.message
    assert "loss went NaN at step 7" in st.message


def test_sigkilled_island_is_failed_killed(backend):
    spec = _spec("import os, signal, time; os.kill(os.getpid(), signal.SIGKILL); time.sleep(5)")
    handle = backend.launch(spec, backend.provision(spec))
    st = _wait(backend, spec, handle)
    assert st.state == ResourceState.FAILED
    assert "killed by SIGKILL" in st.message


def test_whole_group_sigkilled_is_failed(backend, tmp_path):
    spec = _spec("import time; time.sleep(30)")
    handle = backend.launch(spec, backend.provision(spec))
    assert backend.status(spec, handle).state == ResourceState.RUNNING
    os.killpg(handle["pgid"], signal.SIGKILL)  # the wrapper dies too: no exit-code file
    st = _wait(backend, spec, handle)
    assert st.state == ResourceState.FAILED
    assert "SIGKILL" in st.message
    # a status reader that did not launch it cannot know the signal, but still says FAILED
    other = LocalBackend(runs_root=tmp_path / "runs")
    assert other.status(spec, {}).state == ResourceState.FAILED


def test_relaunch_kills_previous_copy(backend, tmp_path):
    spec = _spec("import time; time.sleep(30)")
    first = backend.launch(spec, backend.provision(spec))
    assert process_alive(first["pid"], first["start_ticks"])
    # a retried task: new backend object, no handle from the earlier try
    retry = LocalBackend(runs_root=tmp_path / "runs", grace_s=2)
    second = retry.launch(spec, retry.provision(spec))
    try:
        assert second["pid"] != first["pid"]
        assert second["launch"] == first["launch"] + 1
        assert not group_members(first["pgid"])
        assert retry.status(spec, {}).state == ResourceState.RUNNING
        # the old handle does not mistake the new process for its own
        assert retry.status(spec, second).state == ResourceState.RUNNING
    finally:
        backend.teardown(spec, first)  # a stale handle still stops the current copy
        assert not group_members(second["pgid"])
        retry.teardown(spec, second)
    assert not group_members(second["pgid"])


def test_teardown_leaves_no_process(backend):
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('started grandchild', flush=True)\n"
        "time.sleep(60)\n"
    )
    spec = _spec(code)
    handle = backend.launch(spec, backend.provision(spec))
    deadline = time.monotonic() + 10
    while len(group_members(handle["pgid"])) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(group_members(handle["pgid"])) == 3  # wrapper, island, its child
    backend.teardown(spec, handle)
    assert group_members(handle["pgid"]) == []
    st = backend.status(spec, handle)
    assert st.state == ResourceState.FAILED
    assert "SIGTERM" in st.message  # SIGTERM was enough: no SIGKILL after the grace period
    backend.teardown(spec, handle)  # idempotent
    backend.teardown(_spec("pass", island="never-launched"), {})  # always safe


def test_teardown_escalates_to_sigkill(tmp_path):
    backend = LocalBackend(runs_root=tmp_path / "runs", grace_s=0.5)
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    spec = _spec(code)
    handle = backend.launch(spec, backend.provision(spec))
    log = Path(handle["log_path"])
    deadline = time.monotonic() + 10
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    backend.teardown(spec, handle)
    assert group_members(handle["pgid"]) == []


def test_missing_command_is_failed_with_message(backend):
    spec = IslandSpec(
        experiment="exp1",
        island="i9",
        store_url="file:///tmp/store",
        command=["/nonexistent/diloco-binary", "island"],
    )
    handle = backend.launch(spec, backend.provision(spec))
    st = _wait(backend, spec, handle)
    assert st.state == ResourceState.FAILED
    assert "exit code 127" in st.message
    assert "cannot start" in st.message


def test_status_of_unknown_island_is_gone(backend):
    assert backend.status(_spec("pass", island="nope"), {}).state == ResourceState.GONE


def test_spec_validation_and_labels():
    spec = _spec("pass")
    labels = spec.labels
    assert labels["diloco-experiment"] == "exp1"
    assert labels["diloco-island"] == "i0"
    assert int(labels["diloco-ttl"]) == pytest.approx(time.time() + 24 * 3600, abs=60)
    assert IslandSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError):
        IslandSpec(experiment="Bad_Name", island="i", store_url="s", command=["x"])
    with pytest.raises(ValueError):
        IslandSpec(experiment="e", island="../x", store_url="s", command=["x"])
    with pytest.raises(ValueError):
        IslandSpec(experiment="e", island="i", store_url="s", command=[])
    with pytest.raises(ValueError):
        get_backend("nope")
    err = BackendError("quota", retryable=False)
    import pickle

    assert pickle.loads(pickle.dumps(err)).retryable is False


def test_resource_id_rules():
    rid = resource_id("exp1", "i0")
    assert rid == resource_id("exp1", "i0")  # stable
    assert rid.startswith("dl-exp1-i0-")
    assert rid != resource_id("exp1", "i0", "run-2")
    # joining with '-' is ambiguous, the hash is not
    assert resource_id("a-b", "c") != resource_id("a", "b-c")
    long = resource_id("e" * 63, "i" * 63, "Manual__2026-01-01T00:00:00+00:00")
    import re

    for r in (rid, long, resource_id("0exp", "9", max_len=20)):
        assert len(r) <= 63
        assert re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", r), r
    assert len(resource_id("e" * 63, "i" * 63, max_len=40)) <= 40


def test_backends_import_no_jax_and_cloud_clients_lazily():
    import subprocess

    code = (
        "import sys\n"
        "import diloco_airflow.backends as b\n"
        "assert 'google.cloud.tpu_v2' not in sys.modules and 'kubernetes' not in sys.modules\n"
        "b.get_backend('tpu_vm'); b.get_backend('gke')\n"  # builds no client, no credentials
        "import diloco_airflow.backends.gke, diloco_airflow.backends.tpu_vm\n"
        "bad = [m for m in ('jax', 'flax', 'training.model.definition') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'plugins'}"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
