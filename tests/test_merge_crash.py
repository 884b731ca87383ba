"""A `diloco merge` process SIGKILLed at every step of a merge loses nothing and applies nothing
twice: the next merge completes the round (docs/STORE.md "Exactly-once application").

The killed merge is a real subprocess (`python -m training.cli merge`, killed by DILOCO_FAULTS at
a named fault point of training/faults/points.py); the recovery runs the same CLI in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import new_store, publish_delta, random_delta, small_config
from training import cli

EXP = "crash"
IDS = ["a/00000000-f000", "a/00000001-f000", "b/00000000-f000"]


def _state_at_kill(store) -> dict:
    """What the killed merge left: fragment 0's HEAD version, ledger, and its version dirs by
    completeness."""
    keys = store.list_keys("fragments/f000/v")
    dirs = {k.split("/")[2] for k in keys}
    manifests = {k.split("/")[2] for k in keys if k.endswith("/manifest.json")}
    return dict(
        head=store.head(0).version,
        ledger=sorted(store.applied()),
        without_manifest=len(dirs - manifests),
        off_chain=len(manifests) - len(store.list_fragment_versions(0)),
    )


# (syncer.full_every, point) -> what the store must look like right after the kill (proves
# where it landed); with full_every 4 version 1 is a light one (docs/STORE.md "Light versions")
EXPECTED_K1 = {
    "merge.after-read": dict(head=0, ledger=[], without_manifest=0, off_chain=0),
    "global.payload-written": dict(head=0, ledger=[], without_manifest=1, off_chain=0),
    "global.before-cas": dict(head=0, ledger=[], without_manifest=0, off_chain=1),
    "global.after-cas": dict(head=1, ledger=[], without_manifest=0, off_chain=0),
    "ledger.partial": dict(head=1, ledger=[IDS[0]], without_manifest=0, off_chain=0),
}
EXPECTED = {
    **{(1, point): state for point, state in EXPECTED_K1.items()},
    **{(4, point): state for point, state in EXPECTED_K1.items() if point != "merge.after-read"},
    (4, "light.before-manifest"): dict(head=0, ledger=[], without_manifest=1, off_chain=0),
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Per fault point: a store with three committed pseudo-gradients and a merge subprocess set
    to SIGKILL itself there (all started at once: the subprocesses' start-up dominates)."""
    runs = {}
    for k, point in EXPECTED:
        cfg = small_config(
            EXP, outer={"method": "nesterov"}, syncer={"full_every": k, "full_every_s": 0}
        )
        url = f"file://{tmp_path_factory.mktemp(point)}/store"
        store = new_store(cfg, url)
        theta = store.load_params()
        for n, pg in enumerate(IDS):  # several contributions: one version, several ledger entries
            publish_delta(store, cfg, pg[0], int(pg[2:10]), random_delta(theta, n))
        env = dict(os.environ, DILOCO_FAULTS=f"{point}@1", JAX_PLATFORMS="cpu")
        cmd = [sys.executable, "-m", "training.cli", "merge", "--store", url, "--experiment", EXP]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        runs[k, point] = (url, store, proc)
    yield runs
    for _, _, proc in runs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize("k, point", list(EXPECTED))
def test_merge_killed_at_every_step_then_rerun_applies_each_pseudo_gradient_once(killed, k, point):
    url, store, proc = killed[k, point]
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -9, stderr.decode()[-2000:]
    assert _state_at_kill(store) == EXPECTED[k, point]

    assert cli.main(["merge", "--store", url, "--experiment", EXP]) == 0
    chain = store.list_fragment_versions(0)
    assert [v["version"] for v in chain] == [0, 1]  # one version applied them all, once
    flat = [pg for v in chain for pg in v["applied"]]
    assert sorted(flat) == IDS  # every committed pseudo-gradient, none twice
    assert store.applied() == {pg: 1 for pg in IDS}  # the ledger agrees with the manifests
    assert store.quarantined() == {}
    assert cli.main(["merge", "--store", url, "--experiment", EXP]) == 0  # nothing left to do
    assert store.head(0).version == 1
