"""A bucket that does not fill up (issue 12, item 6): an island deletes the checkpoints its new
one supersedes, the syncer collects garbage while it merges (not only in the paused maintenance
DAG), and `diloco status` shows the bytes the experiment holds by kind."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gcs_fixture import BACKENDS, gcs_bucket, open_backend  # noqa: F401
from tests.helpers import FakeClock, new_store, small_config
from training.merge.merger import MergeResult
from training.merge.syncer import ShardSyncer, housekeeping_due
from training.store.experiment import ExperimentStore
from training.views.status import bytes_by_kind, collect_status, format_status


def _state(value: float = 0.0) -> dict[str, np.ndarray]:
    return {"x": np.full(4, value, np.float32)}


def _checkpoint_dirs(store: ExperimentStore, island: str) -> list[str]:
    return sorted({k.rsplit("/", 1)[0] for k in store.list_keys(f"checkpoints/{island}/c")})


@pytest.fixture(params=BACKENDS)
def exp(request, tmp_path) -> ExperimentStore:
    return ExperimentStore(open_backend(request.param, request, tmp_path), "ret")


def test_a_new_checkpoint_deletes_the_ones_it_supersedes(exp):
    for step in (10, 20, 30):
        exp.save_checkpoint("a", step, _state(step), {})
    (only,) = _checkpoint_dirs(exp, "a")
    assert only == exp.checkpoint_pointer("a").dir and "/c0000000030-" in only
    assert exp.load_checkpoint("a")[1]["step"] == 30


def test_pruning_spares_other_islands_and_newer_checkpoints(exp):
    exp.save_checkpoint("b", 5, _state(), {})
    exp.save_checkpoint("a", 40, _state(), {})
    exp.prune_checkpoints("a", 20)  # a stale call: the newer, committed one stays
    assert len(_checkpoint_dirs(exp, "a")) == 1 and len(_checkpoint_dirs(exp, "b")) == 1


def test_housekeeping_is_due_when_on_and_every_s_passed():
    assert housekeeping_due(100.0, None, 60.0)
    assert not housekeeping_due(100.0, 50.0, 60.0) and housekeeping_due(110.0, 50.0, 60.0)
    assert not housekeeping_due(100.0, None, 0.0)


class _Merger:
    """Every merge_once applies one contribution (advancing the clock a second)."""

    def __init__(self, clock, merges):
        self.clock, self.left = clock, merges

    def promote_heads(self):
        return []

    def merge_once(self):
        if self.left == 0:
            return MergeResult()
        self.left -= 1
        self.clock.sleep(1.0)
        return MergeResult(versions={0: 1}, applied=[f"a/{self.left:08d}-f000"])


def _syncer(clock, merges, housekeeping, every_s):
    store = new_store(small_config("hk", syncer={"idle_s": 5, "poll_s": 0.5}))
    return ShardSyncer(
        store,
        0,
        "run-1",
        clock=clock,
        sleep=clock.sleep,
        merger_for=lambda cfg, fragments: _Merger(clock, merges),
        housekeeping=housekeeping,
        housekeeping_every_s=every_s,
    )


def test_the_syncer_collects_garbage_while_it_merges_on_its_cadence():
    clock, calls = FakeClock(1000.0), []
    out = _syncer(clock, 25, lambda: calls.append(clock.t), 10.0).drain()
    assert out.merges == 25
    assert calls == [1001.0, 1011.0, 1021.0]  # after the first merge, then every 10 s


def test_a_failing_collection_never_stops_the_merges():
    def broken():
        raise OSError("bucket blinked")

    out = _syncer(FakeClock(1000.0), 4, broken, 1.0).drain()
    assert (out.merges, out.reason) == (4, "idle")


def test_bytes_by_kind_sorts_keys_by_their_top_folder():
    sizes = {
        "checkpoints/a/c0000000001-00000000/state.safetensors": 100,
        "pseudograds/a/00000001-f000-deadbeef.safetensors": 10,
        "fragments/f000/v00000001-00000000/params.safetensors": 7,
        "ledger/a/00000001-f000.json": 1,
        "config.json": 2,
    }
    assert bytes_by_kind(sizes) == {
        "checkpoints": 100,
        "pseudo-gradients": 10,
        "versions": 7,
        "snapshots": 0,
        "records": 3,
        "total": 120,
    }


def test_status_shows_the_bytes_the_experiment_holds_by_kind():
    cfg = small_config("st")
    store = new_store(cfg)
    store.save_checkpoint("island-0", 3, _state(), {})
    status = collect_status(cfg, store)
    storage = status["storage"]
    assert storage["total"] == sum(store.sizes().values()) > 0
    assert storage["checkpoints"] == sum(
        n for k, n in store.sizes().items() if k.startswith("checkpoints/")
    )
    assert "store holds" in format_status(status) and "checkpoints" in format_status(status)


def test_every_backend_reports_the_sizes_of_what_it_holds(exp):
    exp.store.write("ret/a.json", b"12345")
    exp.store.write("ret/b/c.bin", b"x" * 1000)
    exp.store.write("other/d", b"zz")
    assert exp.sizes() == {"a.json": 5, "b/c.bin": 1000}


def test_the_merge_tasks_line_names_versions_contributions_and_tokens():
    from training.merge.syncer import merge_line

    result = MergeResult(
        versions={0: 7},
        applied=["a/00000003-f000"],
        tokens_merged=12345,
        contributions=[
            {"island": "a", "fragment": 0, "weight": 0.5, "staleness": 1, "published_at": 98.0}
        ],
    )
    assert merge_line(0, result, 100.0) == (
        "shard 0: merged 1 -> f0 v7; tokens 12,345; a f0 w 0.50 stale 1 2.0s"
    )
