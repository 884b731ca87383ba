"""The per-merge trace (training/bench/trace.py) reads what a merge did from the store."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from training.bench import science
from training.bench.trace import MergeTracer, format_trace, merges
from training.store.experiment import ExperimentStore
from training.store.registry import open_store


@pytest.fixture
def traced():
    store = ExperimentStore(open_store("memory://trace-test"), "e")
    store.write_config({"name": "e", "fragments": {"count": 1}})
    p0 = {"w": np.zeros(9, np.float32)}
    head = store.publish_fragment(0, 0, p0, {"momentum/w": np.zeros(9, np.float32)})
    ref = store.publish_pseudograd(
        "island-1", 0, 0, {"w": np.ones(9, np.float32)}, dict(base_version=0, steps=4, tokens=64)
    )
    tracer = MergeTracer(store, evaluate=lambda params: float(params["w"].sum()), clock=lambda: 7.0)
    tracer.before_merge()
    contributions = [dict(id=ref.id, island="island-1", fragment=0, weight=2.0, norm=3.0,
                          staleness=0, loss=1.5)]  # fmt: skip
    state = {"momentum/w": np.full(9, 2.0, np.float32)}
    store.publish_fragment(
        0, 1, {"w": np.full(9, 1.0, np.float32)}, state, dict(contributions=contributions),
        applied=[ref.id], expected=head,
    )  # fmt: skip
    tracer.event("kill", island="island-0")
    tracer.after_merge([SimpleNamespace(versions={0: 1})], islands_live=["island-1"])
    return tracer.records


def test_a_merge_row_has_the_update_and_momentum_norms(traced):
    row = merges(traced)[0]
    # |ones(9) - zeros(9)| = 3; the momentum tensor is 2 x ones(9): 6
    assert (row["update_norm"], row["momentum_norm"]) == (pytest.approx(3.0), pytest.approx(6.0))


def test_contributions_carry_the_pseudo_gradient_manifest(traced):
    c = merges(traced)[0]["contributions"][0]
    assert (c["island"], c["steps"], c["tokens"], c["weight"]) == ("island-1", 4, 64, 2.0)


def test_evaluated_rows_have_the_eval_loss_and_events_are_in_order(traced):
    assert [r["kind"] for r in traced] == ["kill", "merge"]
    assert merges(traced)[0]["eval_loss"] == 9.0 and "v1" in format_trace(traced)


def test_mixed_hardware_rows_are_the_papers_three():
    rows = science.rows_for("mixed")
    assert [r["label"] for r in rows] == ["K = M (synchronous)", "K = 1, no grace", "K = 1 + grace"]
    speeds = [i["speed"] for i in rows[0]["overrides"]["islands"]]
    assert speeds[0] / speeds[-1] == pytest.approx(1.18) and rows[1]["jitter"] == 0.1
    assert math.isclose(rows[1]["overrides"]["outer.max_grace_s"], 0.0)


def test_compression_rows_cover_every_codec_with_and_without_feedback():
    rows = science.rows_for("compression")
    assert {(r["codec"], r["ef"]) for r in rows} == {
        (c, ef) for c in ("fp32", "bf16", "int8", "int4", "int2") for ef in (True, False)
    }


def test_unknown_finding_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        science.main(["--findings", "mixed,nope"])
    assert exc.value.code == 2 and "unknown findings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "rows, message",
    [("1,x", "--rows takes row indices"), ("3", "have rows 0..2"), ("-1", "have rows 0..2")],
)
def test_bad_rows_are_a_usage_error(capsys, rows, message):
    # the mixed finding has three rows (0, 1, 2): 3 and -1 are outside, x is no index
    with pytest.raises(SystemExit) as exc:
        science.main(["--findings", "mixed", "--rows", rows])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace-out", "x.txt"], "--trace-out needs --trace N"),
        (["--trace", "-1"], "--trace must be >= 0"),
        (["--stop-on", "never"], "invalid choice"),
        (["--stagger-s", "-5"], "--stagger-s must be >= 0"),
    ],
)
def test_chaos_bench_option_errors(argv, message, capsys):
    from training.bench import chaos

    with pytest.raises(SystemExit) as exc:
        chaos.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_light_version_is_traced_with_its_replayed_momentum(tmp_path):
    # the same three merges with full_every 4 (versions 1-3 light: no outer state stored) and
    # 1 (all full): the trace of version 3 reads the light one's momentum by replay, the same
    from training.bench import light

    def momentum_norm(k: int) -> float:
        _, store, _, _ = light._chain("tiny", 1, k, 3, str(tmp_path))
        tracer = MergeTracer(store)
        tracer.after_merge([SimpleNamespace(versions={0: 3})])
        return merges(tracer.records)[0]["momentum_norm"]

    assert momentum_norm(4) == momentum_norm(1) > 0
