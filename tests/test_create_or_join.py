"""`diloco init` and the Airflow `init` task are one library call (`create_or_join`, issue 22):
the same checks, the same config.json, the same version 0 and first eval, the same refusals."""

from __future__ import annotations

import pytest
from diloco_airflow import experiment_setup
from diloco_airflow.params import config_from_params

from tests.helpers import small_dag_params
from training import cli
from training.config.experiment import ConfigError
from training.store.experiment import ExperimentStore
from training.store.registry import open_store
from training.usecases.create import create_or_join

NAME = "both"


@pytest.fixture
def airflow_init(monkeypatch):
    """The Airflow task's `init_experiment`, with the experiment registry left out."""
    monkeypatch.setattr(experiment_setup, "register_experiment", lambda *a: None)
    return experiment_setup.init_experiment


def _params(store_url: str, islands, **changes) -> dict:
    """The trigger form of a small experiment (the model and batch of tests/test_join.py)."""
    return small_dag_params(NAME, store_url, islands, **changes)


def _cli_init(capsys, tmp_path, params: dict) -> tuple[int, str, str]:
    """`diloco init` with the config the form `params` gives (as a --config file)."""
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.json"
    path.write_text(config_from_params(params).to_json())
    code = cli.main(["init", "--store", params["store_url"], "--name", NAME, "--config", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def _estore(url: str) -> ExperimentStore:
    return ExperimentStore(open_store(url), NAME)


def _without_url(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "store_url"}


def test_both_create_the_same_experiment_with_its_first_eval(tmp_path, capsys, airflow_init):
    by_cli, by_dag = f"file://{tmp_path}/cli", f"file://{tmp_path}/dag"
    code, out, _ = _cli_init(capsys, tmp_path, _params(by_cli, ["a", "b"]))
    assert code == 0 and "created version 0" in out and "initial eval loss" in out
    airflow_init(_params(by_dag, ["a", "b"]))
    cli_store, dag_store = _estore(by_cli), _estore(by_dag)
    assert _without_url(cli_store.read_config()) == _without_url(dag_store.read_config())
    cli_evals, dag_evals = cli_store.read_metrics("eval"), dag_store.read_metrics("eval")
    # version 0 of each of the default P = 4 fragments
    assert [e["versions"] for e in cli_evals] == [e["versions"] for e in dag_evals] == [[0] * 4]
    assert cli_evals[0]["loss"] == dag_evals[0]["loss"]  # same seed, same version 0
    assert f"{cli_evals[0]['loss']:.4f}" in out


def test_cli_init_refuses_a_budget_under_one_batch_before_writing(tmp_path, capsys):
    url = f"file://{tmp_path}/store"
    code, _, err = _cli_init(capsys, tmp_path, _params(url, ["a", "b"], token_budget=100))
    assert code == 2 and "is less than one batch per island" in err and err.count("\n") == 1
    assert not (tmp_path / "store").exists(), "nothing is created"


def test_cli_init_joins_what_the_dag_created_and_the_dag_joins_what_the_cli_created(
    tmp_path, capsys, airflow_init
):
    url = f"file://{tmp_path}/store"
    airflow_init(_params(url, ["a", "b"]))
    code, out, _ = _cli_init(capsys, tmp_path, _params(url, ["c"]))
    assert code == 0 and "already initialized" in out and "joined islands c" in out
    assert "initial eval" not in out  # version 0 existed: no second first eval
    second = airflow_init(_params(url, ["d"]))
    assert [e["name"] for e in second["local"]] == ["d"]
    estore = _estore(url)
    assert [i["name"] for i in estore.read_config()["islands"]] == ["a", "b", "c", "d"]
    assert len(estore.read_metrics("eval")) == 1


def test_both_refuse_a_join_with_other_settings_with_the_same_line(tmp_path, capsys, airflow_init):
    url = f"file://{tmp_path}/store"
    code, _, _ = _cli_init(capsys, tmp_path, _params(url, ["a", "b"]))
    assert code == 0
    other = _params(url, ["c"], H=8)
    with pytest.raises(ConfigError) as refused:
        airflow_init(other)
    assert "different 'inner'" in str(refused.value)
    code, _, err = _cli_init(capsys, tmp_path, other)
    assert code == 2 and err == f"diloco init: error: {refused.value}\n"


def test_the_result_says_what_was_created_and_joined(tmp_path):
    url = f"file://{tmp_path}/store"
    first = create_or_join(config_from_params(_params(url, ["a", "b"])), _estore(url))
    assert first.created and first.created_version0 and first.initial_loss is not None
    assert first.new_islands == ("a", "b") and first.relaunched == ()
    _estore(url).request_stop(None)
    again = create_or_join(config_from_params(_params(url, ["b", "c"])), _estore(url))
    assert not again.created and not again.created_version0 and again.initial_eval is None
    assert again.islands == ("b", "c") and again.new_islands == ("c",)
    assert again.relaunched == ("b",) and again.stop_requested
    assert [i.name for i in again.config.islands] == ["a", "b", "c"]
    assert again.config.shard_of("c") == 2


def test_a_caller_check_runs_before_anything_is_written(tmp_path):
    def refuse(cfg):
        raise ConfigError(f"no islands here: {len(cfg.islands)}")

    cfg = config_from_params(_params(f"file://{tmp_path}/store", ["a", "b"]))
    with pytest.raises(ConfigError, match="no islands here: 2"):
        create_or_join(cfg, _estore(cfg.store_url), checks=[refuse])
    assert not (tmp_path / "store").exists()
