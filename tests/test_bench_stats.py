"""Statistics of the benchmarks over seeds (training/bench/stats.py), against hand-derived numbers."""

import math

import pytest

from training.bench import quality, stats


def test_mean_and_sample_std():
    mean, sd = stats.mean_std([1.0, 2.0, 3.0, 4.0])
    # mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, / (n - 1) = 5 / 3
    assert mean == 2.5 and sd == pytest.approx(math.sqrt(5 / 3), rel=1e-12)


def test_student_t_quantiles_match_the_table():
    assert stats.t_quantile(0.975, 2) == pytest.approx(4.302653, abs=1e-6)
    assert stats.t_quantile(0.975, 30) == pytest.approx(2.042272, abs=1e-6)


def test_paired_interval_by_hand():
    dp = [2.0, 2.2, 2.1]
    other = [2.1, 2.25, 2.25]
    # differences 0.10, 0.05, 0.15: mean 0.10, sd sqrt((0 + 0.0025 + 0.0025) / 2) = 0.05,
    # half width t(0.975, 2) * 0.05 / sqrt(3) = 4.302653 * 0.0288675 = 0.124207
    iv = stats.paired_interval(other, dp)
    assert (iv.n, iv.mean, iv.sd) == (3, pytest.approx(0.10), pytest.approx(0.05))
    assert (iv.lo, iv.hi) == (pytest.approx(-0.024207, abs=1e-6), pytest.approx(0.224207, abs=1e-6))


def test_relative_interval_is_in_percent_per_pair():
    # 2.1 / 2.0 - 1 = 5%, 2.25 / 2.2 - 1 = 2.272727%, 2.25 / 2.1 - 1 = 7.142857%
    iv = stats.relative_interval([2.1, 2.25, 2.25], [2.0, 2.2, 2.1])
    assert iv.mean == pytest.approx((5.0 + 2.272727 + 7.142857) / 3, abs=1e-5)


def test_one_pair_has_no_interval():
    iv = stats.paired_interval([2.5], [2.0])
    assert (iv.mean, iv.lo, iv.hi) == (0.5, None, None)


def test_unpaired_lengths_are_refused():
    with pytest.raises(ValueError, match="equal lengths"):
        stats.paired_interval([1.0, 2.0], [1.0])


def test_config_diff_lists_dotted_fields():
    a = {"inner": {"lr": 0.002, "H": 32}, "outer": {"method": "decoupled"}, "seed": 0}
    b = {"inner": {"lr": 0.003, "H": 32}, "outer": {"method": "sync"}, "seed": 0}
    assert stats.config_diff(a, b, ignore=["outer.method"]) == {"inner.lr": (0.002, 0.003)}


def test_bench_methods_differ_from_data_parallel_in_their_tuned_settings():
    import json

    cfg = quality.base_config("quick", None, None)
    dp = json.loads(quality.method_config(cfg, "dp").to_json())
    dec = json.loads(quality.method_config(cfg, "decoupled").to_json())
    diff = stats.config_diff(dec, dp, ignore=["outer.method"])
    # the baselines on one fragment (so one syncer shard), Decoupled on the library's default
    # P = 4 and S = 2
    assert diff == {
        "inner.lr": (0.002, 0.003),
        "inner.dylu": (True, False),
        "fragments.count": (4, 1),
        "syncer.shards": (2, 1),
    }
