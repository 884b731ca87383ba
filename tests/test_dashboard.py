"""training/views/dashboard.py: the pure rules behind the DiLoCo page (states, links, curves, cache)."""

from __future__ import annotations

import pytest

from tests.helpers import new_store, small_config
from training.protocol import stall
from training.views import dashboard
from training.views.catalog import list_experiments


@pytest.mark.parametrize(
    "args, kw, state",
    [
        ((True, 100.0, 5.0), dict(task_state="failed"), "done"),
        ((False, 1.0, 5.0), dict(task_state="up_for_retry"), "retrying"),
        ((False, 1.0, 5.0), dict(task_state="failed"), "dead"),
        ((False, None, 5.0), dict(task_state="running"), "not started"),
        ((False, 61.0, 5.0), {}, "stalled"),  # 12 beats of 5 s: the 60 s floor
        ((False, 59.0, 5.0), {}, "running"),
        ((False, 59.0, 5.0), dict(stop_requested=True), "stopping"),
        ((False, 239.0, 20.0), {}, "running"),  # 12 beats of 20 s: 240 s
        ((False, 241.0, 20.0), {}, "stalled"),
        ((False, 61.0, 5.0), dict(limit_s=90.0), "running"),  # DILOCO_HEARTBEAT_TIMEOUT_S
        ((False, 1.0, 5.0), dict(left=True, task_state="failed"), "left"),
    ],
)
def test_island_state(args, kw, state):
    """The page's word (and `diloco status`'s) for an island: training/protocol/stall.py."""
    assert stall.island_state(*args, **kw) == state
    assert state in stall.ISLAND_STATES


def test_bucket_url_of_gs_is_the_cloud_console():
    assert (
        dashboard.bucket_url("gs://b/p/q", "exp", "pseudograds/a")
        == "https://console.cloud.google.com/storage/browser/b/p/q/exp/pseudograds/a"
    )


def test_bucket_url_of_a_path_is_the_path():
    assert dashboard.bucket_url("file:///tmp/s", "exp") == "file:///tmp/s/exp"


def test_thin_keeps_the_ends_and_the_limit():
    out = dashboard.thin(list(range(10_001)), 101)
    assert (len(out), out[0], out[-1], out[1]) == (101, 0, 10_000, 100)


def test_staleness_takes_the_worst_fragment_and_a_scalar_base():
    assert (dashboard.staleness([5, 9], [5, 2]), dashboard.staleness([5, 9], 4)) == (7, 5)


def test_badput_is_a_fraction_of_elapsed_time():
    state = {"elapsed_s": 100.0, "seconds": {"checkpoint_save": 5.0, "productive": 95.0}}
    assert dashboard.badput(state) == {"checkpoint_save": 0.05}


def test_metric_cache_reads_each_record_once():
    estore = new_store(small_config("cache"))
    cache = dashboard.MetricCache()
    estore.append_metric("eval", dict(version=0, loss=4.0, at=1.0))
    assert [r["loss"] for r in cache.records(estore, "eval")] == [4.0]
    reads = []
    real = estore.store.read
    estore.store.read = lambda key, max_bytes=None: reads.append(key) or real(key, max_bytes)
    estore.append_metric("eval", dict(version=1, loss=3.0, at=2.0))
    assert [r["loss"] for r in cache.records(estore, "eval")] == [4.0, 3.0]
    assert len(reads) == 1


def test_merge_row_latency_is_merge_minus_publish_time():
    row = dashboard.merge_row(
        dict(at=10.0, contributions=[dict(island="a", published_at=7.5, merged_at=10.0)])
    )
    assert (row["latency_s"], row["contributions"][0]["latency_s"]) == (2.5, 2.5)


def test_list_experiments_finds_configs_only(tmp_path):
    url = f"file://{tmp_path}"
    for name in ("b-exp", "a-exp"):
        new_store(small_config(name), url)
    (tmp_path / "not-an-experiment").mkdir()
    (tmp_path / "Bad_Name").mkdir()
    assert list_experiments(new_store(small_config("c-exp"), url).store) == [
        "a-exp",
        "b-exp",
        "c-exp",
    ]


def test_list_experiments_on_a_flat_listing_store():
    estore = new_store(small_config("m-exp"))
    assert list_experiments(estore.store) == ["m-exp"]


def test_quarantine_shows_the_newest_and_reads_each_reason_once():
    estore = new_store(small_config("q"))
    for seq in range(dashboard.QUARANTINE_SHOWN + 5):
        estore.quarantine(f"a/{seq:08d}-f000", f"bad {seq}")
    cache = dashboard.MetricCache()
    count, rows = cache.quarantine(estore)
    assert (count, len(rows), rows[-1]["reason"]) == (55, 50, "bad 54")
    estore.quarantine("b/00000099-f000", "new")
    reads = []
    real = estore.store.read
    estore.store.read = lambda key, max_bytes=None: reads.append(key) or real(key, max_bytes)
    count, rows = cache.quarantine(estore)
    assert (count, reads) == (56, ["q/quarantine/b/00000099-f000.json"])
