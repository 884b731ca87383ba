"""A golden merge: three merges of two islands' int4 and int8 contributions (RDA, token
weights, Nesterov outer step), as digests of the published params and outer state.

It fails when anything changes the bits a merge computes: the codecs' decode, the
contribution norms (from the codes: training/codecs/host.py `codes_sq`), the combination, the
outer step, the C loops against their numpy code. `diloco replay` re-applies a run's merges
bit for bit with the code of its day; a change here means old runs no longer replay. If the
change is meant (its own tests say the new arithmetic is right), update GOLDEN with the
digests the failure prints and say in the commit message what changed and why.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tests.helpers import new_store, publish_delta, random_delta, small_config
from training.codecs import native
from training.merge.merger import Merger

GOLDEN = {  # codec: digest of the params and outer state of versions 1..3 (2026-12-05)
    "int4": "4e4e4a4789434239d395738f",
    "int8": "11a31206dd93dc77ae7d4d5d",
}


def _run(codec: str) -> str:
    cfg = small_config(codec=codec, outer={"method": "decoupled", "quorum": 2})
    store = new_store(cfg)
    theta = store.load_params()
    merger = Merger(cfg, store, warm_bytes=0)  # cold every time: each version read back
    h = hashlib.sha256()
    for version in range(3):
        for n, island in enumerate("ab"):
            delta = random_delta(theta, 10 * version + n, scale=1e-2 * (n + 1))
            publish_delta(store, cfg, island, version, delta, base_version=version)
        assert len(merger.merge_once().applied) == 2
        params = store.load_params()
        for name in sorted(params):
            h.update(name.encode() + np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()[:24]


@pytest.mark.parametrize("codec", sorted(GOLDEN))
def test_merge_bits_are_the_golden_ones(codec):
    got = _run(codec)
    assert got == GOLDEN[codec], f"{codec}: the merge's bits changed (see the docstring): {got}"


@pytest.mark.parametrize("codec", sorted(GOLDEN))
def test_the_numpy_loops_give_the_golden_bits_too(codec, monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    assert _run(codec) == GOLDEN[codec]


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_over_chunks_give_the_golden_bits(threads):
    # every C loop split over threads by chunk ranges; sums added in chunk order after
    native.set_threads(threads)
    try:
        assert _run("int4") == GOLDEN["int4"]
    finally:
        native.set_threads(1)


def test_votes_folded_one_by_one_give_the_golden_bits(monkeypatch):
    # FOLD_BYTES 0: every vote folded as it is added (one pass over the accumulators each)
    from training.merge import combine

    monkeypatch.setattr(combine, "FOLD_BYTES", 0)
    assert _run("int8") == GOLDEN["int8"]
