"""Sampling with the key/value cache: greedy sampling equals repeated argmax of the whole
sequence's logits; a seed makes a draw repeatable; top-k 1 is greedy."""

import jax.numpy as jnp
import pytest

from training.config.experiment import ConfigError, ModelConfig
from training.model import definition as model
from training.model.sample import sample

CFG = ModelConfig(preset="tiny", compute_dtype="float32")


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, seed=0)


def test_greedy_equals_argmax_of_the_whole_sequence(params):
    prompt = [72, 105, 32]  # "Hi "
    seq = list(prompt)
    for _ in range(5):  # no cache: recompute every position, take the last argmax
        seq.append(int(jnp.argmax(model.apply(CFG, params, jnp.asarray([seq]))[0, -1])))
    assert sample(CFG, params, prompt, 5, temperature=0.0) == seq[3:]


def test_a_seed_repeats_and_top_k_1_is_greedy(params):
    a = sample(CFG, params, [1, 2], 6, temperature=1.0, seed=7)
    assert a == sample(CFG, params, [1, 2], 6, temperature=1.0, seed=7)
    greedy = sample(CFG, params, [1, 2], 6, temperature=0.0)
    assert sample(CFG, params, [1, 2], 6, temperature=2.0, top_k=1, seed=3) == greedy


def test_too_long_is_a_one_line_error(params):
    with pytest.raises(ConfigError, match="> max_seq_len"):
        sample(CFG, params, [1], CFG.dims()["max_seq_len"])


def test_diloco_sample_prints_the_greedy_continuation_of_a_store_snapshot(tmp_path, capsys):
    from tests.helpers import new_store, small_config
    from training import cli
    from training.data.tokenizer import tokenizer_for

    cfg = small_config("exp")
    url = f"file://{tmp_path}"
    estore = new_store(cfg, url)
    tok = tokenizer_for(cfg)
    want = sample(cfg.model, estore.load_params(), tok.encode("Hi"), 4, temperature=0.0)
    argv = ["sample", "--store", url, "--experiment", "exp", "--prompt", "Hi"]
    code = cli.main([*argv, "--max-tokens", "4", "--temperature", "0", "--snapshot", "0"])
    assert (code, capsys.readouterr().out) == (0, "Hi" + tok.decode(want) + "\n")


def test_diloco_export_writes_the_snapshot_as_safetensors_and_config(tmp_path, capsys):
    import json

    import numpy as np
    from safetensors.numpy import load_file

    from tests.helpers import new_store, small_config
    from training import cli

    cfg = small_config("exp")
    url = f"file://{tmp_path / 'store'}"
    want = new_store(cfg, url).load_params()
    out = tmp_path / "out"
    argv = ["export", "--store", url, "--experiment", "exp", "--out", str(out), "--snapshot", "0"]
    assert cli.main(argv) == 0
    got = load_file(out / "model.safetensors")  # read back by the safetensors library
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    config = json.loads((out / "config.json").read_text())
    assert (config["family"], config["tokenizer"]["kind"]) == (cfg.model.family, "byte")


def test_an_orbax_export_restores_into_the_model_with_equal_logits(tmp_path):
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from tests.helpers import new_store, small_config
    from training import cli

    cfg = small_config("exp")
    url = f"file://{tmp_path / 'store'}"
    params = new_store(cfg, url).load_params()
    out = tmp_path / "out"
    argv = ["export", "--store", url, "--experiment", "exp", "--out", str(out), "--format"]
    assert cli.main([*argv, "orbax"]) == 0
    with ocp.StandardCheckpointer() as ckpt:  # read back by orbax itself
        restored = ckpt.restore((out / "orbax").absolute())
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    want = model.apply(cfg.model, {k: jax.numpy.asarray(v) for k, v in params.items()}, tokens)
    got = model.apply(cfg.model, {k: jax.numpy.asarray(v) for k, v in restored.items()}, tokens)
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_snapshot_final_is_refused_before_the_run_ended_then_names_finals_model(tmp_path, capsys):
    from tests.helpers import new_store, small_config
    from training import cli

    cfg = small_config("exp")
    url = f"file://{tmp_path / 'store'}"
    estore = new_store(cfg, url)
    argv = ["export", "--store", url, "--experiment", "exp", "--snapshot", "final"]
    assert cli.main([*argv, "--out", str(tmp_path / "a")]) == 2
    assert "--snapshot final: the run has not ended" in capsys.readouterr().err
    snapshot = estore.current_snapshot()  # version 0 of each fragment: what finalize records
    assert estore.record_final({"loss": 3.0, **snapshot.to_dict()})
    assert cli.main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert '"tensors"' in capsys.readouterr().out


def _exported(tmp_path, capsys):
    from tests.helpers import new_store, small_config
    from training import cli

    cfg = small_config("exp")
    url = f"file://{tmp_path / 'store'}"
    estore = new_store(cfg, url)
    out = tmp_path / "out"
    assert cli.main(["export", "--store", url, "--experiment", "exp", "--out", str(out)]) == 0
    capsys.readouterr()
    return cfg, estore, out


def test_sample_from_an_export_directory_equals_sample_from_the_store(tmp_path, capsys):
    from training import cli

    cfg, estore, out = _exported(tmp_path, capsys)
    args = ["--prompt", "Hi", "--max-tokens", "4", "--temperature", "0"]
    url = f"file://{tmp_path / 'store'}"
    assert cli.main(["sample", "--store", url, "--experiment", "exp", *args]) == 0
    from_store = capsys.readouterr().out
    assert cli.main(["sample", "--from", str(out), *args]) == 0
    assert capsys.readouterr().out == from_store


def test_an_export_whose_tensor_does_not_fit_the_model_is_refused_in_one_line(tmp_path, capsys):
    from safetensors.numpy import load_file, save

    from training import cli

    _, _, out = _exported(tmp_path, capsys)
    tensors = load_file(out / "model.safetensors")
    name = next(n for n in sorted(tensors) if tensors[n].ndim == 2)
    # as many values, another shape: the weights' size fits the config, the tensor does not
    # (a tensor of another size is refused by the size check first: tests/test_hostile_reads.py)
    flat = tensors[name].reshape(-1)
    tensors[name] = flat
    (out / "model.safetensors").write_bytes(save(tensors))
    assert cli.main(["sample", "--from", str(out), "--prompt", "Hi"]) == 2
    assert f"{name} is float32[{flat.size}]" in capsys.readouterr().err


def test_an_export_without_its_tokenizer_file_is_refused(tmp_path, capsys):
    import json

    from training import cli

    _, _, out = _exported(tmp_path, capsys)
    config = json.loads((out / "config.json").read_text())
    config["tokenizer"] = {"kind": "huggingface", "sha256": "0" * 64, "file": "tokenizer.json"}
    (out / "config.json").write_text(json.dumps(config))
    assert cli.main(["sample", "--from", str(out), "--prompt", "Hi"]) == 2
    assert "tokenizer.json: No such file or directory" in capsys.readouterr().err


def test_sample_without_a_source_says_what_to_give(capsys):
    from training import cli

    assert cli.main(["sample", "--prompt", "Hi"]) == 2
    assert "give --store and --experiment, or --from DIR" in capsys.readouterr().err
