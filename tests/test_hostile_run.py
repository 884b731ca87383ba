"""Islands and merges keep going through hostile objects, and the loss stays within noise of an
untampered run (issue 37, "Deliver", last bullet).

One small real experiment on `file://`, run twice with the same seed: the production `Island`
and `Merger` over the store, islands a and b stepping in turn on a virtual clock (as the benches
do: training/bench/sim.py), a merge after each publish. Light versions (k = 4, int4 with update
broadcast, nesterov). In the tampered run, mid-run:

- version 6 (light) is committed and promoted, then one byte of its `update.safetensors` is
  flipped: the islands read version 6 from its promotion instead of by update;
- version 10 (light) gets a promotion whose outer state is NaN (checksums valid), and the merger
  restarts (a cold start, as after a killed syncer): the promotion is passed over and the chain
  replayed from full version 8;
- version 13 (light, not promoted) gets one byte of its update flipped: no representation of 13
  (nor of 14, 15, whose chains run through it) reads, so the islands pass over them, keep
  training on what they hold and adopt full version 16.

The untampered run promotes the same versions and restarts the merger at the same point. After
the token budget each island is run by its own `run()` (a relaunch: it resumes from its
checkpoint, sees the budget, publishes its remainder and writes its done marker).
"""

from __future__ import annotations

import logging

import pytest

from tests.helpers import flip_update_byte, new_store, promote_with_nan, small_config
from training.island.process import Island
from training.merge import replay
from training.merge.merger import Merger
from training.model.evaluate import eval_loss

pytestmark = pytest.mark.slow

ISLANDS = ("a", "b")
ROUND_TOKENS = 4 * 4 * 32  # H x batch x seq_len: one publish
BUDGET = 24 * ROUND_TOKENS  # about 24 merges (both islands together)
PROMOTED_FLIP, NAN_PROMOTION, UNPROMOTED_FLIP = 6, 10, 13


def _cfg(name: str, seed: int):
    return small_config(
        name,
        islands=ISLANDS,
        codec="int4",
        outer={"method": "nesterov"},
        syncer={"full_every": 4, "full_every_s": 0, "full_in_background": False},
        token_budget=BUDGET,
        seed=seed,
    )


def _experiment(tmp_path, seed: int, tampered: bool) -> dict:
    """One run; returns its final eval loss, its initial one, HEAD's version and the islands'
    run() results and done records."""
    cfg = _cfg(f"run{seed}{'t' if tampered else 'u'}", seed)
    store = new_store(cfg, f"file://{tmp_path}/store")
    initial = eval_loss(cfg, store.load_params(None, replay.params_of(cfg, store)))
    clock = _Clock()
    islands = [Island(cfg, name, store, clock=clock) for name in ISLANDS]
    for island in islands:
        island.start()
    merger = Merger(cfg, store, clock=clock)

    def merged(version: int) -> None:
        nonlocal merger
        if version == PROMOTED_FLIP:
            assert merger.promote_heads() == [0]
            if tampered:
                flip_update_byte(store, version)
        elif version == NAN_PROMOTION:
            if tampered:
                promote_with_nan(store, merger)
            merger = Merger(cfg, store, clock=clock)  # the syncer restarts: a cold start
        elif version == UNPROMOTED_FLIP and tampered:
            flip_update_byte(store, version)

    while not all(island.finished() for island in islands):
        for island in islands:
            if island.finished():
                continue
            clock.t += 1.0
            if island.step().published:
                for result in merger.merge_all():
                    if result.version is not None:
                        merged(result.version)
    runs = [island.run() for island in islands]  # relaunched: resume, remainder, done marker
    merger.merge_all()
    final = eval_loss(cfg, store.load_params(None, replay.params_of(cfg, store)))
    return dict(
        initial=initial,
        final=final,
        head=store.head(0).version,
        bases=[island.base_version[0] for island in islands],
        runs=runs,
        done=store.done(),
    )


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# Measured once (2026-12-05, this experiment on CPU; each run is deterministic, so each number
# repeats exactly on this machine), final eval loss from an initial 5.53:
#   untampered, seeds 0..4: 3.4853, 3.6225, 3.5128, 3.5424, 3.5398 (mean 3.5406, sd 0.0513)
#   tampered,   seeds 0..4: 3.4676, 3.5905, 3.5390, 3.5435, 3.4742 (tampered - untampered:
#   -0.018, -0.032, +0.026, +0.001, -0.066)
# The tolerance is three standard deviations of the untampered seeds (0.15, 7.5% of the 2.0
# the run improves the loss by): a tampered run is "within noise" when it ends as close to
# its untampered twin as two untampered seeds end to each other. Not bit equality: the
# islands that pass over versions 13 to 15 train on an older base, a different path.
TOLERANCE = 3 * 0.0513


def _lines(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    return lines


def test_hostile_objects_mid_run_leave_the_loss_within_noise(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        clean = _experiment(tmp_path / "clean", 0, tampered=False)
        clean_lines = _lines(caplog)
        hostile = _experiment(tmp_path / "hostile", 0, tampered=True)
        lines = _lines(caplog)
    for run in (clean, hostile):
        # every island finished (its run() returned after the budget, its done marker is
        # written), merges went on past every tampered version (to 16, the next full version,
        # and beyond) and the islands hold HEAD
        assert sorted(run["done"]) == list(ISLANDS)
        for name, info in zip(ISLANDS, run["runs"], strict=True):
            assert info["tokens"] == run["done"][name]["tokens"]
        assert sum(r["tokens"] for r in run["runs"]) >= BUDGET
        assert run["head"] >= UNPROMOTED_FLIP + 3 and run["bases"] == [run["head"]] * 2
    assert not [m for m in clean_lines if "crc32c" in m or "passed over" in m]

    # each hostile object is named with its reason
    flipped = [m for m in lines if "v00000006-" in m]
    assert flipped and all("update.safetensors fails its crc32c checksum" in m for m in flipped)
    assert all("reading version 6 whole" in m for m in flipped)  # and its promotion read
    nan = [m for m in lines if "promotion passed over" in m]
    assert len(nan) == 1 and "version 10" in nan[0] and "non-finite values" in nan[0]
    passed = [m for m in lines if "does not read, passed over" in m]
    assert {m.split(":")[0] for m in passed} == {f"island {n}" for n in ISLANDS}
    assert all("v00000013-" in m and "crc32c" in m for m in passed)
    # each island names the bad object once (its first version through it; later ones: INFO)
    assert sorted(m.split(":")[0] for m in passed) == sorted(f"island {n}" for n in ISLANDS), passed
    assert not [m for m in passed if "version 6 " in m]  # version 6 read: nothing passed over

    # the loss: within noise of the untampered run, and far below where it started
    assert abs(hostile["final"] - clean["final"]) <= TOLERANCE, (hostile["final"], clean["final"])
    assert hostile["final"] < hostile["initial"] - 1.5
