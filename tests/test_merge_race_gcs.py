"""Two `diloco merge --follow` processes at once on fake-gcs-server, while three islands publish:
every pseudo-gradient is applied exactly once, and the mergers really did race for HEAD.

fake-gcs-server enforces generation preconditions (tests/gcs_fixture.py), so the HEAD
compare-and-swap is the real GCS one: of two mergers publishing from the same head, one gets 412
and logs "lost the head race"; its version directory stays off HEAD's chain.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.gcs_fixture import gcs_bucket  # noqa: F401
from tests.helpers import new_store, publish_delta, random_delta, small_config

pytestmark = pytest.mark.integration

EXP = "race"
ISLANDS = ("a", "b", "c")
ROUNDS = 6


def _wait_applied(store, committed, mergers, logs, timeout=120):
    """Until every id in `committed` is in the ledger; fails early if a merger exits."""
    deadline = time.monotonic() + timeout
    while not set(store.applied()) >= committed:
        exited = [p.returncode for p in mergers if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            tails = "\n".join(log.read_text()[-2000:] for log in logs)
            missing = sorted(committed - set(store.applied()))
            pytest.fail(
                f"mergers exited {exited} / missing {missing}, "
                f"quarantined {store.quarantined()}\n{tails}"
            )
        time.sleep(0.1)


# full_every 4: light versions between full ones; the merger that lost a race holds no warm
# arrays of the new HEAD, so it starts cold there (replays from the full version) every time
@pytest.mark.parametrize("full_every", [1, 4])
def test_two_merge_processes_racing_on_gcs_apply_each_once(gcs_bucket, tmp_path, full_every):  # noqa: F811
    url = f"{gcs_bucket}/race-{uuid.uuid4().hex[:8]}"
    cfg = small_config(
        EXP,
        islands=ISLANDS,
        outer={"method": "decoupled", "quorum": 1},
        syncer={"full_every": full_every, "full_every_s": 0},
    )
    store = new_store(cfg, url)
    theta = store.load_params()

    env = dict(os.environ, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "training.cli", "-v", "merge", "--store", url]
    cmd += ["--experiment", EXP, "--follow", "--poll", "0.05"]
    logs = [tmp_path / f"merger{i}.log" for i in range(2)]
    mergers = [
        subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        for log in logs
    ]
    try:
        committed = set()
        for seq in range(ROUNDS):  # each round: every island publishes, based on the newest head
            for n, island in enumerate(ISLANDS):
                base = store.head(0).version
                delta = random_delta(theta, 10 * seq + n)
                committed.add(publish_delta(store, cfg, island, seq, delta, base_version=base).id)
            # the next round comes once this one is merged: both mergers, polling every 50 ms
            # and idle, see it at once and race for it (round 0 also waits for their start-up)
            _wait_applied(store, committed, mergers, logs)
        for island in ISLANDS:
            store.mark_done(island, {})
        store.request_stop()  # --follow exits once stop is requested and every island is done
        codes = [p.wait(timeout=60) for p in mergers]
    finally:
        for p in mergers:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = [log.read_text() for log in logs]
    assert codes == [0, 0], out

    chain = store.list_fragment_versions(0)
    flat = [pg for v in chain for pg in v["applied"]]
    assert len(flat) == len(set(flat))  # none applied twice
    assert set(flat) == committed  # none lost
    assert store.applied() == {pg: v["version"] for v in chain for pg in v["applied"]}
    assert store.quarantined() == {}
    # the race was real: each losing publish logged it and left a manifest off HEAD's chain
    lost = sum(text.count("lost the head race") for text in out)
    manifests = [k for k in store.list_keys("fragments/") if k.endswith("/manifest.json")]
    assert lost >= 1, out
    assert len(manifests) - len(chain) == lost
