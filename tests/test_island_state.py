"""The island's training state is one typed structure (training/island/state.py): made fresh or
resumed by `start()`, checkpointed from, and nothing else the loop reads appears later."""

import dataclasses
import json

import numpy as np

from tests.helpers import new_store, small_config
from training.island.process import Island
from training.island.state import IslandState
from training.merge.merger import Merger
from training.model import inner


def _cfg(**sections):
    base = dict(
        outer={"method": "nesterov", "broadcast": "codec"},
        codec="int8",
        fragments={"count": 2},
        inner={"H": 4, "tau": 1},
        islands=("a",),
    )
    return small_config(**{**base, **sections})


def _host(island: Island, state: IslandState) -> dict:
    """Every field of `state`, as comparable host values."""
    tensors = lambda d: {k: np.asarray(v) for k, v in d.items()}  # noqa: E731
    shadow = lambda s: (s.version, s.dir, tensors(s.tensors))  # noqa: E731
    out = dict(
        params=inner.to_host(state.params),
        opt_state=island.loop.opt_state_to_host(state.opt_state),
        anchor=tensors(state.anchor),
        residual=tensors(state.residual),
        shadows={p: shadow(s) for p, s in state.shadows.items()},
        loader=state.loader.state(),
    )
    names = {f.name for f in dataclasses.fields(IslandState)}
    out.update({n: getattr(state, n) for n in names - set(out)})
    assert set(out) == names
    return out


def _assert_equal(a, b, path="state"):
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b, path


def test_fresh_and_resume_give_the_same_state_for_a_checkpoint_taken_at_start():
    cfg = _cfg()
    store = new_store(cfg)
    fresh = Island(cfg, "a", store)
    fresh.start()
    fresh.checkpoint(wait=True)
    resumed = Island(cfg, "a", store)
    resumed.start()
    assert (fresh.resumed, resumed.resumed) == (False, True)
    assert set(fresh.state.shadows) == {0, 1}  # broadcast "codec": the shadows are state too
    _assert_equal(_host(fresh, fresh.state), _host(resumed, resumed.state))


def _checkpoint(island: Island, state: IslandState) -> tuple[dict, dict]:
    tensors, meta = state.checkpoint(island.loop, island.frags)
    return {k: np.asarray(v) for k, v in tensors.items()}, json.loads(json.dumps(meta))


def test_a_resume_round_trips_every_field_a_checkpoint_holds():
    cfg = _cfg(error_feedback=True)
    store = new_store(cfg)
    island, merger = Island(cfg, "a", store), Merger(cfg, store)
    island.start()
    kinds = set()
    for _ in range(7):  # publishes at steps 4 and 6, each merged at once and adopted 2 later
        if island.step().published:
            merger.merge_all()
        tensors, meta = _checkpoint(island, island.state)
        again = IslandState.resume(
            island.loop,
            island.frags,
            tensors,
            meta,
            island.adopter.read_version,
            island.loader_at,
            keep_shadows=True,
        )
        back_tensors, back_meta = _checkpoint(island, again)
        assert back_meta == meta
        _assert_equal(back_tensors, tensors, "tensors")
        kinds.update(meta["anchor"])
    assert kinds == {"version", "params", "saved"}  # every kind of anchor went through
    assert island.state.residual  # and the error-feedback residuals


def test_nothing_the_loop_reads_appears_after_construction():
    cfg = _cfg()
    store = new_store(cfg)
    island = Island(cfg, "a", store)
    built = set(vars(island))
    assert island.state is None
    island.start()
    for _ in range(4):
        island.step()
    island.checkpoint(wait=True)
    assert set(vars(island)) == built
    assert isinstance(island.state, IslandState)
