"""TensorBoard event files (training/store/tensorboard.py), read back with TensorBoard's own
reader (EventAccumulator): exact values and steps, name order, the failure rule, and what a
short real run (two islands, a merge, an eval on file://) writes."""

import subprocess
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.gcs_fixture import gcs_bucket  # noqa: F401
from tests.helpers import new_store, publish_delta, small_config
from training.island.process import Island
from training.merge.merger import Merger, MergeResult
from training.model.evaluate import evaluate_current, evaluate_recent_merges
from training.store.experiment import ExperimentStore
from training.store.keys import BadName, parse_key, tb_events_key
from training.store.local import LocalStore
from training.store.registry import open_store
from training.store.tensorboard import ScalarWriter, merge_run, merge_scalars


def _scalars(run_dir: Path | str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _Estore(root: Path) -> ExperimentStore:  # experiment "exp" in a local store at root
    return ExperimentStore(LocalStore(str(root)), "exp")


def test_scalars_read_back_exactly_across_two_flushes(tmp_path):
    estore = _Estore(tmp_path)
    tb = ScalarWriter(estore, "merge")
    tb.add("loss", 2.5, 1)  # 2.5 and 0.125 are exact in float32 (simple_value's type)
    tb.add("loss", 0.125, 7)
    tb.flush()
    tb.add("loss", 1.0, 9)
    tb.flush()
    tb.flush()  # nothing buffered: no object
    keys = estore.store.list("exp/tb/")
    assert len(keys) == 2 and {parse_key(k[len("exp/") :]).kind for k in keys} == {"tensorboard"}
    assert _scalars(tmp_path / "exp/tb/merge") == {"loss": [(1, 2.5), (7, 0.125), (9, 1.0)]}


def test_nonfinite_values_are_dropped_and_counted(tmp_path):
    tb = ScalarWriter(_Estore(tmp_path), "eval")
    tb.add_all({"a": float("nan"), "b": None, "c": float("inf"), "d": 3.0}, 5)
    tb.flush()
    assert tb.dropped == 3  # a, b, c
    assert _scalars(tmp_path / "exp/tb/eval") == {"d": [(5, 3.0)]}


def test_a_failed_write_is_counted_never_raised(tmp_path):
    class Broken(ExperimentStore):
        def write_events(self, run, data):
            raise OSError("bucket gone")

    tb = ScalarWriter(Broken(LocalStore(str(tmp_path)), "exp"), "merge")
    tb.add("x", 1.0, 0)
    tb.flush()  # must not raise
    assert (tb.failures, tb.written) == (1, 0)


def test_merge_scalars_per_fragment_at_its_new_version():
    def c(staleness, published_at, weight):
        return dict(
            fragment=1,
            staleness=staleness,
            published_at=published_at,
            merged_at=10.0,
            weight=weight,
        )

    result = MergeResult(
        versions={1: 7}, tokens_merged=512, contributions=[c(0, 9.0, 0.25), c(2, 6.0, 0.75)]
    )
    assert merge_scalars(result) == [
        ("merge/tokens_merged", 512, 7),
        ("contributions/f001", 2, 7),
        ("staleness_mean/f001", 1.0, 7),  # (0 + 2) / 2
        ("staleness_max/f001", 2.0, 7),
        ("weight_mean/f001", 0.5, 7),  # (0.25 + 0.75) / 2
        ("latency_s_mean/f001", 2.5, 7),  # merged at 10: (1 + 4) / 2
        ("latency_s_max/f001", 4.0, 7),
    ]


def _data_server_log(logdir: Path) -> str:
    """What TensorBoard's own loader (the Rust data server `tensorboard` runs by default) logs
    over one load cycle of `logdir` (stderr; `-v`: INFO lines too)."""
    from tensorboard_data_server import server_binary

    proc = subprocess.Popen(
        [server_binary(), "--logdir", str(logdir), "--port", "0", "--port-file",
         str(logdir.parent / "port"), "--reload", "once", "--die-after-stdin", "-v"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stderr:  # the cycle's end is logged; then close stdin: it exits
            lines.append(line)
            if "Finished load cycle" in line:
                break
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    return "".join(lines)


def test_tensorboard_loads_a_file_store_run_without_a_warning(tmp_path):
    """Three flushes on file:// write three event files and their generation sidecars; the
    data server logs a WARN (`ReadRecordError(BadLengthCrc)`) for each file it opens whose
    name holds "tfevents" and is no event file: with no sidecar named so, none."""
    pytest.importorskip("tensorboard_data_server")
    estore = _Estore(tmp_path)
    tb = ScalarWriter(estore, "merge")
    for step in range(3):
        tb.add("loss", 1.0, step)
        tb.flush()
    run_dir = tmp_path / "exp/tb/merge"
    assert len(list(run_dir.iterdir())) == 6  # 3 event files + 3 sidecars
    log = _data_server_log(tmp_path / "exp/tb")
    assert "Finished load cycle" in log and "WARN" not in log, log


def test_a_store_hidden_file_never_holds_tfevents_in_its_name(tmp_path):
    """What TensorBoard opens is every file whose name holds "tfevents": on file:// exactly
    the event objects. The sidecar of `x.tfevents.1` is `..x.tf%65vents.1.gen`, a temp file
    `..x.tf%65vents.1.tmp-<hex>`; a name with "%" is escaped first ("%25"), so
    `a%65.tfevents` and `a%2565.tfevents` keep two sidecars."""
    store = LocalStore(tmp_path)
    for key in ("d/x.tfevents.1", "d/a%65.tfevents", "d/a%2565.tfevents", "d/plain"):
        store.write(key, b"1")
    names = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert [n for n in names if "tfevents" in n] == ["a%2565.tfevents", "a%65.tfevents",
                                                     "x.tfevents.1"]  # fmt: skip
    assert sorted(n for n in names if n.endswith(".gen")) == [
        "..a%252565.tf%65vents.gen",
        "..a%2565.tf%65vents.gen",
        "..x.tf%65vents.1.gen",
        ".plain.gen",  # an ordinary name keeps its sidecar's name
    ]
    temp = LocalStore._write_temp(tmp_path / "d/x.tfevents.1", b"half")
    assert temp.name.startswith("..x.tf%65vents.1.tmp-")
    assert store.drop_abandoned_writes("d/") == 1  # still found as an abandoned write


def test_event_file_names_sort_in_time_order_and_reject_bad_runs():
    early = tb_events_key("island-a", 999_999_999_999_999_999, "0000000f")
    late = tb_events_key("island-a", 1_000_000_000_000_000_000, "00000000")
    assert early < late  # 20 digits: a shorter number still sorts first
    with pytest.raises(BadName):
        tb_events_key("../x", 1)


def test_a_short_run_writes_island_merge_and_eval_scalars(tmp_path):
    """Two islands of H=4 steps, 8 steps each on file://: each publishes twice; one merge pass
    after the first 4 steps applies both islands' contributions to the one fragment."""
    cfg = small_config(heartbeat_s=0.001)
    store = new_store(cfg, f"file://{tmp_path}")
    islands = [Island(cfg, name, store, background=False) for name in ("a", "b")]
    for island in islands:
        island.run(max_steps=4)
    Merger(cfg, store).merge_all()
    evaluate_current(cfg, store)
    tb = tmp_path / cfg.name / "tb"
    assert sorted(p.name for p in tb.iterdir()) == ["eval", "island-a", "island-b", "merge"]
    island_a = _scalars(tb / "island-a")
    assert {"train/loss", "train/tokens_per_s", "train/goodput"} <= set(island_a)
    assert max(step for step, _ in island_a["train/loss"]) == 4
    merge = _scalars(tb / "merge")
    assert merge["contributions/f000"] == [(1, 2.0)]  # both islands, into version 1
    assert merge["staleness_max/f000"] == [(1, 0.0)]  # both trained from version 0
    (eval_loss,) = _scalars(tb / "eval")["eval/loss"]
    assert eval_loss[0] == 1  # the eval's step: the sum of fragment versions (one fragment)


def test_the_switch_off_writes_no_event_file(tmp_path):
    cfg = small_config(islands=("a",), heartbeat_s=0.001, tensorboard={"enabled": False})
    store = new_store(cfg, f"file://{tmp_path}")
    Island(cfg, "a", store, background=False).run(max_steps=2)
    assert store.store.list(f"{cfg.name}/tb/") == []


@pytest.mark.integration
def test_event_files_on_fake_gcs_server_read_back(tmp_path, gcs_bucket):  # noqa: F811
    """Two flushes into a fake-gcs-server bucket read back exactly by TensorBoard's reader
    straight from the gs:// run directory (what `tensorboard --logdir gs://...` does)."""
    estore = ExperimentStore(open_store(f"{gcs_bucket}/tb-{tmp_path.name}"), "exp")
    tb = ScalarWriter(estore, "eval")
    tb.add("eval/loss", 4.0, 0)
    tb.flush()
    tb.add("eval/loss", 3.5, 2)
    tb.flush()
    keys = estore.store.list("exp/tb/eval/")
    assert len(keys) == 2
    # TensorBoard reads gs:// itself (its gfile over fsspec / gcsfs, here on the emulator)
    assert _scalars(f"{gcs_bucket}/tb-{tmp_path.name}/exp/tb/eval") == {
        "eval/loss": [(0, 4.0), (2, 3.5)]
    }


def _steps_never_go_back(scalars: dict[str, list[tuple[int, float]]]) -> bool:
    """Each tag's steps in the order TensorBoard read them (its files in name order, each
    file's events in order) are non-decreasing."""
    return all(
        all(a <= b for a, b in zip(steps, steps[1:], strict=False))
        for steps in ([s for s, _ in points] for points in scalars.values())
    )


def test_an_island_restart_continues_its_run_after_its_last_heartbeat(tmp_path):
    """Process 1 trains steps 1-6 with a heartbeat after each (each flushed at once: flush_s
    1e-9) and dies; its checkpoint is at step 4 (H = 4). Process 2 resumes at step 4 and trains
    steps 5-8: its heartbeats at 5 and 6 are not written (process 1's are in the run), 7 and 8
    are. A publish round (steps 4 and 8) writes a heartbeat of its own too: train/tokens (128 a
    step: batch 4 x seq 32) is at steps 1, 2, 3, 4, 4, 5, 6, 7, 8, 8 (before: 5, 6 again after 6)."""
    cfg = small_config(islands=("a",), tensorboard={"flush_s": 1e-9})
    store = new_store(cfg, f"file://{tmp_path}")
    first = Island(cfg, "a", store)
    first.start()
    for _ in range(6):
        first.heartbeat(first.step().loss_array, 1.0)
    again = Island(cfg, "a", store)  # process 1 died (no closing heartbeat, no checkpoint)
    again.start()
    assert again.step_count == 4
    for _ in range(4):
        again.heartbeat(again.step().loss_array, 1.0)
    run = _scalars(tmp_path / cfg.name / "tb/island-a")
    assert run["train/tokens"] == [(s, 128.0 * s) for s in (1, 2, 3, 4, 4, 5, 6, 7, 8, 8)]
    assert _steps_never_go_back(run)


def test_each_merge_shard_writes_a_run_of_its_own():
    """Shards of S = 2 over P = 4 own fragments {0, 2} and {1, 3} (p % 2): runs merge-s0 and
    merge-s1; a merger of every fragment (`diloco merge`, finalize) writes "merge"."""
    assert merge_run([2, 0], 4) == "merge-s0"
    assert merge_run([1, 3], 4) == "merge-s1"
    assert merge_run(range(4), 4) == "merge"
    assert tb_events_key("merge-s1", 1).startswith("tb/merge-s1/")
    with pytest.raises(BadName):
        tb_events_key("merge-s01", 1)  # one spelling per shard


def test_the_last_merges_are_evaluated_oldest_first(tmp_path):
    """One fragment; five merges of one contribution each (versions 1-5); the evaluator saw
    version 1. The end of the run evaluates the merges no eval saw but the newest (versions 2,
    3, 4: syncer.final_evals 4 allows them all) oldest first, then the final eval version 5:
    the run "eval" holds steps 1, 2, 3, 4, 5 in that order."""
    cfg = small_config(islands=("a",))
    store = new_store(cfg, f"file://{tmp_path}")
    merger = Merger(cfg, store)
    zero = {k: np.zeros(v.shape, np.float32) for k, v in store.load_params(None).items()}
    for seq in range(5):
        publish_delta(store, cfg, "a", seq, zero, base_version=seq)
        merger.merge_all()
        if seq == 0:
            evaluate_current(cfg, store)
    recent = evaluate_recent_merges(cfg, store)
    evaluate_current(cfg, store)
    assert [r["version"] for r in recent] == [2, 3, 4]
    assert [s for s, _ in _scalars(tmp_path / cfg.name / "tb/eval")["eval/loss"]] == [1, 2, 3, 4, 5]


def test_a_writer_never_writes_a_lower_step_for_a_tag(tmp_path):
    """A shard's passes publish fragments at versions 10, then 8 (the pass merged only a lower
    fragment), then 11: merge/tokens_merged is written at steps 10, 10, 11 (8 raised to the
    tag's 10, counted once); another tag keeps its own steps (8 after 10 of the first tag)."""
    tb = ScalarWriter(_Estore(tmp_path), "merge-s0")
    tb.add("merge/tokens_merged", 100.0, 10)
    tb.add("merge/tokens_merged", 125.0, 8)
    tb.add("contributions/f002", 1.0, 8)
    tb.add("merge/tokens_merged", 150.0, 11)
    tb.flush()
    assert tb.raised == 1
    assert _scalars(tmp_path / "exp/tb/merge-s0") == {
        "merge/tokens_merged": [(10, 100.0), (10, 125.0), (11, 150.0)],
        "contributions/f002": [(8, 1.0)],
    }
