"""Each step counted once (issue 36): an island killed anywhere between its publishes and the
checkpoint after them resumes, never publishes the same steps of a fragment twice, and leaves no
uncommitted checkpoint behind (docs/STORE.md "Each step counted once").

In process, on a virtual clock (deterministic): the island is dropped after k of the P publishes
past its checkpoint and restarted 2.5 s later on clock rounds, which puts it back in phase with
another fragment first, so its next sequence numbers name other fragments than before (the
issue's case: `00000030-f001` committed, then `00000030-f000` and `00000031-f001` for the same
steps). The merger's second line refuses overlapping ranges with the reason.

As processes (SIGKILL at the fault points): one island, H = 4 and P fragments published on staggered steps (fragment p at
step 4 + p, then every 4), a checkpoint after every P publish rounds, so the second window's P
publishes (steps 8..7+P; P = 1: step 8 alone) all fall between two checkpoints (step 3 + P and
7 + P). The island is killed at one fault point of that window, restarted, and runs to its
token limit (20 steps of 4 x 32 = 128 tokens: 2,560), publishing its remainders. Then one merger
applies everything, and for every fragment the island's applied step ranges
`(island_step - steps, island_step]` tile 1..20 exactly: no overlap (a step counted twice, the
bug) and no gap (a step lost); their tokens add up to the 2,560 trained, nothing is quarantined.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.gcs_fixture import gcs_bucket  # noqa: F401  (fixture)
from tests.helpers import cli_env, new_store, small_config
from training.config.experiment import parse_config
from training.island.process import Island
from training.merge.merger import Merger, initial_version
from training.store.experiment import ExperimentStore
from training.store.registry import open_store

pytestmark = pytest.mark.integration

STEPS, PER_STEP = 20, 4 * 32  # small_config: batch 4 x seq 32


def _island(url: str, faults: str = "") -> subprocess.CompletedProcess:
    argv = ["-m", "training.cli", "island", "--store", url, "--experiment", "once", "--island", "a"]
    env = cli_env(DILOCO_FAULTS=faults)
    return subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300
    )


def _experiment(url: str, P: int) -> ExperimentStore:
    cfg = small_config(
        "once",
        islands=[{"name": "a", "max_tokens": STEPS * PER_STEP}],
        fragments={"count": P, "strategy": "tensors" if P > 1 else "strided"},
        outer={"method": "nesterov"},
        checkpoint={"every_rounds": P},
    )
    store = ExperimentStore(open_store(url), "once")
    store.write_config(json.loads(cfg.to_json()))
    initial_version(cfg, store)
    return store


def _kill_and_finish(url: str, P: int, fault: str) -> ExperimentStore:
    store = _experiment(url, P)
    killed = _island(url, fault)
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = _island(url)
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = parse_config(store.read_config())
    Merger(cfg, store).merge_all(max_attempts=200)
    return store


def _ranges(store: ExperimentStore, P: int) -> dict[int, list[tuple[int, int, int]]]:
    """fragment -> sorted (first step, last step, tokens) of island a's applied contributions."""
    applied = store.applied()
    out: dict[int, list[tuple[int, int, int]]] = {p: [] for p in range(P)}
    for ref in store.list_pseudograds("a"):
        if ref.id in applied:
            m = ref.manifest
            out[ref.fragment].append(
                (m["island_step"] - m["steps"] + 1, m["island_step"], m["tokens"])
            )
    return {p: sorted(r) for p, r in out.items()}


def _assert_each_step_once(store: ExperimentStore, P: int, local_root: Path | None) -> None:
    assert store.done()["a"]["tokens"] == STEPS * PER_STEP
    assert store.quarantine_ids() == []
    for p, ranges in _ranges(store, P).items():
        steps = [s for first, last, _ in ranges for s in range(first, last + 1)]
        assert steps == list(range(1, STEPS + 1)), f"fragment {p}: {ranges}"
        assert sum(t for *_, t in ranges) == STEPS * PER_STEP, f"fragment {p}: {ranges}"
    # every fragment merged all 2,560 tokens: the budget counts each once
    for p in range(P):
        assert store.fragment_manifest(store.head(p))["tokens_merged"] == STEPS * PER_STEP
    # no checkpoint but the committed one, and (file://) no temp file of a cut-off write
    latest = store.checkpoint_pointer("a")
    dirs = {n.dir for n in store.list_named("checkpoints/a/", "checkpoint-file")}
    assert dirs == {latest.dir}
    if local_root is not None:
        left = [p.name for p in (local_root / "once/checkpoints/a").rglob(".*tmp-*")]
        assert left == []


