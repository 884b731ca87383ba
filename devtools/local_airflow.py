"""A real Airflow on this machine: start, wait until healthy, REST API v2 helpers, stop.

    python -m devtools.local_airflow serve [--port N] [--home DIR]   # the UI on localhost:8080

The port is `DILOCO_AIRFLOW_PORT` (default 8080) unless given. Safe to run twice: `start()` first
takes the home's lock (`HomeLock`: ``$AIRFLOW_HOME/local-airflow.lock`` with the owner's pid; a
lock whose owner is dead is taken over), then refuses a port in use, each with one line
(`AirflowError`), before it writes anything in the home; `stop()` touches the home's files
(pids.json, the lock) only when this instance holds the lock. `serve` and `make demo` stop
everything they started on SIGINT and SIGTERM alike (`stop_on_signals`).

Runs scheduler, triggerer, dag-processor and api-server (LocalExecutor on SQLite) in a
project-local AIRFLOW_HOME with the project's dags/ (the package installed, as a user's). Every component leads its own
process group (setsid), so `stop()` ends it and everything it forked (LocalExecutor workers, task
processes); island processes of the local backend lead their own groups and are stopped by
`stop_islands()`.

Past 500 lines: one harness (the home and its lock, the four components, health, the REST
helpers the tests and `make demo` use), kept in one file so that a test reads one module.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "plugins"):  # `python -m devtools.local_airflow` from the checkout
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from diloco_airflow import knobs  # noqa: E402
from diloco_airflow.backends.local import group_members  # noqa: E402
from diloco_airflow.backends.registry import BACKENDS  # noqa: E402
from diloco_airflow.pools import CONTROL_POOL, pool_for  # noqa: E402
from diloco_airflow.ui import installed_entry_point  # noqa: E402

COMPONENTS = ("scheduler", "triggerer", "dag-processor", "api-server")
USER, PASSWORD = "admin", "admin"
# control: init, the syncer's shards and evaluator (deferred ones count), finalize, per run
POOLS = {CONTROL_POOL: 16, **{pool_for(b): 4 if b == "local" else 16 for b in BACKENDS}}


def default_port() -> int:
    return knobs.AIRFLOW_PORT.get()


def port_in_use(port: int) -> bool:
    """True when a live socket holds `port` on loopback. SO_REUSEADDR as the api-server binds:
    the TIME-WAIT sockets that a stopped server leaves for a minute do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class AirflowError(RuntimeError):
    pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HomeLock:
    """One local Airflow per AIRFLOW_HOME: ``local-airflow.lock`` holds the owner's pid and port.

    `acquire` creates it exclusively; a lock whose pid is dead is stale and is replaced (once);
    a live owner's lock raises AirflowError (one line). `release` removes it only if it is ours.
    """

    NAME = "local-airflow.lock"

    def __init__(self, home: Path, port: int, pid: int | None = None):
        self.path = Path(home) / self.NAME
        self.port = port
        self.pid = os.getpid() if pid is None else pid
        self.held = False

    def owner(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None
        except (OSError, ValueError):
            return None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = json.dumps({"pid": self.pid, "port": self.port, "started_at": time.time()})
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self.owner()
                if owner is not None and pid_alive(owner["pid"]):
                    raise AirflowError(
                        f"{self.path.parent} is in use by another local Airflow (pid "
                        f"{owner['pid']}, port {owner.get('port')}): stop it first"
                    ) from None
                with contextlib.suppress(FileNotFoundError):  # stale: its owner is gone
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as out:
                out.write(record)
            self.held = True
            return
        raise AirflowError(f"could not take {self.path}: another instance is starting")

    def release(self) -> None:
        if self.held and (self.owner() or {}).get("pid") == self.pid:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.held = False


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: stop what was started."""


SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signals():
    """Within: SIGINT and SIGTERM raise `Interrupted` in the main thread (even where SIGINT was
    inherited as ignored, as in a background job of a non-interactive shell), and the first
    one ignores any further ones, so the cleanup it starts runs to the end. After: the
    default handlers. Cleanup code not started by a signal calls `hold_signals` first."""

    def interrupt(signum, frame):
        hold_signals()
        raise Interrupted(signal.Signals(signum).name)

    for s in SIGNALS:
        signal.signal(s, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def hold_signals() -> None:
    """Ignore SIGINT and SIGTERM (while stopping what was started)."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)


class LocalAirflow:
    def __init__(
        self,
        home: str | Path | None = None,
        port: int | None = None,
        parallelism: int = 8,
        env: dict[str, str] | None = None,
        root: Path = ROOT,
    ) -> None:
        self.root = Path(root)
        self.home = Path(home or self.root / "airflow_home").resolve()
        self.port = port = port or default_port()
        # running tasks at once: the syncer's shards and evaluator run while merges happen,
        # beside the chaos monkey and the islands' short provision / launch / retry tasks
        self.parallelism = parallelism
        self.extra_env = dict(env or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self.lock = HomeLock(self.home, port)
        self._token: str | None = None
        self.base = f"http://127.0.0.1:{port}"

    # ------------------------------------------------------------------ processes
    def env(self) -> dict[str, str]:
        self.home.mkdir(parents=True, exist_ok=True)
        secret_file = self.home / "jwt_secret"
        if not secret_file.exists():
            secret_file.write_text(secrets.token_urlsafe(32))
        plugins = str(self.root / "plugins")
        pythonpath = [str(self.root), plugins, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.root / "dags"),
            # the package is installed (editable): Airflow loads the page through its entry
            # point. The checkout also goes first on PYTHONPATH so that a worktree's code runs
            # in every component; Airflow's plugins folder stays empty, as in a user's install
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(self.home / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            # local islands only: no tpu_vm / gke task groups in the graph (unless set)
            knobs.BACKENDS.name: knobs.BACKENDS.get() or "local",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base}/execution/",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": secret_file.read_text().strip(),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "60",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "True",
            "AIRFLOW__TRIGGERER__DEFAULT_CAPACITY": "100",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "PYTHONPATH": os.pathsep.join(p for p in dict.fromkeys(pythonpath) if p),
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "PYTHONUNBUFFERED": "1",
        }
        env.update(self.extra_env)
        return env

    def migrate_db(self, env: dict[str, str]) -> Path:
        """`airflow db migrate` (its output in logs/db-migrate.log); returns the logs folder.
        A home used before (its DB exists) also gets `airflow dags reserialize`: its serialized
        DAGs are an earlier checkout's, and until the DAG processor re-parses the files the API
        would check a trigger against the old form (a field changed type: HTTP 400)."""
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        used = (self.home / "airflow.db").exists()
        steps = [["db", "migrate"]] + ([["dags", "reserialize"]] if used else [])
        with open(logs / "db-migrate.log", "ab") as out:
            for step in steps:
                rc = subprocess.call([*self.airflow_bin(), *step], env=env, stdout=out, stderr=out)
                if rc:
                    raise AirflowError(
                        f"airflow {' '.join(step)} failed ({rc}); see {logs / 'db-migrate.log'}"
                    )
        return logs

    def airflow_bin(self) -> list[str]:
        exe = Path(sys.executable).with_name("airflow")
        return [str(exe)] if exe.exists() else [sys.executable, "-m", "airflow"]

    def start(self) -> None:
        """Take the home's lock, check the port, migrate the DB, start the components.

        Refuses (AirflowError, one line, nothing in the home touched) when another live
        instance holds the home or the port is in use, and when the package is not installed
        (Airflow finds the DiLoCo page only through its entry point)."""
        if installed_entry_point() is None:
            raise AirflowError(
                "the decoupled-diloco package is not installed in this Python (no 'airflow.plugins'"
                " entry point): run `make venv` or `pip install -e .`"
            )
        self.lock.acquire()
        if port_in_use(self.port):
            self.lock.release()
            raise AirflowError(
                f"port {self.port} is in use (another Airflow?): set DILOCO_AIRFLOW_PORT"
            )
        env = self.env()
        self.migrate_db(env)
        for name in COMPONENTS:
            self.start_component(name, env)
        (self.home / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.procs.items()}))

    def component_args(self, name: str, env: dict[str, str]) -> list[str]:
        """The command line of component `name` (it may add to `env`, that process's own)."""
        args = [*self.airflow_bin(), name]
        if name == "api-server":
            args += ["--port", str(self.port), "--host", "127.0.0.1"]
        return args

    def start_component(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start component `name` in its own process group, logging to ``logs/<name>.log``;
        replaces its entry in `procs`."""
        env = dict(env if env is not None else self.env())
        args = self.component_args(name, env)
        out = open(self.home / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the process's
        self.procs[name] = proc = subprocess.Popen(
            args,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.root,
            start_new_session=True,
        )
        out.close()
        return proc

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGINT then SIGTERM each component's process group; SIGKILL what is left; then
        pids.json and the lock go, if this instance holds the home (else nothing is touched)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            for p in self.procs.values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)
            deadline = time.monotonic() + grace_s / 2
            while time.monotonic() < deadline and any(
                group_alive(p.pid) for p in self.procs.values()
            ):
                for p in self.procs.values():
                    p.poll()
                time.sleep(0.2)
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        self.procs.clear()
        if self.lock.held:
            with contextlib.suppress(FileNotFoundError):
                (self.home / "pids.json").unlink()
            self.lock.release()

    def describe(self) -> list[str]:
        """Lines `serve` prints about this setup beyond the UI's address (none here)."""
        return []

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise AirflowError(
                    f"airflow {name} exited with {p.returncode}; see {self.home / 'logs' / name}.log"
                )

    # ------------------------------------------------------------------ REST API v2
    def request(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if auth:
            req.add_header("Authorization", f"Bearer {self.token()}")
        # SQLite is locked now and then while all components start ("Database error", 500):
        # such a request was rolled back and is retried, except a trigger (never twice)
        attempts = 1 if path.endswith("/dagRuns") and method == "POST" else 5
        for attempt in range(attempts):
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    text = resp.read().decode()
                return json.loads(text) if text else None
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:500]
                if err.code in (500, 503) and attempt + 1 < attempts:
                    time.sleep(0.5 * 2**attempt)
                    continue
                raise AirflowError(f"{method} {path}: HTTP {err.code}: {detail}") from None
        raise AssertionError("unreachable")

    def token(self) -> str:
        if self._token is None:
            resp = self.request(
                "POST", "/auth/token", {"username": USER, "password": self.password()}, auth=False
            )
            self._token = resp["access_token"]
        return self._token

    def password(self) -> str:
        path = self.home / "simple_auth_manager_passwords.json.generated"
        try:
            return json.loads(path.read_text())[USER]
        except (FileNotFoundError, ValueError, KeyError):
            return PASSWORD

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                h = self.request("GET", "/api/v2/monitor/health", auth=False)
                states = {k: (v or {}).get("status") for k, v in h.items()}
                last = str(states)
                if all(states.get(k) == "healthy" for k in ("metadatabase", "scheduler")) and (
                    states.get("triggerer") == "healthy"
                ):
                    return
            except (AirflowError, OSError) as err:
                last = str(err)
            time.sleep(1)
        raise AirflowError(f"airflow not healthy after {timeout_s:.0f}s: {last}")

    def wait_dag(self, dag_id: str, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.request("GET", f"/api/v2/dags/{dag_id}")
            except AirflowError:
                if time.monotonic() > deadline:
                    errors = self.request("GET", "/api/v2/importErrors")
                    raise AirflowError(
                        f"DAG {dag_id} not parsed; import errors: {errors}"
                    ) from None
                self.check_alive()
                time.sleep(1)

    def ensure_pools(self, pools: dict[str, int] = POOLS) -> None:
        for name, slots in pools.items():
            body = {"name": name, "slots": slots, "include_deferred": True}
            try:
                self.request("POST", "/api/v2/pools", body)
            except AirflowError as err:
                if "409" not in str(err):
                    raise
                self.request("PATCH", f"/api/v2/pools/{name}", body)

    def unpause(self, dag_id: str) -> None:
        self.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        self.unpause(dag_id)
        body: dict[str, Any] = {"logical_date": None, "conf": conf}
        if conf.get("experiment_name"):  # runs are told apart by their experiment, not a time
            body["note"] = f"experiment {conf['experiment_name']} in {conf.get('store_url', '?')}"
        run = self.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", body)
        return run["dag_run_id"]

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{_q(run_id)}")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{_q(run_id)}/taskInstances?limit=1000"
        return self.request("GET", path)["task_instances"]

    def wait_run(self, dag_id: str, run_id: str, timeout_s: float, every=None) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            state = self.dag_run(dag_id, run_id)["state"]
            if every:
                every(state)
            if state in ("success", "failed"):
                return state
            time.sleep(3)
        raise AirflowError(f"{dag_id} run {run_id} did not finish in {timeout_s:.0f}s")


def _q(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still runs. A zombie does not count: it has exited
    and only waits for its parent (or, orphaned, for PID 1, which in a container may take a
    second or more) to reap it."""
    return bool(group_members(pgid))


def groups_still_alive(pgids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The groups of ``pgids`` still alive after up to ``timeout_s`` (a SIGKILLed process takes a
    moment to exit under load): [] as soon as every one has gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [g for g in pgids if group_alive(g)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def stop_islands(runs_root: str | Path) -> list[int]:
    """Kill the process groups of local islands still running under ``runs_root``."""
    killed = []
    for record in Path(runs_root).glob("*/*/process.json"):
        with contextlib.suppress(ValueError, OSError, KeyError):
            pgid = int(json.loads(record.read_text())["pgid"])
            if group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
    return killed


def serve(port: int | None = None, home: str | None = None, cls=None, **kw) -> int:
    """`make airflow`: start, print where to go, run until SIGINT / SIGTERM, stop it all.
    Refuses to start (one line on stderr, exit 1) when the home or the port is in use. `cls`
    (default `LocalAirflow`) and `kw`: another setup (`devtools.celery_airflow`)."""
    cls = cls or LocalAirflow
    af = cls(home=home, port=port, env={knobs.RUNS_ROOT.name: str(ROOT / "runs")}, **kw)
    port = af.port
    with stop_on_signals():
        try:
            af.start()
            af.wait_healthy()
            af.ensure_pools()
            for line in af.describe():
                print(line)
            print(f"Airflow UI: http://localhost:{port}  user {USER}  password {af.password()}")
            print(f"DiLoCo page: http://localhost:{port}/plugin/diloco (Browse -> DiLoCo)")
            print(
                f"AIRFLOW_HOME={af.home}; logs in {af.home / 'logs'}. Ctrl-C stops it.",
                flush=True,
            )
            while True:
                af.check_alive()
                time.sleep(2)
        except KeyboardInterrupt:
            return 0
        except AirflowError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 1
        finally:
            hold_signals()
            held = af.lock.held
            af.stop()
            if held:  # only the islands of the home this instance held
                stop_islands(ROOT / "runs")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print(
            "usage: python -m devtools.local_airflow serve [--port N] [--home DIR]", file=sys.stderr
        )
        return 2
    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else None
    home = argv[argv.index("--home") + 1] if "--home" in argv else None
    return serve(port, home)


if __name__ == "__main__":
    sys.exit(main())
