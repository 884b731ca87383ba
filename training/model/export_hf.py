"""`diloco export --format hf`: a Hugging Face `transformers` checkpoint of the model.

**The gemma family as `Qwen3ForCausalLM`.** No Gemma class of `transformers` computes what our
gemma family computes (Gemma 1 has no QK-norm, Gemma 2 and 3 add post-attention and
post-feed-forward norms and soft-capping), but Qwen3's decoder does, exactly, once mapped:
- pre-norm RMSNorm blocks with QK-norm (RMSNorm over the head dimension, before the rotary
  embedding), grouped-query attention scaled by 1/sqrt(head_dim), no biases, a gated MLP
  `down(act(gate(x)) * up(x))` with `hidden_act = "gelu_pytorch_tanh"` (jax.nn.gelu's tanh
  approximation: our GeGLU), rotary positions with base 10,000 rotating the first half of the
  head dimension against the second (`rotate_half`, our layout), `rms_norm_eps` 1e-6;
- our zero-centred norms apply `x * (1 + scale)`, Qwen3's `weight * x`: `weight = 1 + scale`;
- our input embedding is scaled by sqrt(d_model) and tied to the output head: the export
  unties them (`tie_word_embeddings = false`): `embed_tokens = sqrt(d) * E`, `lm_head = E`;
- Flax kernels are (in, out), torch's Linear weights (out, in): transposed; our fused `kv`
  kernel's first `n_kv_heads * head_dim` columns are the keys, the rest the values.

**The gpt family is refused** (one line): learned absolute positions with RMSNorm and no biases
match no `transformers` model type (GPT-2, GPT-Neo and OPT use LayerNorm with biases), and an
export that computes other logits would be worse than none. Its safetensors and Orbax exports
stay available.

The tokenizer goes beside the weights as `transformers` reads it: a Hugging Face
`tokenizer.json` with a `tokenizer_config.json` (`PreTrainedTokenizerFast`); a SentencePiece
model as `tokenizer.model`; the byte tokenizer has no `transformers` form (ids are the UTF-8
bytes: `bytes(ids).decode()`), which config.json's `diloco.tokenizer` says. Checked by loading
the directory with `transformers` and comparing logits (tests/test_export_hf.py, where torch
and transformers are installed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from training.config.experiment import ConfigError
from training.data.tokenizer import Tokenizer

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"


def _one(scale: np.ndarray) -> np.ndarray:
    return (1.0 + scale.astype(np.float32)).astype(np.float32)


def _t(kernel: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(kernel.astype(np.float32).T)


def hf_config(mcfg) -> dict[str, Any]:
    """The `config.json` of the Qwen3 checkpoint for our gemma-family model config."""
    from training.model.gemma import NORM_EPS, ROPE_BASE

    d = mcfg.dims()
    head_dim = d["d_model"] // d["n_heads"]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": d["vocab_size"],
        "hidden_size": d["d_model"],
        "intermediate_size": d["d_ff"],
        "num_hidden_layers": d["n_layers"],
        "num_attention_heads": d["n_heads"],
        "num_key_value_heads": d["n_kv_heads"],
        "head_dim": head_dim,
        "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": d["max_seq_len"],
        "rms_norm_eps": NORM_EPS,
        "rope_theta": ROPE_BASE,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }


def hf_tensors(mcfg, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our gemma-family parameters as Qwen3's state dict (float32, torch's layouts)."""
    d = mcfg.dims()
    kv_cols = d["n_kv_heads"] * (d["d_model"] // d["n_heads"])
    embed = params["embed/embedding"].astype(np.float32)
    out = {
        "model.embed_tokens.weight": embed * np.float32(float(d["d_model"]) ** 0.5),
        "lm_head.weight": np.ascontiguousarray(embed),
        "model.norm.weight": _one(params["final_norm/scale"]),
    }
    for i in range(d["n_layers"]):
        b, h = f"blocks/{i}/", f"model.layers.{i}."
        kv = params[b + "kv/kernel"]
        out |= {
            h + "input_layernorm.weight": _one(params[b + "attn_norm/scale"]),
            h + "self_attn.q_proj.weight": _t(params[b + "q/kernel"]),
            h + "self_attn.k_proj.weight": _t(kv[:, :kv_cols]),
            h + "self_attn.v_proj.weight": _t(kv[:, kv_cols:]),
            h + "self_attn.q_norm.weight": _one(params[b + "q_norm/scale"]),
            h + "self_attn.k_norm.weight": _one(params[b + "k_norm/scale"]),
            h + "self_attn.o_proj.weight": _t(params[b + "attn_out/kernel"]),
            h + "post_attention_layernorm.weight": _one(params[b + "mlp_norm/scale"]),
            h + "mlp.gate_proj.weight": _t(params[b + "mlp_gate/kernel"]),
            h + "mlp.up_proj.weight": _t(params[b + "mlp_up/kernel"]),
            h + "mlp.down_proj.weight": _t(params[b + "mlp_down/kernel"]),
        }
    return out


def _tokenizer_files(out: Path, tok: Tokenizer, max_len: int) -> dict[str, Any]:
    if tok.kind == "byte" or tok.data is None:
        return {"kind": "byte", "note": "no transformers tokenizer: ids are UTF-8 bytes"}
    if tok.kind == "sentencepiece":
        (out / "tokenizer.model").write_bytes(tok.data)
        return {"kind": tok.kind, "file": "tokenizer.model", "sha256": tok.sha256}
    (out / "tokenizer.json").write_bytes(tok.data)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"kind": tok.kind, "file": "tokenizer.json", "sha256": tok.sha256}


def write_hf(out: Path, cfg, params: dict[str, np.ndarray], tok: Tokenizer, what: dict) -> Path:
    """Write the `transformers` checkpoint of `params` (experiment config `cfg`) into `out`
    (`model.safetensors` with Qwen3's names, `config.json`, the tokenizer's files); returns
    `out`. ConfigError (one line) for a model family with no exact `transformers` form."""
    from safetensors.numpy import save

    family = cfg.model.family
    if family != "gemma":
        raise ConfigError(
            f"--format hf: the {family} family (learned positions, RMSNorm, no biases) matches "
            "no transformers model type; use --format safetensors or orbax, or a gemma preset"
        )
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(cfg.model, params)
    (out / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
    config = hf_config(cfg.model)
    config["diloco"] = {
        **what,
        "preset": cfg.model.preset,
        "mapped_from": "gemma family (training/model/gemma.py)",
        "tokenizer": _tokenizer_files(out, tok, config["max_position_embeddings"]),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
