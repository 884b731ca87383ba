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
