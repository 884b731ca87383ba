"""Artifacts for people: `diloco list`, `history`, `eval` (read-only unless --record), `report`,
`--help` on every subcommand, ISO times beside the epoch ones."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.helpers import new_store, publish_delta, random_delta, small_config
from training import cli
from training.merge.merger import Merger
from training.store.layout import iso


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """A file:// store with `exp` (one merge of island a, one eval record) and `other`."""
    url = f"file://{tmp_path_factory.mktemp('store')}"
    cfg = small_config("exp", outer={"method": "nesterov"})
    estore = new_store(cfg, url)
    theta = estore.load_params()
    publish_delta(estore, cfg, "a", 0, random_delta(theta, 0))
    Merger(cfg, estore).merge_all()
    estore.append_metric(
        "eval", dict(version=1, versions=[1], loss=3.5, tokens_merged=512, at=1.8e9)
    )
    estore.write_heartbeat("a", dict(step=4, tokens=512, loss=3.9))
    new_store(small_config("other"), url)
    return url, estore


def test_list_names_every_experiment(merged, capsys):
    code, out, _ = _run(capsys, "list", "--store", merged[0], "--json")
    assert code == 0 and [r["experiment"] for r in json.loads(out)] == ["exp", "other"]


def test_list_prints_versions_and_tokens(merged, capsys):
    code, out, _ = _run(capsys, "list", "--store", merged[0])
    line = next(x for x in out.splitlines() if x.startswith("exp "))
    assert code == 0 and re.search(r"\b1\s+512 / 1,000,000,000\s+0/2\b", line)


def test_history_lists_versions_with_time_applied_and_eval(merged, capsys):
    code, out, _ = _run(capsys, "history", "--store", merged[0], "--experiment", "exp", "--json")
    rows = json.loads(out)["fragments"]["0"]
    assert code == 0
    assert [(r["version"], r["applied"], r["eval_loss"], r["islands"]) for r in rows] == [
        (0, 0, None, []),
        (1, 1, 3.5, ["a"]),
    ]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r["at_iso"]) for r in rows)


def test_history_text_has_a_line_per_version(merged, capsys):
    _, out, _ = _run(capsys, "history", "--store", merged[0], "--experiment", "exp")
    assert re.search(r"^\s+1  \S+Z\s+1\s+512\s+3\.5000  a$", out, re.M)


def test_eval_is_read_only_without_record(merged, capsys):
    url, estore = merged
    before = (len(estore.read_metrics("eval")), len(estore.snapshots()), estore.best())
    code, out, _ = _run(capsys, "eval", "--store", url, "--experiment", "exp")
    assert code == 0 and json.loads(out)["versions"] == [1]
    assert (len(estore.read_metrics("eval")), len(estore.snapshots()), estore.best()) == before


def test_report_writes_pngs_and_one_self_contained_html(merged, tmp_path, capsys):
    code, _, _ = _run(
        capsys, "report", "--store", merged[0], "--experiment", "exp", "--out", str(tmp_path)
    )
    page = (tmp_path / "report.html").read_text()
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "loss_vs_time.png",
        "loss_vs_tokens.png",
        "report.html",
    ]
    assert page.count('src="data:image/png;base64,') == 2 and not re.search(
        r'(src|href)="http', page
    )


def test_report_falls_back_to_svg_without_matplotlib(merged, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, _ = _run(
        capsys, "report", "--store", merged[0], "--experiment", "exp", "--out", str(tmp_path)
    )
    assert code == 0 and sorted(p.suffix for p in tmp_path.iterdir()) == [".html", ".svg", ".svg"]


SUBCOMMANDS = ["init", "island", "merge", "eval", "status", "stop", "list", "history", "report"]
BENCHES = ["quality", "goodput-sim", "chaos", "merge", "wan", "science"]


@pytest.mark.parametrize(
    "argv", [[c] for c in SUBCOMMANDS] + [["bench", b] for b in BENCHES], ids=" ".join
)
def test_help_on_every_subcommand_is_its_own(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith(f"usage: diloco {' '.join(argv)}")


def test_records_carry_iso_times_beside_epoch_ones(merged):
    _, estore = merged
    estore.request_stop("b")
    stop = json.loads(estore.store.read("exp/control/stop/b"))
    beat = estore.heartbeats()["a"]
    merge = estore.read_metrics("merge")[0]
    assert [r["at_iso"] for r in (stop, beat, merge)] == [iso(r["at"]) for r in (stop, beat, merge)]


# -- delete, export into a used directory (issue 38) ------------------------------------------


def _one_merge(url: str, name: str):
    cfg = small_config(name, outer={"method": "nesterov"})
    estore = new_store(cfg, url)
    publish_delta(estore, cfg, "a", 0, random_delta(estore.load_params(), 0))
    Merger(cfg, estore).merge_all()
    return estore


def test_delete_is_refused_while_an_island_runs_and_then_removes_everything(tmp_path, capsys):
    url = f"file://{tmp_path}/store"
    estore = _one_merge(url, "gone")
    estore.write_heartbeat("a", dict(step=4, tokens=512))  # now: island a is alive
    argv = ("delete", "--store", url, "--experiment", "gone", "--yes")
    code, _, err = _run(capsys, *argv)
    assert code == 2 and "islands ['a'] are running" in err and estore.list_keys("")
    estore.mark_done("a", {})
    code, out, _ = _run(capsys, *argv)
    assert code == 0 and out.startswith("deleted gone: ") and estore.list_keys("") == []


def test_delete_without_yes_off_a_terminal_is_refused(tmp_path, capsys, monkeypatch):
    url = f"file://{tmp_path}/store"
    estore = _one_merge(url, "kept")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    code, _, err = _run(capsys, "delete", "--store", url, "--experiment", "kept")
    assert code == 2 and "pass --yes" in err and estore.list_keys("")


def test_export_refuses_a_used_directory_unless_overwrite_and_records_what_it_holds(
    tmp_path, capsys
):
    url = f"file://{tmp_path}/store"
    _one_merge(url, "ex")
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("another model's")
    argv = ("export", "--store", url, "--experiment", "ex", "--out", str(out))
    code, _, err = _run(capsys, *argv)
    assert code == 2 and "exists and is not empty" in err
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]  # untouched
    code, _, _ = _run(capsys, *argv, "--overwrite")
    assert code == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "export.json", "model.safetensors"]  # replaced whole
    record = json.loads((out / "export.json").read_text())
    assert (record["experiment"], record["snapshot"], record["versions"]) == ("ex", "head", [1])
    assert record["tokens_merged"] == 512 and record["tokenizer"]["kind"] == "byte"


def test_the_untrained_model_is_never_best_and_sample_says_it_is_untrained(tmp_path, capsys):
    from training.model.evaluate import evaluate_current

    url = f"file://{tmp_path}/store"
    cfg = small_config("fresh", outer={"method": "nesterov"})  # each contribution merged
    estore = new_store(cfg, url)
    assert evaluate_current(cfg, estore)["best"] is False and estore.best() is None
    argv = ("sample", "--store", url, "--experiment", "fresh", "--prompt", "The")
    code, out, err = _run(capsys, *argv, "--max-tokens", "4")
    assert code == 0 and out.startswith("The")
    assert "merged no training yet: this samples the untrained (random) model" in err
    publish_delta(estore, cfg, "a", 0, random_delta(estore.load_params(), 0))
    Merger(cfg, estore).merge_all()
    assert evaluate_current(cfg, estore)["best"] is True and estore.best()["versions"] == [1]
    code, out, err = _run(capsys, *argv, "--max-tokens", "4")
    assert code == 0 and "untrained" not in err
