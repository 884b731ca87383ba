"""Island checkpoints: the policy, what they hold (never the global base), exact resume, and a
strict reader of what comes back."""

import numpy as np
import pytest

from tests.helpers import new_store, small_config
from training.config.experiment import CheckpointConfig
from training.island import checkpoint as checkpointing
from training.island.process import Island
from training.model import inner
from training.store.island_records import BadCheckpoint, parse_checkpoint_meta
from training.store.safejson import dump_json


def _cfg(**sections):
    base = dict(outer={"method": "nesterov"}, codec="int8", islands=("a",))
    return small_config(**{**base, **sections})


def _state(island: Island) -> dict[str, np.ndarray]:
    """Everything a resume must restore, on the host."""
    out = {f"param/{k}": v for k, v in inner.to_host(island.params).items()}
    out.update(
        {f"opt/{k}": v for k, v in island.loop.opt_state_to_host(island.state.opt_state).items()}
    )
    out.update({f"anchor/{k}": np.asarray(v) for k, v in island.state.anchor.items()})
    out.update({f"resid/{k}": np.asarray(v) for k, v in island.state.residual.items()})
    return out


def _record_saves(store) -> list[int]:
    """The steps of the checkpoints `store` commits from now on (each supersedes the last)."""
    steps, save = [], store.save_checkpoint

    def recording(island, step, *args, **kw):
        save(island, step, *args, **kw)
        steps.append(step)

    store.save_checkpoint = recording
    return steps


def _two_fragments_at_step_6() -> tuple:
    """P = 2, H = 4: an island stepped to its checkpoint at step 6 (cfg, store, island)."""
    cfg = _cfg(fragments={"count": 2}, inner={"H": 4, "tau": 10})
    store = new_store(cfg)
    island = Island(cfg, "a", store)
    island.start()
    for _ in range(6):
        island.step()
    return cfg, store, island


def test_the_policy_is_every_k_rounds_or_every_t_seconds():
    due = checkpointing.checkpoint_due
    assert due(CheckpointConfig(every_rounds=2), 2, 0.0)
    assert not due(CheckpointConfig(every_rounds=2), 1, 1e9)
    assert due(CheckpointConfig(every_rounds=0, every_s=10.0), 0, 10.0)
    assert not due(CheckpointConfig(every_rounds=0, every_s=10.0), 5, 9.9)
    assert not due(CheckpointConfig(every_rounds=0), 100, 1e9)


def test_an_island_checkpoints_every_k_publish_rounds():
    cfg = _cfg(checkpoint={"every_rounds": 2})  # H = 4, P = 1: a round every 4 steps
    store = new_store(cfg)
    saved = _record_saves(store)
    island = Island(cfg, "a", store)
    island.start()
    for _ in range(20):
        island.step()
    assert saved == [8, 16]


def test_a_checkpoint_names_the_global_versions_instead_of_holding_them():
    cfg = _cfg(fragments={"count": 2}, inner={"H": 4, "tau": 10})
    store = new_store(cfg)
    island = Island(cfg, "a", store)
    island.start()
    for _ in range(4):  # fragment 0 publishes at step 4; fragment 1 (offset 2) not yet
        island.step()
    tensors, meta = store.load_checkpoint("a")
    assert meta["step"] == 4 and meta["anchor"] == ["params", "version"]
    assert not [k for k in tensors if k.startswith("anchor/")]
    for _ in range(2):  # fragment 1 publishes at step 6: fragment 0's anchor is now saved
        island.step()
    tensors, meta = store.load_checkpoint("a")
    assert meta["anchor"] == ["saved", "params"]
    assert {k.removeprefix("anchor/") for k in tensors if k.startswith("anchor/")} == set(
        island.frags[0]
    )


@pytest.mark.parametrize("threaded", [False, True])
def test_resume_restores_the_saved_state_exactly(threaded):
    cfg = _cfg(fragments={"count": 2}, inner={"H": 4, "tau": 10})
    store = new_store(cfg)
    island = Island(cfg, "a", store, background=threaded)
    island.start()
    for _ in range(6):  # anchors: f0 saved, f1 params; int8 residuals of both
        island.step()
    saved = _state(island)
    island.step()  # the next step donates the buffers the background write reads
    island.ckpt_io.drain()
    island.io.drain()
    restored = Island(cfg, "a", store)
    restored.start()
    assert (restored.step_count, restored.seq) == (6, 2)
    got = _state(restored)
    assert sorted(got) == sorted(saved)
    for key, value in saved.items():
        assert got[key].tobytes() == value.tobytes(), key
    island.io.close()
    island.ckpt_io.close()


