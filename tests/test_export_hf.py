"""`diloco export --format hf` (training/model/export_hf.py), loaded back by `transformers`.

torch and transformers are not in requirements.lock (several GB; the export itself needs only
safetensors): the load-back tests skip where they are missing, with the reason. They ran with
torch 2.13.0 (CPU) and the transformers release docs/MODELS.md names:

    pip install --target /work/hfsite torch==2.13.0 transformers
    PYTHONPATH=/work/hfsite .venv/bin/python -m pytest tests/test_export_hf.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import new_store, small_config
from tests.test_tokenizer import train_bpe
from training import cli
from training.model import definition as model

GEMMA = {"preset": "gemma-tiny", "compute_dtype": "float32"}


def _export(tmp_path, model_cfg=GEMMA, **sections):
    cfg = small_config("exp", model=model_cfg, **sections)
    url = f"file://{tmp_path / 'store'}"
    estore = new_store(cfg, url)
    # a trained-looking model: random norms' scales too (zero at init would hide a 1 + scale bug)
    rng = np.random.default_rng(0)
    params = {k: v + rng.normal(0, 0.05, v.shape).astype(np.float32)
              for k, v in estore.load_params().items()}  # fmt: skip
    out = tmp_path / "hf"
    return cfg, params, out, url


def _write(cfg, params, out):
    from training.data.tokenizer import tokenizer_for
    from training.model.export_hf import write_hf

    return write_hf(out, cfg, params, tokenizer_for(cfg), {"experiment": "exp"})


def test_the_gpt_family_is_refused_in_one_line(tmp_path, capsys):
    cfg, _, out, url = _export(tmp_path, model_cfg={"preset": "tiny"})
    argv = ["export", "--store", url, "--experiment", "exp", "--out", str(out), "--format", "hf"]
    assert cli.main(argv) == 2
    assert "matches no transformers model type" in capsys.readouterr().err


def test_the_checkpoint_names_and_shapes_are_qwen3s(tmp_path):
    from safetensors.numpy import load_file

    cfg, params, out, _ = _export(tmp_path)
    _write(cfg, params, out)
    config = json.loads((out / "config.json").read_text())
    got = load_file(out / "model.safetensors")
    d = cfg.model.dims()
    hd = d["d_model"] // d["n_heads"]
    assert (config["model_type"], config["head_dim"], config["tie_word_embeddings"]) == (
        "qwen3",
        hd,
        False,
    )
    kv = got["model.layers.0.self_attn.k_proj.weight"]
    assert kv.shape == (d["n_kv_heads"] * hd, d["d_model"])
    assert got["model.layers.1.mlp.down_proj.weight"].shape == (d["d_model"], d["d_ff"])
    # zero-centred norms: weight = 1 + scale
    want = 1.0 + params["blocks/0/q_norm/scale"]
    assert np.array_equal(got["model.layers.0.self_attn.q_norm.weight"], want)
    assert config["diloco"]["tokenizer"]["kind"] == "byte"


def test_transformers_loads_the_export_with_our_logits(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed (see the docstring)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import jax.numpy as jnp

    cfg, params, out, _ = _export(tmp_path)
    _write(cfg, params, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    hf.eval()
    tokens = np.random.default_rng(1).integers(0, 256, (2, 24), dtype=np.int64)
    with torch.no_grad():
        got = hf(torch.from_numpy(tokens)).logits.numpy()
    jparams = {k: jnp.asarray(v) for k, v in params.items()}
    want = np.asarray(model.apply(cfg.model, jparams, jnp.asarray(tokens, jnp.int32)))
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()


def test_transformers_tokenizer_from_an_hf_tokenizer_export(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    tokenizers = pytest.importorskip("tokenizers")

    path = tmp_path / "tokenizer.json"
    train_bpe(path, 300)
    tok = tokenizers.Tokenizer.from_file(str(path))
    model_cfg = {**GEMMA, "vocab_size": 512}
    cfg, params, out, _ = _export(tmp_path, model_cfg=model_cfg, data={"tokenizer": str(path)})
    _write(cfg, params, out)
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded("the cat")["input_ids"] == tok.encode("the cat").ids
