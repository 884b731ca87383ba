"""The island as its own OS process on this machine (the embedded default backend).

Layout of a run directory (``<runs_root>/<experiment>/<island>/``)::

    island.log        stdout + stderr of every launch, appended, one header line per launch
    process.json      the current launch: pid, pgid, /proc start time, exit-code path, command
    exitcode.<n>      written by the wrapper when launch number n ends: the return code
                      (negative = killed by that signal, as in ``subprocess``)

The island runs under a tiny Python wrapper (``sys.executable -c ...``) that starts the command,
ignores SIGTERM / SIGINT / SIGHUP itself (the whole process group receives them, so the island
does), waits for it and writes its return code atomically. The wrapper leads a new session
(``start_new_session=True``), so its pid is the process group id and the island's own children
are in that group: teardown signals the group and leaves nothing behind.

State is read from the process table and from files, never from memory alone, so a different
Airflow task (or worker process) than the one that launched the island can ask for its status, and
a retried launch finds and kills a copy left by an earlier try.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from diloco_airflow import knobs

from .base import BackendError, BackendStatus, IslandBackend, IslandSpec, ResourceState

_WRAPPER = r"""
import os, signal, subprocess, sys
exit_path, cmd = sys.argv[1], sys.argv[2:]
try:
    child = subprocess.Popen(cmd)
except OSError as exc:
    print(f"diloco-local: cannot start {cmd[0]!r}: {exc}", file=sys.stderr, flush=True)
    rc = 127
else:
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    rc = child.wait()
tmp = exit_path + ".tmp"
with open(tmp, "w") as f:
    f.write(str(rc))
    f.flush()
    os.fsync(f.fileno())
os.replace(tmp, exit_path)
sys.exit(rc if rc >= 0 else 128 - rc)
"""

LOG_NAME = "island.log"
PROCESS_NAME = "process.json"
TAIL_LINES = 20


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, starttime ticks) of a pid from /proc, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    fields = raw[raw.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); pgrp is field 5, starttime field 22
    return fields[0], int(fields[2]), int(fields[19])


def _have_proc() -> bool:
    return Path("/proc/self/stat").exists()


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` is a live (non-zombie) process, the same one that had ``start_ticks``."""
    if not pid:
        return False
    if _have_proc():
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X", "x"):
            return False
        return start_ticks is None or stat[2] == start_ticks
    try:  # pragma: no cover - non-Linux fallback
        os.kill(pid, 0)
    except ProcessLookupError:  # pragma: no cover
        return False
    except PermissionError:  # pragma: no cover
        return True
    return True  # pragma: no cover


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    if not _have_proc():  # pragma: no cover - non-Linux fallback
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat and stat[1] == pgid and stat[0] not in ("Z", "X", "x"):
            members.append(int(entry.name))
    return members


