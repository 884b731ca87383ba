"""Production-shaped Airflow on this machine: PostgreSQL, Redis, the CeleryExecutor, two workers.

    python -m devtools.celery_airflow serve [--port N] [--home DIR] [--workers N]
    make airflow EXECUTOR=celery                     # the same

What `devtools.local_airflow` runs (api-server, scheduler, dag-processor, triggerer, the project's
DAGs and plugin), but the way Airflow is deployed: the metadata database is a PostgreSQL of its own
(Debian's ``postgresql`` package: ``initdb`` + ``postgres`` in a temporary directory, loopback
only, as the ``postgres`` user when run as root), the executor is Celery with Redis as its broker
(Debian's ``redis-server``, loopback only, nothing saved) and the results in PostgreSQL, and the
tasks run on N Celery workers, separate processes with distinct hostnames: ``[core]
hostname_callable`` is `worker_hostname`, which answers ``$DILOCO_WORKER_HOSTNAME`` (each worker
gets its own, ``worker-1``, ``worker-2``, ...), so the task instances record which worker ran them.

Every process leads its own session (setsid). `CeleryAirflow.stop` stops the components and workers
like `LocalAirflow.stop`, then kills what is left in their sessions (a task process leads its own
process group inside its worker's session, and outlives a worker killed by SIGKILL), then Redis and
PostgreSQL, and removes their directory. Island processes of the local backend lead sessions of
their own: `stop_islands` stops them (the test fixture and `serve` call it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "plugins"):  # `python -m devtools.celery_airflow` from the checkout
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from diloco_airflow.knobs import WORKER_HOSTNAME  # noqa: E402

from devtools.local_airflow import (  # noqa: E402
    COMPONENTS,
    AirflowError,
    LocalAirflow,
    groups_still_alive,
    port_in_use,
    serve,
)

HOSTNAME_ENV = WORKER_HOSTNAME.name
DB, DB_USER = "airflow", "airflow"


def worker_hostname() -> str:
    """``[core] hostname_callable`` of this setup: the worker's own name (``$DILOCO_WORKER_HOSTNAME``),
    else the machine's (Airflow's default, `socket.getfqdn`)."""
    return WORKER_HOSTNAME.get() or socket.getfqdn()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_program(name: str) -> str:
    """`name` on PATH, else in Debian's PostgreSQL directories (``/usr/lib/postgresql/<v>/bin``,
    not on PATH by default); AirflowError naming the package when neither has it."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(
        Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
        key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0,
    )
    if versions:
        return str(versions[-1])
    package = "redis-server" if name.startswith("redis") else "postgresql"
    raise AirflowError(f"{name} not found: apt-get install -y {package}")


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes of session `sid`, from /proc."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
        if int(fields[3]) == sid and fields[0] not in ("Z", "X", "x"):
            out.append(int(entry.name))
    return out


