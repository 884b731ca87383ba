"""Tests for the goodput simulator (training/bench/goodput_model.py, goodput_methods.py,
goodput_sim.py). Fast: the whole file < 20 s."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from training.bench import goodput_sim
from training.bench.goodput_methods import (
    calibrate,
    goodput_from_failures,
    run_table,
    simulate,
    uptime_from_failures,
)
from training.bench.goodput_model import (
    CALIBRATED_RECOVERY_S,
    CHIPS,
    METHODS,
    PAPER_TABLE,
    SimAssumptions,
)
from training.bench.goodput_sim import format_table


@pytest.fixture(scope="module")
def table() -> list[dict]:
    return run_table()


def _g(rows: list[dict], method: str, chips: int) -> float:
    (g,) = [r["goodput"] for r in rows if r["method"] == method and r["chips"] == chips]
    return g


def test_default_table_is_fast() -> None:
    t0 = time.perf_counter()
    run_table()  # goodput and system uptime of every cell
    assert time.perf_counter() - t0 < 10.0


def test_goodput_falls_with_scale_for_every_method(table: list[dict]) -> None:
    for m in METHODS:
        gs_ = [_g(table, m, c) for c in CHIPS]
        assert all(x > y for x, y in zip(gs_, gs_[1:], strict=False)), (m, gs_)
        assert all(0.0 < x < 1.0 for x in gs_)


def test_ordering_at_1_2m_chips(table: list[dict]) -> None:
    gs_ = [_g(table, m, 1_200_000) for m in METHODS]
    assert gs_ == sorted(gs_) and len(set(gs_)) == len(gs_), dict(zip(METHODS, gs_, strict=True))


def test_no_failures_means_full_goodput() -> None:
    a = SimAssumptions(mtbi_chip_years=1e12)
    for m in METHODS:
        for c in (150_000, 2_400_000):
            assert simulate(m, c, a) == pytest.approx(1.0, abs=1e-9)


def test_hand_derived_single_failure() -> None:
    # 1000 chips in 4 slices of 250, horizon 1000 s, one failure of slice 0 at t = 100 s,
    # recovery 50 s, re-shape 10 s.
    a = SimAssumptions(slice_chips=250, recovery_s=50.0, reshape_s=10.0)
    one = ([100.0], [0], a, 1000.0)
    # DP: every chip idle on [100, 150): 950 of 1000 s productive -> 0.95
    assert goodput_from_failures("dp", 1000, *one) == pytest.approx(0.95)
    # elastic DP: 4 slices on [0, 100) = 400; stall [100, 110); 3 slices on [110, 150) = 120;
    # slice 0 back at 150, re-admit stall [150, 160); 4 slices on [160, 1000) = 3360.
    # (400 + 120 + 3360) / 4000 = 0.97
    assert goodput_from_failures("elastic_dp", 1000, *one) == pytest.approx(0.97)
    # Decoupled M=2, elastic islands: island 0 = slices {0, 2}: 2 on [0, 100) = 200, 1 on
    # [110, 150) = 40, 2 on [160, 1000) = 1680; island 1 untouched: 2000. 3920 / 4000 = 0.98
    assert goodput_from_failures("decoupled_m2", 1000, *one) == pytest.approx(0.98)
    # Decoupled M=2, islands restart: island 0 (500 chips) idle on [100, 150):
    # (500 * 950 + 500 * 1000) / (1000 * 1000) = 0.975
    b = replace(a, island_recovery="restart")
    assert goodput_from_failures("decoupled_m2", 1000, [100.0], [0], b, 1000.0) == pytest.approx(
        0.975
    )
    # ... with quorum K = 2 the healthy island is blocked on [100, 150) too -> 0.95, like DP
    k2 = replace(b, quorum_k=2)
    assert goodput_from_failures("decoupled_m2", 1000, [100.0], [0], k2, 1000.0) == pytest.approx(
        0.95
    )


def test_hand_derived_uptime_of_a_single_failure() -> None:
    """System uptime (the fraction of time some step advances), the same failure as above."""
    a = SimAssumptions(slice_chips=250, recovery_s=50.0, reshape_s=10.0)
    one = ([100.0], [0], a, 1000.0)
    # DP stops on [100, 150): 0.95; elastic DP stalls [100, 110) and [150, 160): 0.98
    assert uptime_from_failures("dp", 1000, *one) == pytest.approx(0.95)
    assert uptime_from_failures("elastic_dp", 1000, *one) == pytest.approx(0.98)
    # Decoupled, K = 1: island 1 trains throughout -> 1.0, even when island 0 restarts
    b = replace(a, island_recovery="restart")
    assert uptime_from_failures("decoupled_m2", 1000, [100.0], [0], b, 1000.0) == 1.0
    # ... K = 2: nothing advances while island 0 is down -> 0.95
    k2 = replace(b, quorum_k=2)
    assert uptime_from_failures("decoupled_m2", 1000, [100.0], [0], k2, 1000.0) == (
        pytest.approx(0.95)
    )


def test_hand_derived_overlaps() -> None:
    a = SimAssumptions(slice_chips=250, recovery_s=50.0, reshape_s=10.0)
    two = ([100.0, 120.0], [0, 1], a, 1000.0)
    # DP, absorb: the second failure falls inside [100, 150) and is fixed in the same restart.
    assert goodput_from_failures("dp", 1000, *two) == pytest.approx(0.95)
    # DP, extend: down [100, 170) -> 0.93
    ext = replace(a, overlap="extend")
    assert goodput_from_failures("dp", 1000, [100.0, 120.0], [0, 1], ext, 1000.0) == (
        pytest.approx(0.93)
    )
    # elastic DP, readmit at once: 4 on [0,100)=400; stall [100,110); 3 on [110,120)=30;
    # stall [120,130); 2 on [130,150)=40; back (slice 0) stall [150,160); 3 on [160,170)=30;
    # back (slice 1) stall [170,180); 4 on [180,1000)=3280. 3780/4000 = 0.945
    assert goodput_from_failures("elastic_dp", 1000, *two) == pytest.approx(0.945)
    # ... readmit_wait_s = 30: slice 0 back at 150 waits until 180 (or a failure), but slice 1
    # back at 170 joins it: one stall [180,190). 400 + 30 + 2 on [130,180)=100 + 4 on
    # [190,1000)=3240 -> 3770 / 4000 = 0.9425 (waiting costs here: no failure to share with)
    w = replace(a, readmit_wait_s=30.0)
    assert goodput_from_failures(
        "elastic_dp", 1000, [100.0, 120.0], [0, 1], w, 1000.0
    ) == pytest.approx(0.9425)
    # a failure of an already-down slice changes nothing
    assert goodput_from_failures(
        "elastic_dp", 1000, [100.0, 120.0], [0, 0], a, 1000.0
    ) == pytest.approx(0.97)


def test_all_islands_down_means_zero_productive() -> None:
    # 2 islands of one slice each; both fail at 100 s: nothing is productive on [100, 150)
    a = SimAssumptions(slice_chips=500, recovery_s=50.0, reshape_s=10.0)
    g = goodput_from_failures("decoupled_m2", 1000, [100.0, 100.5], [0, 1], a, 1000.0)
    # island 0: [0,100) + idle until back at 150, re-shape to 160, [160,1000) -> 940 s;
    # island 1: [0,100.5) + [160.5,1000) -> 940 s. (940 + 940) / 2000 = 0.94
    assert g == pytest.approx(0.94)


def test_json_rows_and_methods(tmp_path, capsys) -> None:
    out = tmp_path / "goodput.json"
    png = tmp_path / "goodput.png"
    assert goodput_sim.main(["--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(out.read_text())
    assert all(set(r) == {"method", "chips", "goodput", "uptime"} for r in rows)
    assert sorted({r["method"] for r in rows}) == sorted(METHODS)
    assert sorted({r["chips"] for r in rows}) == list(CHIPS)
    assert len(rows) == len(METHODS) * len(CHIPS)
    text = capsys.readouterr().out
    assert "calibrated" in text and "| DP |" in text


def test_deterministic_for_a_seed() -> None:
    a = SimAssumptions(target_failures=3000)
    assert run_table(a=a) == run_table(a=a)
    assert simulate("elastic_dp", 600_000, a) != simulate("elastic_dp", 600_000, replace(a, seed=1))


def test_format_table_and_paper_table(table: list[dict]) -> None:
    assert set(PAPER_TABLE) == set(METHODS)
    assert all(sorted(PAPER_TABLE[m]) == list(CHIPS) for m in METHODS)
    text = format_table(table)
    assert text.count("\n") == 1 + len(METHODS)
    assert "| 150k | 300k | 600k | 1.2M | 2.4M |" in text
    assert "(72)" in text and "(86)" in text


def test_calibration_recovers_the_default_recovery_time() -> None:
    # the default recovery_s is the least-squares fit on the paper's DP column; the fit is the
    # same up to sampling noise with a shorter horizon
    r, rms = calibrate("recovery_s", "dp", SimAssumptions(target_failures=5000))
    assert abs(r - CALIBRATED_RECOVERY_S) < 3.0
    assert rms < 3.0


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        simulate("decoupled", 150_000)
    with pytest.raises(ValueError):
        SimAssumptions(overlap="nope")
    with pytest.raises(ValueError):
        simulate("decoupled_m4", 512, SimAssumptions(slice_chips=256))
