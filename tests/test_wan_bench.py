"""The WAN benchmark's arithmetic (training/bench/wan/bench.py) and the 12B figure (model12b.py).

Fast: no namespace, no training. The benchmark itself runs in `diloco bench wan` (docs/WAN.md);
the harness it runs on is tested in tests/test_wan_netns.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from training.bench.wan import bench, model12b, params
from training.bench.wan.model12b import Assumptions
from training.bench.wan.runner import (
    _phase_throughput,
    _publishes_after,
    _tokens_at,
    merge_timeline,
)


def test_link_rate_makes_dp_communication_ratio_times_compute() -> None:
    # 1 MB per step, 0.1 s compute, ratio 10: the transfer must take 1 s, so 8 Mbit/s
    assert params.link_mbit(1e6, 0.1, 10.0) == pytest.approx(8.0)


def test_tokens_to_target_interpolates_between_evaluations() -> None:
    curve = [(0, 5.0), (100, 3.0), (200, 2.0)]
    assert bench.tokens_to(curve, 2.5) == pytest.approx(150.0)
    assert bench.tokens_to(curve, 1.0) is None


def test_loss_at_interpolates_and_clamps() -> None:
    curve = [(0, 5.0), (100, 3.0)]
    assert bench.loss_at(curve, 50) == pytest.approx(4.0)
    assert bench.loss_at(curve, 500) == 3.0


def _log(pub_every: int, steps: int) -> list[dict]:
    log = [{"t": 0.0, "event": "started", "step": 0}]
    return log + [
        {"t": float(s), "step": s, "tokens": 10 * s, "published": int(s % pub_every == 0)}
        for s in range(1, steps + 1)
    ]


def test_phase_throughput_runs_from_the_first_publish_after_the_phase_starts() -> None:
    log = _log(4, 16)
    log[12]["t"] = 20.0  # the step that publishes at 12 is slow (an upload, say)
    assert _publishes_after(log, 5.0) == 3  # publishes at 8, 12, 16
    # from the publish at 8 to the one at 16: 80 tokens in 8 s (the slow step is inside)
    assert _phase_throughput(log, 5.0, 3) == pytest.approx(80 / 8.0)
    assert _phase_throughput(log, 5.0, 2) == pytest.approx(40 / 12.0)
    assert _tokens_at(log, 6.5) == 60


def test_rows_give_speedup_over_dp_at_each_gbps() -> None:
    per = {"up": 2.0, "down": 3.0}
    m = {
        "dp": {
            "tokens_to_target": 100.0,
            "bytes_per_token": per,
            "throughput": {2.0: 1.0},
            "line_throughput": {2.0: 2.0},
        },
        "sync": {"tokens_to_target": 200.0, "bytes_per_token": per, "throughput": {2.0: 10.0}},
        "decoupled": {"tokens_to_target": None, "bytes_per_token": per, "throughput": {2.0: 5.0}},
        "compute_tokens_s": 20.0,
    }
    rows = {r["method"]: r for r in bench.rows_from(m, (2.0,))}
    assert rows["dp"]["time_to_target_s"] == 100.0 and rows["dp"]["speedup_vs_dp"] == 1.0
    assert rows["sync"]["speedup_vs_dp"] == pytest.approx(5.0)
    assert rows["sync"]["speedup_vs_dp_line_rate"] == pytest.approx(2.5)
    assert rows["decoupled"]["throughput_vs_dp"] == pytest.approx(5.0)
    assert rows["sync"]["bytes_up"] == 400.0 and rows["sync"]["goodput"] == 0.5
    assert rows["decoupled"]["time_to_target_s"] is None
    assert set(bench.rows_from(m, (2.0,))[0]) >= {
        "method", "gbps", "time_to_target_s", "speedup_vs_dp", "bytes_up", "bytes_down"
    }  # fmt: skip


def test_a_direct_measurement_replaces_the_composed_time_to_target() -> None:
    """Decoupled measured on shaped links from the start: its time to target is that run's
    (not tokens to target / throughput), its bytes those the links carried until then."""
    per = {"up": 2.0, "down": 3.0}
    dp = {"bytes_per_token": per, "throughput": {2.0: 1.0}, "line_throughput": {2.0: 2.0}}
    direct = {
        "time_to_target_s": 40.0,
        "tokens_per_s": 8.0,
        "tokens_trained": 320,
        "wire": {"up": 11.0, "down": 22.0},
    }
    m = {
        "dp": {**dp, "tokens_to_target": 100.0},
        "sync": {"tokens_to_target": 200.0, "bytes_per_token": per, "throughput": {2.0: 10.0}},
        "decoupled": {
            "tokens_to_target": 50.0,  # composed: 50 / 5 = 10 s, which the direct run refutes
            "bytes_per_token": per,
            "throughput": {2.0: 5.0},
            "direct": {2.0: direct},
        },
        "compute_tokens_s": 20.0,
    }
    row = {r["method"]: r for r in bench.rows_from(m, (2.0,))}["decoupled"]
    assert row["time_to_target_s"] == 40.0 and row["measured"] == "direct"
    assert row["speedup_vs_dp"] == pytest.approx(100.0 / 40.0)  # DP: 100 tokens at 1 token/s
    assert (row["bytes_up"], row["bytes_down"], row["goodput"]) == (11.0, 22.0, 0.4)


def test_run_names_are_valid_experiment_names() -> None:
    from training.config.names import validate_name

    for g in (2.0, 2.5, 10.0):
        validate_name("experiment", bench.run_name("decoupled", g))


def test_decoupled_overrides_reach_only_decoupled_runs() -> None:
    from training.bench.wan.runner import experiment_config

    sets = (("fragments.count", 4), ("fragments.strategy", "tensors"), ("inner.tau", 3))
    p = params.BenchParams(decoupled_set=sets)
    dec = experiment_config(p, "decoupled", "wan-dec")
    sync = experiment_config(p, "sync", "wan-sync")
    assert (dec.fragments.count, dec.inner.tau) == (4, 3)
    assert (sync.fragments.count, sync.inner.tau) == (1, 1)


def test_decoupled_without_overrides_runs_the_defaults_and_sync_one_fragment() -> None:
    # "with no overrides" (issue 26) means the config's defaults, not the bench's own P
    from training.bench.wan.runner import experiment_config
    from training.config.sections import FragmentConfig, OuterConfig

    dec = experiment_config(params.BenchParams(), "decoupled", "wan-dec")
    assert dec.fragments == FragmentConfig()
    assert dec.outer.quorum == OuterConfig().quorum
    assert experiment_config(params.BenchParams(), "sync", "wan-sync").fragments.count == 1


# -- the 12B figure -----------------------------------------------------------------------------


def test_12b_preset_numbers() -> None:
    nums = model12b.model_numbers("12b")
    assert nums["params"] == 12_232_688_640
    # 6 N' + 12 L d T with N' = N minus the position table
    assert nums["flops_per_token"] == 6 * (nums["params"] - 4096 * 5120) + 12 * 38 * 5120 * 4096


def test_gemma_12b_numbers_have_no_position_table() -> None:
    nums = model12b.model_numbers("gemma-12b")
    assert nums["params"] == 11_614_038_528  # tests/test_model.py derives it
    assert nums["flops_per_token"] == 6 * nums["params"] + 12 * 38 * 5120 * 4096  # rotary


def test_step_time_halves_with_twice_the_chips() -> None:
    a = Assumptions()
    assert model12b.step_time(replace(a, chips_per_island=2 * a.chips_per_island)) == (
        pytest.approx(model12b.step_time(a) / 2)
    )


def test_dp_ratio_is_bf16_ring_allreduce_over_link_over_step() -> None:
    a = Assumptions(regions=2)
    expected = 2 * model12b.model_numbers("12b")["params"] * 8 / 2e9 / model12b.step_time(a)
    assert model12b.comm_ratio(a, 2.0) == pytest.approx(expected)
    assert model12b.comm_ratio(a, 4.0) == pytest.approx(expected / 2)


def test_decoupled_with_overlap_runs_at_compute_speed_when_the_link_suffices() -> None:
    a = Assumptions(merge_bytes_per_s=1e12)
    f = model12b.figure(a, 5.0, overlap=True)
    assert f["decoupled_step_s"] == pytest.approx(f["step_s"])
    assert f["island_gbps_up"] < 5.0
    assert f["speedup_vs_dp"] == pytest.approx(f["dp_step_s"] / f["step_s"])
    assert f["speedup_vs_sync"] > 1.0


def test_a_slow_merge_needs_more_syncer_shards() -> None:
    fast = model12b.figure(Assumptions(merge_bytes_per_s=1e12), 2.0)
    slow = model12b.figure(Assumptions(merge_bytes_per_s=1e8), 2.0)
    assert fast["syncer_shards"] == 1 and slow["syncer_shards"] > 1


def test_merge_throughput_read_from_the_merge_bench_json(tmp_path) -> None:
    path = tmp_path / "merge.json"
    rows = [
        {"preset": "tiny", "fragments": 1, "seconds": 1.0, "bytes_moved": 1e9},
        {"preset": "small", "fragments": 4, "seconds": 2.0, "bytes_moved": 6e9},
        {"preset": "small", "fragments": 4, "seconds": 2.0, "bytes_moved": 2e9},
    ]
    path.write_text(json.dumps({"rows": rows}))
    rate, source = model12b.merge_throughput_from(path)
    assert rate == pytest.approx(2e9) and "small" in source


@pytest.mark.parametrize("text", ["{}", "not json", '{"rows": [{"seconds": 0}]}'])
def test_a_merge_json_without_usable_rows_is_an_error(tmp_path, text: str) -> None:
    path = tmp_path / "merge.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        model12b.merge_throughput_from(path)


def test_bench_wan_model_12b_cli_writes_the_figure(tmp_path) -> None:
    merge = tmp_path / "merge.json"
    merge.write_text(json.dumps({"rows": [{"preset": "1b", "seconds": 1.0, "bytes_moved": 4e9}]}))
    out = tmp_path / "fig.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "training.cli", "bench", "wan", "--model-12b"]
        + ["--merge-json", str(merge), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())
    assert rep["assumptions"]["merge_bytes_per_s"] == 4e9
    assert [r["gbps"] for r in rep["rows"] if r["overlap"]] == [2.0, 3.0, 5.0]


def test_merge_timeline_summarises_the_mergers_records(tmp_path) -> None:
    # two passes, three contributions: publish-to-merge 0.5, 1.0 and 2.0 s; staleness 0, 1, 2
    def c(pub, merged, st):
        return {"published_at": pub, "merged_at": merged, "staleness": st}

    records = [
        {"contributions": [c(10.0, 10.5, 0)]},
        {"contributions": [c(11.0, 12.0, 1), c(10.0, 12.0, 2)]},
    ]
    path = tmp_path / "merges.json"
    path.write_text(json.dumps(records))
    got = merge_timeline(path)
    assert got == dict(
        passes=2,
        contributions=3,
        lag_p50_s=1.0,
        lag_p95_s=2.0,
        lag_max_s=2.0,
        staleness_mean=1.0,
        staleness_max=2,
    )


def test_merge_timeline_is_none_without_records(tmp_path) -> None:
    assert merge_timeline(tmp_path / "absent.json") is None


def test_direct_table_reports_the_syncer_latency_of_each_direct_run() -> None:
    syncer = dict(passes=60, contributions=86, lag_p50_s=0.7, lag_p95_s=1.4, lag_max_s=1.7,
                  staleness_mean=2.25, staleness_max=6)  # fmt: skip
    summary = {
        "measured": {"decoupled": {"direct": {"2.0": {"final_loss": 2.835, "syncer": syncer}}}}
    }
    row = bench.format_direct(summary).splitlines()[-1]
    assert row == "| Decoupled DiLoCo | 2 | 2.8350 | 60 | 86 | 0.70 / 1.40 | 2.2 / 6 |"


def test_12b_downloads_per_round_multiply_the_island_downlink() -> None:
    # quorum 1 with 4 regions: each island reads 4 updates per fragment and round, so its
    # downlink is 4x the one-merged-update figure; the synchronous method's is unchanged
    one = model12b.figure(Assumptions(), 2.0)
    four = model12b.figure(replace(Assumptions(), downloads_per_round=4), 2.0)
    assert four["island_gbps_down"] == pytest.approx(4 * one["island_gbps_down"])
    assert four["sync_step_s"] == pytest.approx(one["sync_step_s"])


def test_plot_writes_a_png_also_when_a_method_misses_the_target(tmp_path):
    rows = [
        dict(method=m, gbps=g, speedup_vs_dp=None if m == "decoupled" else 1.0, goodput=0.5)
        for m in bench.METHODS
        for g in (2.0, 5.0)
    ]
    bench.plot({"rows": rows, "params": {}}, str(tmp_path / "w.png"))
    assert (tmp_path / "w.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
