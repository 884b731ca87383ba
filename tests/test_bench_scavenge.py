"""The scavenging benchmark (training/bench/scavenge.py): the DP job model by hand, and the
quick run end to end through the real island/merger harness."""

from __future__ import annotations

import json

import pytest

from training.bench import scavenge as sb


def test_dp_burst_by_hand_join_restart_then_leave_restart():
    # base work 1000 s; window [100, 600); chips arrive at 110 and the job restarts for 5 s,
    # runs at 1.25x until 600, restarts for 5 s: work by 600 = 110 + 1.25 * 485 = 716.25,
    # the rest (283.75 s) after 605 -> 888.75 s
    a = sb.Assumptions(join_s=10.0, recovery_s=5.0)
    out = sb.run_dp(0.25, 1000.0, a, (100.0, 600.0), [1e9], failures=False)
    assert out["end"] == pytest.approx(888.75)
    assert out["uptime"] == pytest.approx((888.75 - 10.0) / 888.75)


def test_dp_with_more_burst_finishes_inside_the_window():
    # 2x from 115: 110 + 2 (t - 115) = 1000 -> t = 560 (before the window closes)
    a = sb.Assumptions(join_s=10.0, recovery_s=5.0)
    out = sb.run_dp(1.0, 1000.0, a, (100.0, 600.0), [1e9] * 4, failures=False)
    assert out["end"] == pytest.approx(560.0)


def test_quick_run_writes_every_row(tmp_path):
    path = tmp_path / "scavenge.json"
    argv = ["--quick", "--bursts", "3.0", "--reclaim-mtbi-h", "24", "--json", str(path)]
    assert sb.main(argv) == 0  # with reclaims (spot capacity taken back inside the window)
    out = json.loads(path.read_text())
    rows = {r["method"]: r for r in out["rows"]}
    assert set(rows) == {"decoupled", "dp", "dp_failures"}
    for r in rows.values():
        assert set(r) >= {"burst", "time_to_target_rel", "paper", "goodput", "uptime"}
    assert rows["decoupled"]["islands"] == 8  # 2 base islands + 6 scavenged
    assert rows["decoupled"]["reclaimed"] == rows["dp"]["reclaimed"] >= 1  # the same draws
    assert rows["dp"]["time_to_target_rel"] < 1.0


def test_slots_of_a_burst():
    assert sb.slots_for(0.25) == (1, 0.5)  # of 2 base islands: one at half speed
    assert sb.slots_for(1.0) == (2, 1.0)
    assert sb.slots_for(3.0) == (6, 1.0)


def test_the_bench_merges_a_slower_burst_island_with_fractional_momentum():
    # its lone, out-of-phase merges re-applied the whole momentum: +25% was 1.21x the base time
    assert sb.bench_config(True, sb.Assumptions(), 0.25, 3).outer.fractional_momentum


def test_plot_writes_a_png_of_every_method(tmp_path):
    rows = [
        dict(method=m, burst=b, time_to_target_rel=0.9, paper=0.8)
        for m in ("decoupled", "dp", "dp_failures")
        for b in (0.25, 3.0)
    ]
    sb.plot({"rows": rows}, str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