def _tail(path: Path, lines: int = TAIL_LINES, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


class LocalBackend(IslandBackend):
    """Islands as local OS processes.

    Args:
        runs_root: where run directories go; default ``$DILOCO_RUNS_ROOT`` or ``./runs``.
        grace_s: seconds between SIGTERM and SIGKILL in teardown (and when a relaunch kills an
            earlier copy).
        cwd: working directory of the island (default: this process's).
    """

    name = "local"

    def __init__(
        self,
        runs_root: str | os.PathLike | None = None,
        grace_s: float = 10.0,
        cwd: str | os.PathLike | None = None,
    ) -> None:
        root = runs_root or knobs.RUNS_ROOT.get() or "runs"
        self.runs_root = Path(root).expanduser().resolve()
        self.grace_s = float(grace_s)
        self.cwd = str(cwd) if cwd is not None else None
        # Popen objects of islands launched from this process, to reap them (no zombies) and to
        # learn how a wrapper that was itself killed ended.
        self._procs: dict[int, subprocess.Popen] = {}

    # ------------------------------------------------------------------ paths and records
    def run_dir(self, spec: IslandSpec) -> Path:
        return self.runs_root / spec.experiment / spec.island

    def _base_handle(self, spec: IslandSpec) -> dict[str, Any]:
        run_dir = self.run_dir(spec)
        return {
            "backend": self.name,
            "resource_id": spec.resource_id,
            "run_dir": str(run_dir),
            "log_path": str(run_dir / LOG_NAME),
        }

    def _read_record(self, spec: IslandSpec, handle: dict | None) -> dict[str, Any] | None:
        """The launch record: from the handle if it has one, else from process.json."""
        if handle and handle.get("pid"):
            return handle
        path = Path((handle or {}).get("run_dir") or self.run_dir(spec)) / PROCESS_NAME
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise BackendError(f"unreadable launch record {path}: {exc}", retryable=True) from exc

    # ------------------------------------------------------------------ interface
    def provision(self, spec: IslandSpec) -> dict:
        run_dir = self.run_dir(spec)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendError(f"cannot create run dir {run_dir}: {exc}", retryable=False) from exc
        return self._base_handle(spec)

    def launch(self, spec: IslandSpec, handle: dict) -> dict:
        run_dir = Path((handle or {}).get("run_dir") or self.run_dir(spec))
        run_dir.mkdir(parents=True, exist_ok=True)
        previous = self._read_record(spec, {"run_dir": str(run_dir)})
        launch_no = 1
        if previous:
            # a copy from an earlier try must not keep running next to the new one
            self._kill_group(previous)
            launch_no = int(previous.get("launch", 0)) + 1
            for old in run_dir.glob("exitcode.*"):
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()

        log_path = run_dir / LOG_NAME
        exit_path = run_dir / f"exitcode.{launch_no}"
        env = {"PYTHONUNBUFFERED": "1", **os.environ, **spec.env}
        argv = [sys.executable, "-c", _WRAPPER, str(exit_path), *spec.command]
        started_at = time.time()
        with open(log_path, "ab") as log:
            header = (
                f"=== diloco local launch {launch_no} of {spec.experiment}/{spec.island} at "
                f"{time.strftime('%Y-%m-%dT%H:%M:%S%z', time.localtime(started_at))}: "
                f"{' '.join(spec.command)}\n"
            )
            log.write(header.encode())
            log.flush()
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.cwd,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                raise BackendError(f"cannot start island wrapper: {exc}", retryable=False) from exc
        self._procs[proc.pid] = proc
        stat = _proc_stat(proc.pid) if _have_proc() else None
        record = {
            **self._base_handle(spec),
            "run_dir": str(run_dir),
            "log_path": str(log_path),
            "exit_path": str(exit_path),
            "pid": proc.pid,
            "pgid": proc.pid,  # start_new_session: the wrapper leads its own group
            "start_ticks": stat[2] if stat else None,
            "started_at": started_at,
            "launch": launch_no,
            "command": list(spec.command),
        }
        tmp = run_dir / (PROCESS_NAME + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, run_dir / PROCESS_NAME)
        return record

    def status(self, spec: IslandSpec, handle: dict) -> BackendStatus:
        run_dir = Path((handle or {}).get("run_dir") or self.run_dir(spec))
        if not run_dir.is_dir():
            return BackendStatus(ResourceState.GONE, f"run dir {run_dir} does not exist")
        record = self._read_record(spec, handle)
        if not record:
            return BackendStatus(ResourceState.PENDING, "provisioned, not launched")
        pid = int(record["pid"])
        proc = self._procs.get(pid)
        if proc is not None:
            proc.poll()  # reap a finished wrapper we started, so it is not a zombie
        if process_alive(pid, record.get("start_ticks")):
            return BackendStatus(ResourceState.RUNNING, f"pid {pid} running")

        log_path = Path(record.get("log_path") or run_dir / LOG_NAME)
        rc = self._exit_code(record)
        if rc is None and proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)  # dead but maybe not reaped yet by the poll above
            rc = proc.returncode  # the wrapper itself was killed (e.g. SIGKILL to the group)
        if rc == 0:
            return BackendStatus(ResourceState.SUCCEEDED, "exit code 0")
        tail = _tail(log_path)
        if rc is None:
            what = "process ended without recording an exit code (killed, or lost on a reboot)"
        elif rc < 0:
            what = f"killed by {_signal_name(-rc)}"
        else:
            what = f"exit code {rc}"
        message = f"{what}; last log lines:\n{tail}" if tail else what
        return BackendStatus(ResourceState.FAILED, message, retryable=True)

    def teardown(self, spec: IslandSpec, handle: dict) -> None:
        # the handle's launch and the latest one on record (they differ if a later try relaunched)
        records = []
        if handle and handle.get("pid"):
            records.append(handle)
        run_dir = (handle or {}).get("run_dir") or str(self.run_dir(spec))
        try:
            latest = self._read_record(spec, {"run_dir": run_dir})
        except BackendError:
            latest = None
        if latest:
            records.append(latest)
        done = set()
        for record in records:
            key = (record.get("pgid"), record.get("start_ticks"))
            if key not in done:
                done.add(key)
                self._kill_group(record)

    def running_group(self, spec: IslandSpec) -> int | None:
        """The process group id of the island's current launch while it runs, else None (what
        the chaos monkey SIGKILLs: the wrapper and the island, like a VM that disappears)."""
        try:
            record = self._read_record(spec, None)
        except BackendError:
            return None
        if not record or not record.get("pid"):
            return None
        pid = int(record["pid"])
        proc = self._procs.get(pid)
        if proc is not None:
            proc.poll()
        if not process_alive(pid, record.get("start_ticks")):
            return None
        return int(record.get("pgid") or pid)

    def kill_running(self, spec: IslandSpec) -> int | None:
        """SIGKILL the process group of the island's current launch (a chaos kill: its wait
        task then retries and relaunches it); the pgid, or None if it does not run."""
        pgid = self.running_group(spec)
        if pgid is None:
            return None
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pgid

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _exit_code(record: dict) -> int | None:
        exit_path = record.get("exit_path")
        if not exit_path:
            return None
        try:
            return int(Path(exit_path).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _kill_group(self, record: dict) -> None:
        """SIGTERM the island's process group, wait ``grace_s``, SIGKILL what is left."""
        pid = int(record.get("pid") or 0)
        pgid = int(record.get("pgid") or pid)
        if not pgid:
            return
        if _have_proc():
            stat = _proc_stat(pid)
            start = record.get("start_ticks")
            # pid reused by an unrelated process: then our group is long gone (Linux never hands
            # out a pid that is still in use as a process group id), leave it alone
            if stat is not None and start is not None and stat[2] != start:
                return
        if group_members(pgid):
            self._signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            while group_members(pgid) and time.monotonic() < deadline:
                self._reap(pid)
                time.sleep(0.05)
            if group_members(pgid):
                self._signal_group(pgid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while group_members(pgid) and time.monotonic() < deadline:
                    self._reap(pid)
                    time.sleep(0.02)
        self._reap(pid)

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)

    def _reap(self, pid: int) -> None:
        proc = self._procs.get(pid)
        if proc is not None:
            proc.poll()