# the window's P publishes committed (the n-th of all: 1..P are the first window's), each with
# the checkpoint after the window not yet committed; and the checkpoint cut off mid-write or
# before its LATEST (the second checkpoint: the first is the first window's)
def _points(P: int) -> list[str]:
    return [f"pseudograd.committed@{P + k}" for k in range(1, P + 1)] + [
        "checkpoint.mid-state@2",
        "checkpoint.before-latest@2",
    ]


FAST = [(4, "pseudograd.committed@6"), (4, "checkpoint.mid-state@2")]


@pytest.mark.parametrize("P,fault", FAST)
def test_a_killed_island_counts_each_step_once_on_file(tmp_path, P, fault):
    url = f"file://{tmp_path}/store"
    store = _kill_and_finish(url, P, fault)
    _assert_each_step_once(store, P, tmp_path / "store")


MATRIX = [(P, f) for P in (1, 4) for f in _points(P) if (P, f) not in FAST]


@pytest.mark.slow
@pytest.mark.parametrize("P,fault", MATRIX)
def test_every_kill_point_counts_each_step_once_on_file(tmp_path, P, fault):
    url = f"file://{tmp_path}/store"
    store = _kill_and_finish(url, P, fault)
    _assert_each_step_once(store, P, tmp_path / "store")


@pytest.mark.slow
@pytest.mark.parametrize("P,fault", [(P, f) for P in (1, 4) for f in _points(P)])
def test_every_kill_point_counts_each_step_once_on_gcs(gcs_bucket, P, fault):  # noqa: F811
    url = f"{gcs_bucket}/once-{uuid.uuid4().hex[:8]}"
    store = _kill_and_finish(url, P, fault)
    _assert_each_step_once(store, P, None)


# -- in process, on a virtual clock ---------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _tiles(store: ExperimentStore, P: int, last: int) -> None:
    """Each fragment's applied ranges of island a are exactly 1..last, once each."""
    for p, ranges in _ranges(store, P).items():
        steps = [s for first, end, _ in ranges for s in range(first, end + 1)]
        assert steps == list(range(1, last + 1)), f"fragment {p}: {ranges}"


# k < P: the P-th publish completes the window and the checkpoint follows it on the same
# step here (inline); between the two only a background write leaves room (the SIGKILL tests)
@pytest.mark.parametrize("P,k", [(2, 1), (4, 1), (4, 2), (4, 3)])
def test_a_restart_on_clock_rounds_publishes_no_step_twice(P, k):
    """H = 4, one virtual second a step, a checkpoint after every P publish rounds; the first
    window's P publishes are at steps 4..3+P (step rule until the merger sets the clock: t0 =
    4, period 4 s), its checkpoint at step 3 + P; the island is dropped after the k-th publish
    of the second window, restarted 2.5 s later and run 12 more steps."""
    cfg = small_config(
        "once",
        islands=("a",),
        outer={"method": "nesterov", "rounds": "clock"},
        fragments={"count": P, "strategy": "tensors" if P > 1 else "strided"},
        checkpoint={"every_rounds": P},
    )
    store, clock = new_store(cfg), _Clock()
    merger = Merger(cfg, store, clock=clock)
    island = Island(cfg, "a", store, clock=clock)
    island.start()
    published = 0
    while published < P + k:
        clock.t += 1.0
        published += len(island.step().published)
        merger.merge_all()
    checkpoint = store.checkpoint_pointer("a").step
    assert checkpoint < island.step_count  # committed publishes past the checkpoint
    clock.t += 2.5
    island = Island(cfg, "a", store, clock=clock)
    island.start()
    assert island.step_count == checkpoint
    assert sum(a is not None for a in island.state.committed_to) >= 1
    for _ in range(12):
        clock.t += 1.0
        island.step()
        merger.merge_all()
    island.publish_remainder()
    merger.merge_all()
    assert store.quarantine_ids() == []
    _tiles(store, P, island.step_count)


def test_the_merger_refuses_a_range_already_counted(tmp_path):
    """The second line: island a's seq 5 holds steps 30..31 of fragment 0 again (its seq 4
    ended at 31): quarantined with the reason, seq 4 applied once, the budget counts 256."""
    cfg = small_config("once", islands=("a",), outer={"method": "nesterov"})
    store = new_store(cfg)
    zeros = {n: np.zeros_like(v) for n, v in store.load_params().items()}
    for seq in (4, 5):
        manifest = dict(base_version=0, steps=2, tokens=256, codec="fp32", island_step=31)
        manifest.update(loss=1.0, step_time_s=0.1, published_at=float(seq))
        store.publish_pseudograd("a", seq, 0, zeros, manifest)
    Merger(cfg, store).merge_all()
    assert list(store.applied()) == ["a/00000004-f000"]
    reason = store.quarantine_reason("a/00000005-f000")
    assert "steps 30..31 overlap steps up to 31" in reason
    assert store.fragment_manifest(store.head(0))["tokens_merged"] == 256
