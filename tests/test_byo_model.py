"""Bring your own model: `model.factory` names a Flax NNX model (tests/byo_model.py) that
islands train and the merger merges; a factory that breaks the contract is a one-line
ConfigError at `diloco init`, before anything is written."""

import numpy as np
import pytest

from tests.byo_model import SMOOTHING
from tests.helpers import new_store, small_config
from training import cli
from training.config.experiment import ConfigError, ModelConfig, parse_config
from training.island.process import Island
from training.merge.merger import Merger
from training.model import definition as model

BYO = {**{"preset": "tiny", "d_model": 32, "max_seq_len": 32}, "factory": "tests.byo_model:make"}


def test_a_factory_model_trains_on_islands_and_merges():
    cfg = small_config(
        model=BYO,
        outer={"method": "nesterov"},
        fragments={"count": 2, "strategy": "balanced"},
        islands=({"name": "a", "max_tokens": 4 * 128}, {"name": "b", "max_tokens": 4 * 128}),
    )
    store = new_store(cfg)
    theta0 = store.load_params()
    assert "blocks/1/up/kernel" in theta0 and "head/kernel" in theta0
    for name in ("a", "b"):
        Island(cfg, name, store).run()  # H = 4 steps: one publish of each fragment
    result = Merger(cfg, store).merge_once()
    assert result.versions == {0: 1, 1: 1} and len(result.applied) == 4  # 2 islands x 2 fragments
    merged = store.load_params()
    assert all(merged[k].dtype == np.float32 for k in merged)
    assert any(not np.array_equal(merged[k], theta0[k]) for k in merged)


def test_a_factory_loss_is_the_one_trained():
    cfg = ModelConfig(**{**BYO, "factory": "tests.byo_model:make_with_loss"})
    params = model.init_params(cfg, 0)
    x = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    logits = np.asarray(model.apply(cfg, params, x), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, x[..., None], -1).mean()
    expected = (1 - SMOOTHING) * nll + SMOOTHING * -logp.mean()
    assert float(model.loss_fn(cfg, params, x, x)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("tests.no_such_module:make", "cannot import 'tests.no_such_module': ModuleNotFoundError"),
        ("tests.byo_model:nothing", "module 'tests.byo_model' has no function 'nothing'"),
        ("tests.byo_model:raises", "raised RuntimeError: no weights for you"),
        ("tests.byo_model:returns_a_number", "returned int, expected an nnx.Module"),
        ("tests.byo_model:with_batch_stats", "the module holds state other than nnx.Param"),
        ("tests.byo_model:vector_loss", "the loss must be a scalar, got shape (1, 8)"),
    ],
)
def test_a_broken_factory_is_one_line_at_init_and_writes_nothing(
    tmp_path, capsys, factory, message
):
    argv = ["init", "--store", f"file://{tmp_path}", "--name", "e"]
    argv += ["--set", "model.d_model=32", "--set", f"model.factory={factory}"]
    code = cli.main(argv)
    _, err = capsys.readouterr()
    assert code == 2
    assert f"model.factory {factory!r}: {message}" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_factory_that_is_not_module_colon_function_is_a_config_error():
    with pytest.raises(ConfigError, match="expected 'package.module:function'"):
        parse_config({"name": "e", "model": {"factory": "tests.byo_model.make"}})
