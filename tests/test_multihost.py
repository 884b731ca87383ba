"""Multi-host islands (training/island/multihost.py): one island of 2 processes x 4 CPU devices over
gloo on loopback against the same island in one process with 8 devices, through `diloco
island`; and the multi-host flags the backends pass, accepted by its parser."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from diloco_airflow.backends import IslandSpec
from diloco_airflow.backends.k8s_manifests import build_jobset, validate_jobset
from diloco_airflow.backends.tpu_startup import startup_script

from tests.helpers import SMALL_MODEL
from training import cli
from training.codecs import host as codecs
from training.island.multihost import ProcessGroup, ReadOnlyStore, flag_defaults
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

ROOT = Path(__file__).resolve().parents[1]
ISLAND_ARGS = ["island", "--store", "gs://b/e", "--experiment", "e", "--island", "m0"]
STEPS, BATCH, SEQ = 10, 8, 32


# -- the flags: backends -> CLI ------------------------------------------------------------------


def _island_args(argv: list[str]):
    return cli.build_parser().parse_args(argv)


def test_tpu_vm_multi_host_command_line_is_accepted_by_diloco_island():
    spec = IslandSpec(
        experiment="e",
        island="m0",
        store_url="gs://b/e",
        command=["diloco", *ISLAND_ARGS],
        hardware={"accelerator_type": "v5p-64", "coordinator_flags": True},
    )
    line = next(x for x in startup_script(spec).splitlines() if x.strip().startswith("diloco "))
    env = {"DILOCO_COORDINATOR": "10.0.0.2:8476", "DILOCO_NUM_PROCESSES": "8"}
    env["DILOCO_PROCESS_ID"] = "3"
    words = shlex.split(re.sub(r'"\$(\w+)"', lambda m: shlex.quote(env[m.group(1)]), line))
    args = _island_args(words[1:])
    assert (args.coordinator, args.num_processes, args.process_id) == ("10.0.0.2:8476", 8, 3)


def test_gke_jobset_command_line_is_accepted_by_diloco_island():
    spec = IslandSpec(
        experiment="e",
        island="m0",
        store_url="gs://b/e",
        command=["diloco", *ISLAND_ARGS],
        hardware={
            "accelerator": "tpu-v5p-slice",
            "topology": "2x2x4",
            "image": "img",
            "coordinator_flags": True,
        },
    )
    jobset = build_jobset(spec)
    validate_jobset(jobset)  # the env's valueFrom (the completion index) is a valid EnvVar
    (container,) = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"
    ]
    env = {e["name"]: e.get("value", "2") for e in container["env"]}  # valueFrom: the index
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["command"]]
    args = _island_args(argv[1:])
    assert (args.num_processes, args.process_id) == (4, 2)
    assert args.coordinator.endswith("-island-0-0." + args.coordinator.split(".")[1])


def test_an_empty_coordinator_and_process_id_are_left_to_jax_to_detect():
    args = _island_args([*ISLAND_ARGS, "--coordinator", "", "--num-processes", "4"])
    assert (args.coordinator, args.num_processes) == ("", 4)
    assert args.process_id is None


def test_flag_defaults_come_from_the_backends_environment():
    got = flag_defaults({"DILOCO_NUM_PROCESSES": "4", "DILOCO_PROCESS_ID": "1"})
    assert got == {"coordinator": None, "num_processes": "4", "process_id": "1"}


# -- the group -----------------------------------------------------------------------------------


def test_a_single_process_group_decides_itself_and_writes():
    group = ProcessGroup()
    assert group.agree(lambda: [1, 2]) == [1, 2] and group.writer and not group.peer_stopping()


class _KV:
    """The coordination service's key-value store, in memory (one per island)."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value):
        assert key not in self.kv, key
        self.kv[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        return self.kv[key]

    def key_value_delete(self, key):
        del self.kv[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_followers_get_process_zeros_decision_and_never_decide():
    kv = _KV()
    leader, follower = ProcessGroup(0, 2, kv), ProcessGroup(1, 2, kv)
    assert leader.agree(lambda: (3, [1])) == [3, [1]]  # what every process gets: JSON
    assert follower.agree(lambda: pytest.fail("a follower decided")) == [3, [1]]


def test_a_followers_sigterm_is_seen_by_process_zero():
    kv = _KV()
    leader, follower = ProcessGroup(0, 2, kv), ProcessGroup(1, 2, kv)
    assert not leader.peer_stopping()
    follower.announce_stop()
    assert leader.peer_stopping()


def test_a_follower_store_refuses_writes_and_passes_reads():
    class Store:
        def heads(self):
            return ["h"]

        def write_heartbeat(self, *a):
            raise AssertionError("reached the store")

    ro = ReadOnlyStore(Store())
    assert ro.heads() == ["h"]
    with pytest.raises(RuntimeError, match="only process 0"):
        ro.write_heartbeat("a", {})


# -- 2 processes x 4 devices == 1 process x 8 devices --------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(url: str) -> None:
    sets = {
        "model": SMALL_MODEL,
        "data.seq_len": SEQ,
        "data.batch_size": BATCH,
        "inner.H": 4,
        "inner.warmup_steps": 1,
        "inner.tau": 1,
        "fragments.count": 2,
        "codec": "fp32",
        "outer.rounds": "steps",
        "outer.method": "nesterov",
        "islands": [{"name": "a", "max_tokens": STEPS * BATCH * SEQ}],
    }
    argv = ["init", "--store", url, "--name", "mh"]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value if isinstance(value, str) else _json(value)}"]
    assert cli.main(argv) == 0


def _json(value) -> str:
    import json

    return json.dumps(value)


def _island(url: str, devices: int, extra: list[str], max_steps: int | None):
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
    }
    argv = [sys.executable, "-m", "training.cli", "island", "--store", url]
    argv += ["--experiment", "mh", "--island", "a", *extra]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    return subprocess.Popen(
        argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait(procs) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]


