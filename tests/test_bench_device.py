"""The device check (devtools/device_check.sh, training/bench/device.py, device_check.py): its CPU
path end to end, the gpu plan's commands, the JSON's arithmetic, and the FLOPs per token."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.bench import device, device_check
from training.bench import island as bench_island
from training.bench import merge as bench_merge
from training.bench import quality as bench_quality
from training.config.experiment import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "devtools" / "device_check.sh"
ROW_KEYS = (
    "preset",
    "fragments",
    "compute_dtype",
    "island_tokens_per_s",
    "bare_tokens_per_s",
    "overhead",
    "mfu",
    "device",
)


def _script(out: Path, *, budget: int | None = None, only: str | None = None):
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    env.pop("DEVICE_CHECK_WHEELS", None)
    if budget is not None:
        env["DEVICE_CHECK_BUDGET_S"] = str(budget)
    if only is not None:
        env["DEVICE_CHECK_ONLY"] = only
    return subprocess.run(
        ["bash", str(SCRIPT), "--cpu", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=500,
    )


def test_flops_per_token_by_hand():
    # gemma-tiny: d 128, 2 layers, 4 heads (head_dim 32), 2 kv heads, d_ff 384, vocab 256.
    # per layer: q + out 2*128*128 = 32768, k + v 2*128*2*32 = 16384, gate + up + down
    # 3*128*384 = 147456, two norms 256, q/k-norm 64: 196928; 2 layers + final norm 128 =
    # 393984 non-embedding; + the head 256*128 = 32768 -> 426752 x 6 = 2560512;
    # attention 12 * 2 layers * 64 tokens * 128 = 196608
    assert device_check.flops_per_token(ModelConfig(preset="gemma-tiny"), 64) == 2560512 + 196608
    # gpt tiny: per layer 4*128*128 + 2*128*512 + 256 = 196864; 2 layers + 128 = 393856, the
    # position table (64*128) is an embedding; + head 32768 -> 426624 x 6 = 2559744
    assert device_check.flops_per_token(ModelConfig(preset="tiny"), 64) == 2559744 + 196608


def test_cpu_path_writes_every_required_key_with_sane_values(tmp_path):
    done = _script(tmp_path / "out")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert out["ok"] and out["profile"] == "cpu" and out["device"].startswith("cpu")
    assert [p["status"] for p in out["parts"]] == ["ok"] * 5
    rates = out["rates"]
    assert all(rates[k] > 0 for k in rates)
    assert {e["codec"] for e in out["encode"]} == {"int8", "int4"}
    assert all(e["encode_bytes_per_s"] > 0 and e["vs_copy"] > 0 for e in out["encode"])
    assert {(r["fragments"], r["compute_dtype"]) for r in out["rows"]} == {
        (1, "bfloat16"),
        (2, "bfloat16"),
    }
    for row in out["rows"]:
        assert all(row[k] is not None for k in ROW_KEYS)
        assert row["island_tokens_per_s"] > 0 and row["bare_tokens_per_s"] > 0
        assert math.isfinite(row["overhead"]) and 0 < row["mfu"] < 1
        assert row["device"].startswith("cpu")
    assert any(r["measured"] and r["seconds"] > 0 for r in out["merge"])
    methods = out["quality"]["methods"]
    assert set(methods) == {"dp", "decoupled"}
    assert all(math.isfinite(m["eval_loss"]) for m in methods.values())
    log = (tmp_path / "out" / "device_check.log").read_text()
    assert "quality-pair: ok" in log and "done in" in log


def test_a_part_without_time_left_is_recorded_as_skipped(tmp_path):
    # a 5 s budget leaves under the 10 s a part needs after the preflight: rates is skipped
    done = _script(tmp_path / "out", budget=5, only="rates")
    assert done.returncode == 1
    out = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert [(p["name"], p["status"]) for p in out["parts"]] == [
        ("preflight", "ok"),
        ("rates", "skipped"),
    ]
    assert not out["ok"] and out["rows"] == [] and out["rates"]["copy_bytes_per_s"] is None


def _bench_row(**kw) -> dict:
    row = dict(
        preset="gemma-tiny",
        fragments=1,
        H=2,
        compute_dtype="bfloat16",
        seq_len=64,
        batch_size=4,
        device="gpu: X",
        every_rounds=1,
        repeats=1,
        bare_step_s=0.5,
        island_step_s=0.625,
        overhead=0.25,
    )
    return {**row, **kw}


def test_assemble_computes_tokens_per_s_and_mfu_from_the_parts(tmp_path):
    (tmp_path / "rates.json").write_text(
        json.dumps({"device": "gpu: X", "matmul_bfloat16": {"flops_per_s": 1e12}})
    )
    rows = [_bench_row(), dict(preset="1b", fragments=1, computed=True)]
    (tmp_path / "island-a.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "parts.jsonl").write_text(
        '{"name": "rates", "status": "ok"}\n{"name": "island-a", "status": "timed_out"}\n'
    )
    out = device_check.assemble(tmp_path, "gpu", 480)
    (row,) = out["rows"]  # the computed row is not a measurement
    assert row["island_tokens_per_s"] == 256 / 0.625 and row["bare_tokens_per_s"] == 256 / 0.5
    fpt = device_check.flops_per_token(ModelConfig(preset="gemma-tiny"), 64)
    assert row["mfu"] == pytest.approx(fpt * 256 / 0.625 / 1e12)
    assert not out["ok"]  # a part timed out


def _parse_only(monkeypatch):
    """Every bench's expensive function replaced by one that builds the config it was given."""
    seen = []

    def island_measure(preset, P, H, repeats, every_rounds, dtype, seq_len, batch, gc_keep, source):
        cfg = bench_island._cfg(preset, P, H, every_rounds, dtype, seq_len, batch)
        assert seq_len <= cfg.model.dims()["max_seq_len"]
        seen.append(("island", preset, P, dtype))
        return _bench_row(overhead_spread=[0.0, 0.0], cpu_ratio=0.0)

    def merge_row(preset, P, M, codec):
        bench_merge._cfg(preset, P, M, codec)
        seen.append(("merge", preset, P))
        times = dict(seconds=1.0, vs_memcpy=1.0, warm_seconds=1.0, warm_vs_memcpy=1.0)
        return dict(measured=True, peak_vs_fragment=1.0, **times)

    def quality_run(size, data, methods, token_budget, overrides, **kw):
        bench_quality.base_config(size, data, token_budget, overrides)
        seen.append(("quality", methods, overrides["model.preset"]))
        raise SystemExit(0)

    monkeypatch.setattr(bench_island, "measure", island_measure)
    monkeypatch.setattr(bench_merge, "run_row", merge_row)
    monkeypatch.setattr(bench_merge, "computed_rows", lambda *a: [])
    monkeypatch.setattr(bench_merge, "codec_rows", lambda *a: [])
    monkeypatch.setattr(bench_merge, "format_table", lambda rows: "")
    monkeypatch.setattr(bench_quality, "run", quality_run)
    monkeypatch.setattr(device, "rates", lambda args: seen.append(("rates", args.matmul)) or 0)
    return seen


