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


def test_derive_12b_divides_a_12b_fragment_merge_by_the_bytes_a_shard_moved_per_cpu_second():
    # (1e9 read + 7e9 written) in 20 CPU s: 4e8 B per CPU second. A 12B fragment with P = 24
    # is 5e8 parameters; 4 int4 contributions in = 4 x 5e8 x 0.5 = 1e9 B.
    # today: + a full version out (params, momentum, shadow, update: 4 x 5e8 x 4 = 8e9 B) =
    #   9e9 B, 22.5 s a merge: one merge a second needs 23 shards;
    # layout 3: + one int4 update (2.5e8 B) = 1.25e9 B, 3.125 s: 4 shards
    row = {"best": {"read_bytes": 1e9, "version_bytes": 7e9, "shard_cpu_s": 20.0}}
    d = syncer.derive_12b(row)
    assert d["bytes_per_cpu_s"] == 4e8
    assert d["today"]["bytes_per_fragment_merge"] == 9e9
    assert d["today"]["seconds_per_fragment_merge"] == pytest.approx(22.5)
    assert d["today"]["shards_for_profile"] == 23
    assert d["layout3"]["seconds_per_fragment_merge"] == pytest.approx(3.125)
    assert d["layout3"]["shards_for_profile"] == 4


def test_derive_12b_adds_light_versions_and_the_cpu_per_version_scaled_to_a_12b_fragment():
    # the same 4e8 B per CPU second. Light versions with k = 8: 1e9 in + 2.5e8 update out +
    # params, momentum and shadow (3 x 5e8 x 4 = 6e9 B) every 8th = 7.5e8: 2e9 B, 5 s: 5 shards.
    # By CPU: 20 CPU s over 100 versions of 5e6-parameter fragments = 0.2 s a version, x 100
    # for a 5e8-parameter fragment = 20 s: 20 shards
    row = {
        "best": {
            "read_bytes": 1e9,
            "version_bytes": 7e9,
            "shard_cpu_s": 20.0,
            "versions": 100,
            "fragment_params": 5e6,
            "full_every": 8,
        }
    }
    d = syncer.derive_12b(row)
    assert d["light"]["bytes_per_fragment_merge"] == 2e9
    assert d["light"]["shards_for_profile"] == 5
    assert d["by_cpu"]["seconds_per_fragment_merge"] == pytest.approx(20.0)
    assert d["by_cpu"]["shards_for_profile"] == 20


def test_a_small_trial_applies_every_contribution_once_within_a_round(tmp_path):
    a = argparse.Namespace(trial_s=3.0, max_trial_s=10.0)
    # 2 islands, P = 2, 2 contributions/s: a round is 2 s; max(3 s, 2 rounds) = 4 s of
    # publishing, one contribution every 0.5 s: 8
    t = syncer.trial(f"file://{tmp_path}/s", "tiny", 2, 2, 1, 2.0, a)
    assert (t["contributions"], t["applied"], t["applied_twice"]) == (8, 8, 0)
    assert t["passed"], t
    assert t["shard_cpu_s"] > 0  # the shard reported what its merging cost
    assert t["full_every"] == 8  # the default, recorded for derive_12b