def _run_both(single: str, multi: str, max_steps: int | None) -> None:
    port = _free_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [_island(single, 8, [], max_steps)]
    procs += [_island(multi, 4, [*flags, "--process-id", str(i)], max_steps) for i in (0, 1)]
    _wait(procs)


def _objects(root: Path) -> list[str]:
    """The store's object names, with the unique parts (uuids, times) masked."""
    names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    # a whole 8-hex unique part first: a unique part that starts with 6 digits ("1234567c")
    # must not lose only its digits to the number rule
    return sorted(re.sub(r"(?<![0-9a-f])[0-9a-f]{8}(?![0-9a-f])|\d{6,}", "#", n) for n in names)


@pytest.mark.slow
def test_two_processes_of_four_devices_train_as_one_process_of_eight(tmp_path):
    urls = {k: f"file://{tmp_path / k}" for k in ("single", "multi")}
    for url in urls.values():
        _init(url)
    _run_both(urls["single"], urls["multi"], max_steps=6)  # stops mid-run: a checkpoint
    for url in urls.values():
        assert cli.main(["merge", "--store", url, "--experiment", "mh"]) == 0
    _run_both(urls["single"], urls["multi"], max_steps=None)  # resumes, adopts, finishes
    stores = {k: ExperimentStore(open_store(u), "mh") for k, u in urls.items()}
    refs = {k: s.list_pseudograds("a") for k, s in stores.items()}
    assert [r.id for r in refs["multi"]] == [r.id for r in refs["single"]]
    for one, two in zip(refs["single"], refs["multi"], strict=True):
        assert two.manifest["loss"] == pytest.approx(one.manifest["loss"], rel=1e-4)
        a = codecs.decode(stores["single"].load_pseudograd(one), "fp32")
        b = codecs.decode(stores["multi"].load_pseudograd(two), "fp32")
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-3, atol=1e-5)
    assert refs["multi"][-1].manifest["base_version"] == 1  # resumed, then adopted the merge
    assert set(stores["multi"].done()) == {"a"} and stores["multi"].done()["a"]["step"] == STEPS
    assert _objects(tmp_path / "multi") == _objects(tmp_path / "single")