def kill_sessions(sids: list[int]) -> list[int]:
    """SIGKILL every process left in sessions `sids`; the pids killed."""
    killed = []
    for sid in sids:
        for pid in session_members(sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


class _Service:
    """A server process started in its own session, logging to a file, stopped by `stop`."""

    name = "service"

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.log"

    def _spawn(self, args: list[str], **kw) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                **kw,
            )

    def _wait(self, ready, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AirflowError(
                    f"{self.name} exited with {self.proc.returncode}; see {self.log_path}"
                )
            try:
                ready()
                return
            except Exception as exc:  # not accepting connections yet
                last = exc
            time.sleep(0.2)
        raise AirflowError(f"{self.name} not ready after {timeout_s:.0f}s: {last}")

    def stop(self, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        kill_sessions([self.proc.pid])
        self.proc = None


class Postgres(_Service):
    """A PostgreSQL cluster of its own in ``root/pgdata`` on 127.0.0.1:`port`: ``initdb`` (trust
    authentication, superuser ``airflow``), ``postgres`` with durability off (a test database),
    then ``CREATE DATABASE airflow``. As root, both run as the ``postgres`` user (initdb refuses
    root), which then owns `root`."""

    name = "postgres"

    def url(self, scheme: str = "postgresql") -> str:
        """The database's URL (SQLAlchemy 2.1's ``postgresql://`` driver is psycopg 3, Airflow
        3.3's default; the API server's async engine uses asyncpg)."""
        return f"{scheme}://{DB_USER}@127.0.0.1:{self.port}/{DB}"

    def start(self, timeout_s: float = 60.0) -> None:
        data = self.root / "pgdata"
        self.root.mkdir(parents=True, exist_ok=True)
        kw: dict = {}
        if os.geteuid() == 0:
            import pwd

            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise AirflowError("running as root but there is no postgres user") from None
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            kw = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        init = subprocess.run(
            [find_program("initdb"), "-D", str(data), "-U", DB_USER, "--auth=trust", "-E", "UTF8"]
            + ["--no-sync", "--no-instructions"],
            capture_output=True,
            text=True,
            cwd=self.root,
            **kw,
        )
        if init.returncode:
            raise AirflowError(f"initdb failed ({init.returncode}): {init.stderr.strip()[-500:]}")
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": self.port,
            "unix_socket_directories": str(self.root),
            "max_connections": 300,
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
        }
        args = [find_program("postgres"), "-D", str(data)]
        for key, value in settings.items():
            args += ["-c", f"{key}={value}"]
        self._spawn(args, cwd=self.root, **kw)
        import psycopg

        def create_db() -> None:
            with psycopg.connect(
                host="127.0.0.1", port=self.port, user=DB_USER, dbname="postgres", autocommit=True
            ) as conn:
                if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
                    return
                conn.execute(f"CREATE DATABASE {DB}")

        self._wait(create_db, timeout_s)

    def stop(self, grace_s: float = 10.0, sig: int = signal.SIGINT) -> None:  # a fast shutdown
        super().stop(grace_s, sig)


class Redis(_Service):
    """redis-server on 127.0.0.1:`port`, working directory `root`, nothing persisted."""

    name = "redis"

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        args = [find_program("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.root), "--save", "", "--appendonly", "no"]
        self._spawn(args, cwd=self.root)
        import redis

        self._wait(lambda: redis.Redis.from_url(self.url(), socket_timeout=2).ping(), timeout_s)


class CeleryAirflow(LocalAirflow):
    """`LocalAirflow` on PostgreSQL with the CeleryExecutor and `workers` Celery workers.

    The workers are ``worker-1`` ... ``worker-N`` in `procs` (``worker-<i>``: their hostname, also
    their Celery node name ``worker-<i>@<machine>``), `concurrency` task slots each. PostgreSQL and
    Redis live in a temporary directory under `tempfile.gettempdir()` (the ``postgres`` user must
    be able to enter it), removed by `stop`.
    """

    def __init__(self, *args, workers: int = 2, concurrency: int = 4, **kw) -> None:
        super().__init__(*args, **kw)
        self.workers = [f"worker-{i + 1}" for i in range(workers)]
        self.concurrency = concurrency
        self.services_dir: Path | None = None
        self.postgres: Postgres | None = None
        self.redis: Redis | None = None
        self._ports = {"scheduler_health": free_port(), "trigger_logs": free_port()}

    # ------------------------------------------------------------------ processes
    def env(self) -> dict[str, str]:
        env = super().env()
        assert self.postgres is not None and self.redis is not None, "start() first"
        root_first = [str(self.root), str(self.root / "plugins"), env.get("PYTHONPATH", "")]
        env.update(
            {
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.postgres.url(),
                "AIRFLOW__CELERY__BROKER_URL": self.redis.url(),
                "AIRFLOW__CELERY__RESULT_BACKEND": self.postgres.url("db+postgresql"),
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(self.concurrency),
                "AIRFLOW__CORE__HOSTNAME_CALLABLE": "devtools.celery_airflow.worker_hostname",
                # a worker lost with its tasks: their task instances stop heartbeating, and the
                # scheduler fails them (then retries them on a live worker) after this long
                # (default 300 s)
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
                # two setups (or a LocalAirflow) on one machine: no fixed ports
                "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": str(
                    self._ports["scheduler_health"]
                ),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(self._ports["trigger_logs"]),
                # the hostname callable lives in devtools/: the checkout first on the path
                "PYTHONPATH": os.pathsep.join(p for p in dict.fromkeys(root_first) if p),
            }
        )
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Take the home's lock, check the port, start PostgreSQL and Redis, migrate, start the
        components and the workers (AirflowError, one line, when something cannot start)."""
        self.lock.acquire()
        if port_in_use(self.port):
            self.lock.release()
            raise AirflowError(
                f"port {self.port} is in use (another Airflow?): set DILOCO_AIRFLOW_PORT"
            )
        self.services_dir = Path(tempfile.mkdtemp(prefix="diloco-celery-"))
        os.chmod(self.services_dir, 0o755)
        self.postgres = Postgres(self.services_dir / "postgres")
        self.redis = Redis(self.services_dir / "redis")
        self.postgres.start()
        self.redis.start()
        self.migrate_db(self.env())
        for name in COMPONENTS:
            self.start_component(name)
        for name in self.workers:
            self.start_component(name)
        self._write_pids()

    def component_args(self, name: str, env: dict[str, str]) -> list[str]:
        """A worker ``worker-<i>`` runs ``airflow celery worker`` under that hostname."""
        if name not in self.workers:
            return super().component_args(name, env)
        env[HOSTNAME_ENV] = name
        args = [*self.airflow_bin(), "celery", "worker", "--celery-hostname", f"{name}@%h"]
        return args + ["--concurrency", str(self.concurrency), "--skip-serve-logs"]

    def _write_pids(self) -> None:
        import json

        (self.home / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.procs.items()}))

    def kill_worker(self, name: str) -> int:
        """SIGKILL worker `name`'s main process (``kill -9`` of a Celery worker: its pool
        processes follow, by Celery's parent-death signal); it is no longer one of `procs`.
        Returns its pid."""
        proc = self.procs.pop(name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self._killed = [*getattr(self, "_killed", []), proc.pid]
        self._write_pids()
        return proc.pid

    def restart(self, name: str, grace_s: float = 30.0) -> None:
        """Stop component `name` the way `stop` does (SIGTERM, SIGKILL after `grace_s`), then
        start it again."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        kill_sessions([proc.pid])
        self.start_component(name)
        self._write_pids()

    def sessions(self) -> list[int]:
        """The session ids of every component and worker started, killed ones included."""
        return [p.pid for p in self.procs.values()] + list(getattr(self, "_killed", []))

    def wait_workers(self, timeout_s: float = 120.0) -> list[str]:
        """Wait until every live worker answers a Celery ping; their node names."""
        from celery import Celery

        assert self.redis is not None
        app = Celery(broker=self.redis.url())
        want = {n for n in self.workers if n in self.procs}
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                self.check_alive()
                replies = app.control.ping(timeout=1.0) or []
                nodes = sorted(name for reply in replies for name in reply)
                if want <= {n.split("@")[0] for n in nodes}:
                    return nodes
                if time.monotonic() > deadline:
                    raise AirflowError(f"workers {sorted(want)} not up after {timeout_s:.0f}s")
                time.sleep(1)
        finally:
            app.close()

    def describe(self) -> list[str]:
        """What `serve` prints: the database, the broker, the workers (once they answer)."""
        assert self.postgres is not None and self.redis is not None
        nodes = self.wait_workers()
        return [
            f"CeleryExecutor: PostgreSQL {self.postgres.url()}, Redis {self.redis.url()}",
            f"Celery workers: {', '.join(nodes)} (task instances' hostnames: {self.workers})",
        ]

    def stop(self, grace_s: float = 15.0) -> None:
        sessions = self.sessions()
        super().stop(grace_s)
        # task processes lead their own groups inside their worker's session
        kill_sessions(sessions)
        groups_still_alive(sessions, timeout_s=10)
        for service in (self.redis, self.postgres):
            if service is not None:
                service.stop()
        if self.services_dir is not None:
            shutil.rmtree(self.services_dir, ignore_errors=True)
            self.services_dir = None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print(
            "usage: python -m devtools.celery_airflow serve [--port N] [--home DIR] [--workers N]",
            file=sys.stderr,
        )
        return 2

    def opt(flag: str):
        return argv[argv.index(flag) + 1] if flag in argv else None

    port, home, workers = opt("--port"), opt("--home"), opt("--workers")
    for program in ("initdb", "postgres", "redis-server"):
        try:
            find_program(program)
        except AirflowError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    return serve(int(port) if port else None, home, cls=CeleryAirflow, workers=int(workers or 2))


if __name__ == "__main__":
    sys.exit(main())
