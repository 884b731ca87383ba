"""`outer.quorum = "auto"` (issue 26 item 1): the rule by hand, then the merger using it."""

from __future__ import annotations

import pytest

from tests.helpers import FakeClock, new_store, publish_delta, random_delta, small_config
from training.merge import quorum
from training.merge.admit import Candidate
from training.merge.merger import Merger
from training.merge.selection import select


def facts(live, round_s=24.0, download_s=1.0, fragments=4):
    return quorum.QuorumFacts(live, round_s, download_s, fragments)


@pytest.mark.parametrize(
    ("f", "k"),
    [
        # fit = floor(0.5 x 24 / (4 x 1)) = 3 versions a round >= 2 islands: K = 1
        (facts(2), 1),
        # fit = floor(12 / (4 x 4)) = 0: even one version overfills; K = ceil(2 / 1) = 2
        (facts(2, download_s=4.0), 2),
        # 4 islands, P = 2, round 40 s: fit = floor(20 / (2 x 2.5)) = 4 >= 4: K = 1
        (facts(4, 40.0, 2.5, 2), 1),
        # download 5 s: fit = floor(20 / 10) = 2 versions: K = ceil(4 / 2) = 2
        (facts(4, 40.0, 5.0, 2), 2),
        # download 10 s: fit = 1: one version a round, K = 4
        (facts(4, 40.0, 10.0, 2), 4),
        # 3 islands, fit 2 (20 / (2 x 5)): K = ceil(3 / 2) = 2
        (facts(3, 40.0, 5.0, 2), 2),
        # nothing known yet, or one live island: K = 1 (the grace window gathers what comes)
        (facts(3, download_s=None), 1),
        (facts(3, round_s=None, download_s=9.0), 1),
        (facts(1, download_s=100.0), 1),
        (facts(0, download_s=100.0), 1),
    ],
)
def test_auto_quorum_by_hand(f, k):
    assert quorum.auto_quorum(f) == k


def test_live_islands_are_the_active_ones_heard_from_within_the_window():
    beats = {
        "a": {"time": 95.0},  # 5 s old
        "b": {"time": 80.0},  # 20 s old: dead with a 15 s window
        "c": {"time": 99.0},  # fresh but done: not active
        "d": {},  # never said its time
    }
    live = quorum.live_islands(beats, {"a", "b", "d"}, 100.0, 15.0)
    assert sorted(live) == ["a"]
    # 3 heartbeats of 5 s, or 2 rounds of 12 s
    assert quorum.live_window(5.0, None) == 15.0
    assert quorum.live_window(5.0, 12.0) == 24.0


def test_the_slowest_live_download_counts():
    live = {"a": {"download_s": 0.5}, "b": {"download_s": 2.0}, "c": {}}
    assert quorum.slowest_download_s(live) == 2.0
    assert quorum.slowest_download_s({"c": {}}) is None


def _cand(island, published_at):
    return Candidate(f"{island}/0", island, 0, 0, 512, 4, 0, published_at, 1.0, "fp32", False, {})


def test_a_merge_short_of_k_waits_at_most_quorum_wait_s_from_when_the_merger_saw_it():
    cfg = small_config(outer={"grace_gamma": 0.0, "grace_min_steps": 0.0})
    one = [_cand("a", 10.0)]
    # K = 2 of {a, b}: only a came, published at 10, seen at 13 (its upload took 3 s): wait
    # until 13 + 24 (b's upload takes as long as a's)
    assert select(cfg, one, {"a", "b"}, 20.0, 0.0, 13.0, 2, 24.0) == ([], 37.0)
    groups, wait = select(cfg, one, {"a", "b"}, 37.0, 0.0, 13.0, 2, 24.0)
    assert (groups, wait) == ([one], None)  # a round passed: merged alone
    # a fixed quorum (no wait bound) keeps waiting, as before
    assert select(cfg, one, {"a", "b"}, 1e9, 0.0, None, 2, None) == ([], None)


# -- the merger ----------------------------------------------------------------------------------


def _setup(download_s: float, b_time: float):
    """Two islands, K auto, no grace; H = 4 and step_time_s 1.0 (tests.helpers): a round of
    4 s. Heartbeats: a at t = 0, b at `b_time`; both report `download_s`."""
    cfg = small_config(outer={"quorum": "auto", "grace_gamma": 0.0, "grace_min_steps": 0.0})
    store = new_store(cfg)
    for island, t in (("a", 0.0), ("b", b_time)):
        store.write_heartbeat(island, {"step": 4, "time": t, "download_s": download_s})
    return cfg, store, random_delta(store.load_params(), 0)


def test_a_thin_downlink_makes_one_version_of_both_islands():
    # download 2 s a version, P = 1, round 4 s: fit = floor(0.5 x 4 / 2) = 1 < 2 live: K = 2
    cfg, store, delta = _setup(download_s=2.0, b_time=0.0)
    merger = Merger(cfg, store, clock=FakeClock(1.0))
    publish_delta(store, cfg, "a", 0, delta)
    alone = merger.merge_once()
    assert alone.versions == {} and alone.waiting_until == 5.0  # first seen (1) + one round
    publish_delta(store, cfg, "b", 0, delta)
    assert sorted(merger.merge_once().applied) == ["a/00000000-f000", "b/00000000-f000"]
    assert store.head(0).version == 1


def test_a_fast_downlink_keeps_k_1():
    # download 0.5 s: fit = floor(2 / 0.5) = 4 >= 2: K = 1, a merges alone at once
    cfg, store, delta = _setup(download_s=0.5, b_time=0.0)
    publish_delta(store, cfg, "a", 0, delta)
    assert Merger(cfg, store, clock=FakeClock(1.0)).merge_once().applied == ["a/00000000-f000"]


def test_a_dead_island_is_not_waited_for():
    # b's heartbeat is 101 s old (window max(3 x 5 s, 2 x 4 s) = 15 s): one live island, K = 1
    cfg, store, delta = _setup(download_s=2.0, b_time=-100.0)
    publish_delta(store, cfg, "a", 0, delta)
    assert Merger(cfg, store, clock=FakeClock(1.0)).merge_once().applied == ["a/00000000-f000"]


def test_on_the_virtual_clock_auto_is_k_1_to_the_bit():
    """Reads take no virtual time, so every island's download_s is 0: K = 1 on every
    virtual-clock bench (quality, science, chaos, scavenging): the same bits as quorum 1."""
    from training.bench.sim import run_islands

    def run(q):
        cfg = small_config(islands=("a", "b", "c"), outer={"quorum": q}, token_budget=12 * 512)
        return run_islands(cfg, eval_dt=1e9)["params_sha256"]

    assert run("auto") == run(1)
