"""`diloco bench quality` over seeds on a tiny model and a directory corpus (real JAX on CPU)."""

import json

import pytest

from training import cli

TINY = json.dumps({"preset": "tiny", "d_model": 16, "n_heads": 2, "d_ff": 32, "max_seq_len": 16})


def _argv(corpus, out) -> list[str]:
    return (
        ["bench", "quality", "--data", str(corpus), "--tokens", "3000", "--json", str(out)]
        + ["--set", f"model={TINY}", "--set", "data.seq_len=16", "--set", "data.batch_size=4"]
        + ["--set", "inner.H=2"]
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (root / f"doc{i:02d}.txt").write_text(f"Document {i} is about the island. " * 20)
    return root


@pytest.fixture(scope="module")
def summary(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("bench")
    out = root / "q.json"
    code = cli.main(
        _argv(corpus, out)
        + ["--seeds", "2", "--methods", "dp,decoupled"]
        + ["--trace", "1", "--trace-out", str(root / "trace.txt")]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_first_seed_reruns_that_seed_alone(summary, corpus, tmp_path):
    # --first-seed 1 --seeds 1 is seed 1 of the two-seed run, bit for bit (a seed's runs are
    # deterministic), and the JSON names it: seeds spread over machines can be read together
    out = tmp_path / "q1.json"
    assert cli.main(_argv(corpus, out) + ["--first-seed", "1", "--methods", "dp"]) == 0
    one = json.loads(out.read_text())
    assert one["seeds"] == [1] and one["methods"]["dp"]["seeds"] == [1]
    assert one["methods"]["dp"]["eval_losses"] == [summary["methods"]["dp"]["eval_losses"][1]]


def test_trace_records_every_version_of_each_diloco_run(summary):
    # --trace 1: one merge record per published version, numbered 1, 2, ... per fragment in
    # each seed's run (the default P = 4: every fragment's own versions)
    traces = summary["traces"]
    assert sorted(traces) == ["decoupled"] and len(traces["decoupled"]) == 2
    for records in traces["decoupled"]:
        merges = [r for r in records if r["kind"] == "merge"]
        assert {r["fragment"] for r in merges} == {0, 1, 2, 3}
        for f in range(4):
            versions = [r["version"] for r in merges if r["fragment"] == f]
            assert versions == list(range(1, len(versions) + 1))


def test_json_keeps_its_keys_and_adds_the_seed_statistics(summary):
    row = summary["methods"]["decoupled"]
    kept = {"eval_loss", "tokens", "bytes_sent", "time_to_target"}
    added = {"eval_loss_std", "bytes_received", "seeds"}
    assert kept | added <= row.keys() and summary["seeds"] == [0, 1]


def test_eval_loss_is_the_mean_over_seeds(summary):
    row = summary["methods"]["decoupled"]
    assert row["eval_loss"] == pytest.approx(sum(row["eval_losses"]) / 2)


def test_seeds_give_different_runs(summary):
    a, b = summary["methods"]["dp"]["eval_losses"]
    assert a != b


def test_paired_difference_to_data_parallel_has_an_interval(summary):
    iv = summary["methods"]["decoupled"]["vs_dp_pct"]
    assert iv["n"] == 2 and iv["lo"] < iv["mean"] < iv["hi"]


def test_data_parallel_counts_the_all_reduce_both_ways(summary):
    dp = summary["methods"]["dp"]
    assert dp["bytes_received"] == dp["bytes_sent"] > 0


def test_data_parallel_is_also_compared_at_each_runs_own_final_tokens(summary):
    # DP runs last in each seed and is evaluated at the Decoupled run's final tokens too
    row, dp = summary["methods"]["decoupled"], summary["methods"]["dp"]
    at = row["dp_eval_losses_at_tokens"]
    assert len(at) == 2 and row["vs_dp_at_tokens_pct"]["n"] == 2
    # a 3000-token budget, batch 4 x 16 x 4 islands = 256 tokens a DP step: DP ends at 3072
    assert dp["tokens"] == 3072 and row["tokens"] > dp["tokens"]
    assert at != dp["eval_losses"], "evaluated at the budget, not at the run's own tokens"


def test_data_parallel_past_the_budget_is_the_same_trajectory(corpus):
    # evaluated at 4096 tokens beside a 3000-token budget: the curve to the budget is the
    # plain run's, bit for bit, and the loss at 4096 is the final loss of a 4096-token run
    from training.bench.quality import base_config, method_config
    from training.config.experiment import with_overrides
    from training.model.baseline import run_data_parallel

    overrides = {
        "model": json.loads(TINY),
        "data.seq_len": 16,
        "data.batch_size": 4,
        "inner.H": 2,
    }
    cfg = method_config(base_config("quick", str(corpus), 3000, overrides), "dp")
    plain = run_data_parallel(cfg, eval_dt=2.0)
    longer = run_data_parallel(cfg, eval_dt=2.0, also_at=[4096, 1000])
    whole = run_data_parallel(with_overrides(cfg, {"token_budget": 4096}), eval_dt=1e9)
    assert longer["curve"].losses == plain["curve"].losses
    assert (longer["tokens"], longer["merges"]) == (plain["tokens"], plain["merges"]) == (3072, 12)
    assert longer["bytes_sent"] == plain["bytes_sent"]
    # 1000 tokens: the first step at or past it is step 4 (1024 tokens)
    assert [a[:2] for a in longer["at_tokens"]] == [[1000, 1024], [4096, 4096]]
    assert longer["at_tokens"][1][2] == whole["curve"].losses[-1]


def test_the_table_names_config_differences(summary, capsys):
    from training.bench.quality import format_table

    table = format_table(summary)
    assert "inner.lr 0.002 vs 0.003" in table and "seeds 0-1 (n = 2)" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--first-seed", "-1"], "--first-seed must be >= 0"),
        (["--quick", "--size", "small"], "--quick contradicts"),
        (["--methods", "dp,nope"], "unknown methods"),
    ],
)
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "quality", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
