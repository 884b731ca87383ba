"""`diloco bench merge`: a real (tiny) row through the child processes, and the computed rows."""

import json

import pytest

from training import cli
from training.bench import merge as bench
from training.bench import merge_size


def test_bench_merge_measures_a_row_and_derives_the_large_presets(tmp_path, capsys):
    out = tmp_path / "merge.json"
    code = cli.main(["bench", "merge", "--presets", "tiny", "--fragments", "1", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    (measured,) = [r for r in rows if r["measured"]]
    # tiny: 434,816 parameters; params + momentum in fp32 = 8 bytes each
    assert measured["fragment_bytes"] == 8 * 434_816
    assert measured["seconds"] > 0 and measured["memcpy_seconds"] > 0
    assert measured["warm_seconds"] > 0  # the same merger's next merge
    computed = {(r["preset"], r["fragments"]) for r in rows if not r["measured"]}
    assert computed == {("1b", 1), ("12b", 1)}
    assert "x memcpy" in capsys.readouterr().out


def test_computed_rows_scale_with_the_reference_throughput():
    ref = dict(preset="small", fragments=1, bytes_moved=1_000, seconds=1.0, peak_vs_fragment=2.0)
    rows = bench.computed_rows([ref], [24], M=4, codec="int8")
    twelve = next(r for r in rows if r["preset"] == "12b")
    # 12b at P = 24: elems = total / 24; moved = 4 x (1 + 4/256) x elems + 2 x 8 x elems bytes
    elems = twelve["fragment_bytes"] / 8
    assert abs(twelve["bytes_moved"] - (4 * (1 + 4 / 256) + 16) * elems) < 2
    assert twelve["seconds"] == twelve["bytes_moved"] / 1_000
    assert twelve["fits_16gb"] == (twelve["peak_rss_bytes"] < 16 * 2**30)


def test_bench_merge_at_size_measures_cold_warm_and_promoted_merges(tmp_path, capsys):
    # the tiny preset's largest fragment at P = 2, K = 1 and 2: each kind measured with its
    # stages (the warm merge reads no state: its `state` stage is ~0), the warm rows with floors
    out = tmp_path / "size.json"
    assert (
        bench.main(
            [
                "--at-size",
                "tiny:2",
                "--ks",
                "1",
                "2",
                "--codec",
                "int4",
                "--repeats",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())
    kinds = [(r["contributions"], r["kind"]) for r in got["rows"]]
    assert kinds == [(k, kind) for k in (1, 2) for kind in ("cold", "warm", "promoted")]
    for r in got["rows"]:
        assert set(r["stages"]) == set(merge_size.STAGE_ORDER), r["kind"]
        assert (r["floor_s"] is not None) == (r["kind"] == "warm")
    # the paper's round (24 x 1.85 s = 44.4 s) holds tiny merges many times over: one shard
    assert [s["shards"] for s in got["sizing"]] == [1, 1]
    assert "| 2 | floor |" in capsys.readouterr().out


def test_bench_merge_at_size_refuses_a_bad_size():
    with pytest.raises(SystemExit):
        bench.main(["--at-size", "tiny:x"])
