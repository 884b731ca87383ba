"""report.html reads like a report (issue 24 item 9): no raw JSON, rounded numbers, a proper
summary table, the single-process baseline when one is recorded."""

from __future__ import annotations

from training.views.report import _cell, write_report


def _view() -> dict:
    return {
        "experiment": "e",
        "store": "file:///s",
        "snapshot": {"versions": [8, 9]},
        "tokens": {"merged": 1_000_000, "budget": 2_000_000},
        "best_eval": {"loss": 2.05},
        "merge_count": 3,
        "quarantine_count": 0,
        "goodput": {"goodput": 0.5183},
        "now_iso": "2026-12-03T20:00:00Z",
        "islands": [
            {"island": "a", "goodput": 0.5183, "tokens_per_s": 2519.7, "bytes_up": 3 << 20}
        ],
        "merges": [{"at_iso": "t", "versions": {"0": 8, "1": 9}, "latency_s": 0.8412}],
        "quarantine": [],
        "evals": [],
        "island_losses": {},
    }


def test_cells_are_rounded_and_readable():
    assert _cell({"0": 8, "1": 9}, "versions") == "f0 v8, f1 v9"
    assert _cell(0.5183, "goodput") == "51.8%"
    assert _cell(2519.7, "tokens_per_s") == "2,520"
    assert _cell(3 << 20, "bytes_up") == "3.0 MB"
    assert _cell(0.8412, "latency_s") == "0.84 s"


def test_the_report_has_no_raw_json_and_shows_the_baseline(tmp_path):
    out = write_report(_view(), tmp_path, {"loss": 2.0, "tokens": 1_000_000})
    text = (tmp_path / "report.html").read_text()
    assert out["html"].endswith("report.html")
    assert '{"0":8' not in text and "<th>k</th>" not in text and "0.5183" not in text
    # 2.05 / 2.0 - 1 = +2.50%
    assert "single process, 1,000,000 tokens" in text and "+2.50%" in text
