"""`diloco bench syncer` (training/bench/syncer.py): its schedule and 12B arithmetic by hand, and
one small real trial (two synthetic islands, one shard process, file://)."""

from __future__ import annotations

import argparse

import pytest

from training.bench import syncer


def test_schedule_spreads_contributions_island_major_and_counts_each_islands_seq():
    # N = 2, P = 2, 4 contributions/s for 1.5 s: one every 0.25 s, 6 of them; a round (every
    # island, every fragment once) is N x P / rate = 1 s
    plan = syncer.schedule(2, 2, 4.0, 1.5)
    assert plan == [
        (0.0, 0, 0, 0),
        (0.25, 1, 0, 0),
        (0.5, 0, 1, 1),
        (0.75, 1, 1, 1),
        (1.0, 0, 0, 2),
        (1.25, 1, 0, 2),
    ]


def test_derive_12b_divides_the_bytes_a_shard_moved_into_a_12b_fragment_merge():
    # 2 shards moved (1e9 + 7e9) bytes in 10 s: 4e8 B/s each. A 12B fragment with P = 24 is
    # 5e8 parameters: 4 int4 contributions in (4 x 5e8 x 0.5 = 1e9 B) and a full version out
    # (params, momentum, shadow, update as fp32: 4 x 5e8 x 4 = 8e9 B): 9e9 B a merge,
    # 4e8 / 9e9 = 0.0444 merges/s per shard, so 1 merge/s needs ceil(22.5) = 23 shards
    row = {"best": {"versions": 3, "read_bytes": 1e9, "version_bytes": 7e9, "publish_s": 10.0}}
    d = syncer.derive_12b(row, 2)
    assert d["bytes_per_fragment_merge"] == 9e9
    assert d["merges_per_s_per_shard"] == pytest.approx(4e8 / 9e9)
    assert d["shards_for_profile"] == 23


def test_a_small_trial_applies_every_contribution_once_within_a_round(tmp_path):
    a = argparse.Namespace(trial_s=3.0, max_trial_s=10.0)
    # 2 islands, P = 2, 2 contributions/s: a round is 2 s; max(3 s, 2 rounds) = 4 s of
    # publishing, one contribution every 0.5 s: 8
    t = syncer.trial(f"file://{tmp_path}/s", "tiny", 2, 2, 1, 2.0, a)
    assert (t["contributions"], t["applied"], t["applied_twice"]) == (8, 8, 0)
    assert t["passed"], t
