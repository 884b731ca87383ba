"""The wait task's progress lines show tokens/s between two lines, not one heartbeat's swinging
rate (issue 24 item 9: 2,520 then 148 tok/s)."""

from __future__ import annotations

from diloco_airflow.triggers import average_rate


def test_the_rate_is_the_average_between_two_progress_lines():
    before = {"time": 100.0, "tokens": 10_000, "tokens_per_s": 2_520.0}
    beat = {"time": 110.0, "tokens": 35_000, "tokens_per_s": 148.0}
    # (35,000 - 10,000) tokens / (110 - 100) s = 2,500 tokens/s
    assert average_rate(before, beat) == 2_500.0


def test_the_first_line_and_a_restarted_island_show_the_heartbeats_rate():
    beat = {"time": 110.0, "tokens": 5_000, "tokens_per_s": 148.0}
    assert average_rate(None, beat) == 148.0
    assert average_rate({"time": 100.0, "tokens": 10_000}, beat) == 148.0  # fewer tokens
