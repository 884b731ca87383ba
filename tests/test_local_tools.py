"""`make airflow` and `make demo` are safe to run twice (issue 12, item 5): one instance per
Airflow home (a lock with the owner's pid), a second refuses with one line and touches nothing,
and SIGTERM stops every component as SIGINT does.

The last test starts a real Airflow (`python -m devtools.local_airflow serve`): slow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.local_airflow import (
    AirflowError,
    HomeLock,
    LocalAirflow,
    group_alive,
    groups_still_alive,
    port_in_use,
)
from tests.airflow_fixture import free_port

ROOT = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_group_whose_leader_is_an_unreaped_zombie_is_not_alive():
    # the CI failure of stop 20: an island group SIGKILLed at teardown, orphaned, and not yet
    # reaped by PID 1, counted as "outlived the test"; here we are the parent that has not reaped
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the killed process never became a zombie"
        time.sleep(0.01)
    try:
        assert not group_alive(proc.pid)
    finally:
        proc.wait()


def test_a_running_group_is_still_alive_after_the_wait():
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert groups_still_alive([proc.pid], timeout_s=0.2) == [proc.pid]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert groups_still_alive([proc.pid], timeout_s=0.2) == []


def test_a_second_lock_on_a_live_owners_home_is_refused_with_one_line(tmp_path):
    first = HomeLock(tmp_path, 8080)
    first.acquire()
    with pytest.raises(AirflowError) as err:
        HomeLock(tmp_path, 9090, pid=os.getpid() + 1).acquire()
    assert "in use" in str(err.value) and "\n" not in str(err.value)
    assert json.loads(first.path.read_text())["pid"] == os.getpid()


def test_a_dead_owners_lock_is_taken_over(tmp_path):
    HomeLock(tmp_path, 8080, pid=_dead_pid()).acquire()
    lock = HomeLock(tmp_path, 8081)
    lock.acquire()
    assert lock.held and lock.owner()["pid"] == os.getpid()


def test_release_leaves_another_owners_lock_alone(tmp_path):
    ours = HomeLock(tmp_path, 8080)
    ours.acquire()
    ours.path.write_text(json.dumps({"pid": 1, "port": 1}))  # someone else's now
    ours.release()
    assert ours.path.exists()


def test_a_refused_start_touches_none_of_the_other_instances_files(tmp_path):
    home = tmp_path / "home"
    HomeLock(home, 8080).acquire()  # "another instance": this live process
    (home / "pids.json").write_text('{"scheduler": 1}')
    af = LocalAirflow(home=home, port=free_port())
    af.lock.pid = os.getpid() + 1  # a different owner than the live holder
    with pytest.raises(AirflowError, match="in use"):
        af.start()
    af.stop()
    assert sorted(p.name for p in home.iterdir()) == ["local-airflow.lock", "pids.json"]
    assert (home / "pids.json").read_text() == '{"scheduler": 1}'


def test_a_start_without_the_installed_package_is_refused_with_one_line(tmp_path, monkeypatch):
    """Airflow finds the page only through the package's entry point: without it `start` says
    so before it touches anything."""
    import devtools.local_airflow as la

    monkeypatch.setattr(la, "installed_entry_point", lambda: None)
    af = LocalAirflow(home=tmp_path / "home", port=free_port())
    with pytest.raises(AirflowError, match="not installed") as err:
        af.start()
    assert "\n" not in str(err.value)
    assert not (tmp_path / "home").exists()


def test_a_port_left_in_time_wait_by_a_stopped_server_is_free(tmp_path):
    """Ctrl-C, then `make airflow` again: the old server's accepted connections sit in TIME-WAIT
    on its port for a minute; the check binds as the server does (SO_REUSEADDR) and passes."""
    import socket

    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server closes first: its end (on `port`) goes to TIME-WAIT
    client.recv(1)
    client.close()
    server.close()
    plain = socket.socket()
    with pytest.raises(OSError):  # the state the old check refused: a bind without the option
        plain.bind(("127.0.0.1", port))
    plain.close()
    assert port_in_use(port) is False


def test_a_listening_port_is_in_use():
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert port_in_use(server.getsockname()[1]) is True


def _serve(home: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"}
    return subprocess.Popen(
        [sys.executable, "-m", "devtools.local_airflow", "serve", "--port", str(port)]
        + ["--home", str(home)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_refuses_a_second_instance_and_stops_everything_on_sigterm(tmp_path):
    home, port = tmp_path / "home", free_port()
    first = _serve(home, port)
    try:
        deadline = time.monotonic() + 180
        while not (home / "pids.json").exists():  # the four components are started
            assert first.poll() is None, first.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "components never started"
            time.sleep(0.5)
        pids = json.loads((home / "pids.json").read_text())
        assert len(pids) == 4

        second = _serve(home, free_port())
        out, err = second.communicate(timeout=120)
        assert second.returncode == 1
        assert err.strip().count("\n") == 0 and "in use" in err, err
        assert json.loads((home / "pids.json").read_text()) == pids, "pids.json was touched"

        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
        alive = {name: pgid for name, pgid in pids.items() if group_alive(pgid)}
        assert alive == {}, f"process groups left after SIGTERM: {alive}"
        assert not (home / HomeLock.NAME).exists() and not (home / "pids.json").exists()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        leftover = home / "pids.json"
        for pgid in json.loads(leftover.read_text()).values() if leftover.exists() else []:
            if group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