def test_the_gpu_plan_parses_and_builds_every_config(tmp_path, monkeypatch):
    from training import cli

    seen = _parse_only(monkeypatch)
    for part in device_check.plan("gpu", str(tmp_path)):
        try:
            assert cli.main(list(part.argv)) == 0, part.name
        except SystemExit as stop:  # quality_run's way out
            assert stop.code == 0, part.name
    assert ("island", "gemma-1b", 24, "bfloat16") in seen
    assert ("island", "gemma-125m", 24, "float32") in seen
    assert ("merge", "1b", 1) in seen and ("rates", 8192) in seen
    assert ("quality", ("decoupled",), "gemma-125m") in seen


def test_bench_merge_writes_its_json_after_every_row(tmp_path, monkeypatch):
    out = tmp_path / "merge.json"
    rows = iter([dict(preset="tiny", fragments=1, measured=True, seconds=1.0, vs_memcpy=1.0,
                      warm_seconds=1.0, warm_vs_memcpy=1.0, peak_vs_fragment=1.0)])  # fmt: skip

    def run_row(preset, P, M, codec):
        row = next(rows, None)
        if row is None:  # the second row: the part's timeout, say
            raise KeyboardInterrupt
        return row

    monkeypatch.setattr(bench_merge, "run_row", run_row)
    with pytest.raises(KeyboardInterrupt):
        bench_merge.main(["--presets", "tiny", "--fragments", "1", "2", "--json", str(out)])
    assert [r["fragments"] for r in json.loads(out.read_text())["rows"]] == [1]
