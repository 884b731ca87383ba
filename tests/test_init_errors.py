"""Errors that stop a run at once (issue 12, item 3): `init` fails without retries, with one
line, on what no retry can fix (a bad config or budget, a backend not offered, a store URL or a
store that cannot work), and lets Airflow retry what may heal (a store that did not answer)."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException
from diloco_airflow.experiment_setup import permanent_reason, run_init
from diloco_airflow.params import experiment_params

from training.config.experiment import ConfigError, check_budget, parse_config
from training.store.objectstore import (
    StoreConnectionError,
    StoreUnreachable,
    TransientStoreError,
)
from training.store.registry import open_store


def _values(store_url: str, **changes) -> dict:
    values = {k: p.value for k, p in experiment_params().items()} | {"experiment_name": "t"}
    return {**values, "store_url": store_url, **changes}


def _failure(values: dict) -> str:
    with pytest.raises(AirflowFailException) as err:
        run_init(values)
    return str(err.value)


def test_a_budget_under_one_batch_per_island_fails_init_at_once(file_url, tmp_path):
    message = _failure(_values(file_url, token_budget=1000))
    assert "token_budget" in message and "\n" not in message
    assert not (tmp_path / "store").exists(), "nothing is created"


def test_a_model_beyond_the_bounds_fails_init_at_once(file_url, tmp_path):
    # ModelConfig.bounded_dims, through the config's own validation (tests/test_hostile_reads.py
    # has `diloco init` and a stored config)
    values = _values(file_url)
    values["overrides"] = {**(values.get("overrides") or {}), "model.n_layers": 2**40}
    message = _failure(values)
    assert "n_layers 1,099,511,627,776 is over the limit 4,096" in message and "\n" not in message
    assert not (tmp_path / "store").exists(), "nothing is created"


def test_a_bad_store_scheme_fails_init_at_once(file_url):
    message = _failure(_values("s3://nope/x"))
    assert "s3://nope/x" in message and "\n" not in message


def test_a_store_that_is_not_a_directory_fails_init_at_once(tmp_path):
    (tmp_path / "file").write_text("x")
    message = _failure(_values(f"file://{tmp_path}/file/store"))
    assert "not a directory" in message


def test_an_island_on_a_backend_not_offered_fails_init_at_once(file_url, monkeypatch):
    monkeypatch.setenv("DILOCO_BACKENDS", "local")
    islands = [{"name": "a", "backend": "local"}, {"name": "b", "backend": "gke"}]
    message = _failure(_values(file_url, islands=islands))
    assert "'b'" in message and "gke" in message and "DILOCO_BACKENDS=local" in message


def test_a_store_that_did_not_answer_is_retried_not_failed():
    assert permanent_reason(StoreConnectionError("cannot reach 127.0.0.1:1")) is None
    assert permanent_reason(TransientStoreError("503")) is None
    assert permanent_reason(OSError("reset")) is None


def test_permanent_causes_give_their_one_line():
    assert permanent_reason(StoreUnreachable("bucket gs://b does not exist")).startswith("bucket")
    assert permanent_reason(ConfigError("invalid config: x")) == "invalid config: x"
    with pytest.raises(ValueError) as err:
        open_store("s3://nope/x")
    assert "unsupported store URL" in permanent_reason(err.value)


def test_check_budget_counts_one_batch_per_island():
    cfg = parse_config({"name": "e", "token_budget": 2 * 16 * 64})
    check_budget(cfg)  # two default islands, batch 16 x 64: exactly enough
    with pytest.raises(ConfigError, match="2 x 16 x 64"):
        check_budget(cfg.model_copy(update={"token_budget": 2 * 16 * 64 - 1}))


def test_init_logs_no_tpu_probe():
    """jax's "Unable to initialize backend 'tpu'" (INFO) is not the first line of init's log."""
    import logging

    from diloco_airflow.experiment_setup import JAX_PROBE_LOGGER

    assert logging.getLogger(JAX_PROBE_LOGGER).getEffectiveLevel() == logging.WARNING


# -- bad input loses nothing (issue 38 item 4) -----------------------------------------------


def _init_cli(capsys, store: str, *sets: str) -> tuple[int, str]:
    from training import cli

    argv = ["init", "--store", store, "--name", "bad", "--set", "model.preset=tiny"]
    for item in sets:
        argv += ["--set", item]
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip()


def test_a_data_source_that_does_not_exist_is_refused_before_anything_is_written(tmp_path, capsys):
    store = f"file://{tmp_path}/store"
    code, err = _init_cli(capsys, store, "data.source=/nope/corpus")
    assert code == 2 and "\n" not in err
    assert "data.source: data source '/nope/corpus' does not exist" in err
    assert not (tmp_path / "store").exists()  # no config.json, no version 0: nothing to undo
    again, _ = _init_cli(capsys, store, "data.source=/nope/corpus")
    assert again == 2  # refused again, not "already initialized"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the corrected path: some text to train on. " * 3000)
    fixed, err = _init_cli(capsys, store, f"data.source={corpus}", "token_budget=100000")
    assert fixed == 0, err  # the corrected path is taken: nothing of the first try is in the way


def test_a_mistyped_config_key_says_what_it_meant(tmp_path, capsys):
    code, err = _init_cli(capsys, f"file://{tmp_path}/store", "outer.lrr=0.5")
    assert code == 2 and "outer.lrr: unknown field (did you mean 'outer.lr'?)" in err
    assert not (tmp_path / "store").exists()


def test_a_failed_init_after_writing_removes_what_it_wrote(tmp_path, monkeypatch):
    from training.usecases import create

    def broken_eval(*_):
        raise RuntimeError("the first eval failed")

    monkeypatch.setattr(create, "evaluate_current", broken_eval)
    from tests.helpers import small_config
    from training.store.experiment import ExperimentStore
    from training.store.registry import open_store

    estore = ExperimentStore(open_store(f"file://{tmp_path}/store"), "gone")
    with pytest.raises(RuntimeError, match="the first eval failed"):
        create.create_or_join(small_config("gone"), estore)
    assert estore.list_keys("") == []  # no config.json, no version 0