def test_a_resumed_interval_counts_the_steps_it_holds_from_before_the_checkpoint():
    # P = 2, H = 4: fragment 0 publishes at steps 4 and 8, fragment 1 (offset 2) at 2 and 6.
    # The checkpoint at step 6 is 2 steps into fragment 0's interval; resumed there, its
    # publish at step 8 holds steps 5-8 (the anchor is restored exactly), so its manifest must
    # say 4 steps and 4 x 128 tokens, not the 2 since the resume (the chaos e2e's missing
    # tokens: every restart under-counted its open intervals, and token weighting with them)
    cfg, store, island = _two_fragments_at_step_6()
    assert store.load_checkpoint("a")[1]["step"] == 6
    restored = Island(cfg, "a", store)
    restored.start()
    for _ in range(2):
        restored.step()
    restored.io.drain()
    ref = max((r for r in store.list_pseudograds("a") if r.fragment == 0), key=lambda r: r.seq)
    assert ref.manifest["island_step"] == 8
    assert (ref.manifest["steps"], ref.manifest["tokens"]) == (4, 4 * 128)


def test_the_checkpoint_reader_refuses_state_that_does_not_fit_the_model():
    cfg, store, island = _two_fragments_at_step_6()
    tensors, meta = store.load_checkpoint("a")
    loop = island.loop

    def parse(t, m=meta):
        return checkpointing.parse_state(
            t, m, loop.param_shapes, loop.opt_leaf_shapes, island.frags
        )

    parse(tensors)  # the real one is fine
    name = island.frags[0][0]
    cases = [
        {**tensors, "evil/x": np.zeros(1, np.float32)},
        {k: v for k, v in tensors.items() if k != f"param/{name}"},
        {**tensors, f"param/{name}": np.zeros(3, np.float32)},
        {**tensors, f"param/{name}": tensors[f"param/{name}"].astype(np.float16)},
        {k: v for k, v in tensors.items() if k != f"anchor/{name}"},
        {**tensors, f"anchor/{island.frags[1][0]}": tensors[f"param/{island.frags[1][0]}"]},
        {**tensors, "resid/nope": np.zeros(1, np.float32)},
        {k: v for k, v in tensors.items() if not k.startswith("opt/0000")},
    ]
    for bad in cases:
        with pytest.raises(BadCheckpoint):
            parse(bad)
    with pytest.raises(BadCheckpoint):
        parse(tensors, {**meta, "anchor": ["version", "params"]})  # f0's anchor is saved
    with pytest.raises(BadCheckpoint):
        parse(tensors, {**meta, "base_version": [0]})
    for anchor in (["params"], ["x", "params"], "saved", [["saved"], "params"]):
        with pytest.raises(BadCheckpoint):
            parse_checkpoint_meta(dump_json({**meta, "anchor": anchor}), "a", meta["step"])


@pytest.mark.parametrize(
    "since, why",
    [
        ("3 steps", "one open interval per fragment"),
        ([{"steps": 1, "tokens": 1, "seconds": 0.0, "timed": 0}], "one open interval per"),
        ([{"steps": 7, "tokens": 1, "seconds": 0.0, "timed": 0}] * 2, "steps 7"),  # > step 6
        ([{"steps": 2, "tokens": 1, "seconds": 0.0, "timed": 3}] * 2, "timed 3"),
        ([{"steps": 2, "tokens": -1, "seconds": 0.0, "timed": 0}] * 2, "tokens -1"),
        ([{"steps": 2, "tokens": 1, "seconds": -1.0, "timed": 0}] * 2, "seconds -1"),
        ([{"steps": 2, "tokens": 1, "seconds": 0.0, "timed": 0, "x": 1}] * 2, "is not"),
        ([{"steps": 2, "tokens": 1, "seconds": 0.0}] * 2, "is not"),
    ],
)
def test_the_reader_refuses_open_intervals_a_resume_could_not_count_on(since, why):
    meta = {"island": "a", "step": 6, "base_version": [0, 0], "since": since}
    with pytest.raises(BadCheckpoint, match="since") as err:
        parse_checkpoint_meta(dump_json(meta), "a", 6)
    assert why in str(err.value)


def test_a_background_snapshot_is_a_copy_the_next_step_cannot_donate():
    cfg = _cfg()
    store = new_store(cfg)
    island = Island(cfg, "a", store)
    island.start()
    params = island.params
    copied = island.loop.copy(params)
    assert all(
        copied[k].unsafe_buffer_pointer() != v.unsafe_buffer_pointer() for k, v in params.items()
    )
    island.step()  # donates `params`
    assert all(not v.is_deleted() for v in copied.values())
