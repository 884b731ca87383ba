"""Model presets: parameter counts from the config match the NNX model; the gemma family's
rotary positions, grouped-query attention and fragments."""

import jax
import numpy as np
import pytest

from tests.helpers import fragment_sizes, new_store, small_config
from training.config.experiment import GEMMA_PRESETS, PRESETS, ConfigError, ModelConfig
from training.island.process import Island
from training.merge.merger import Merger
from training.model import definition as model
from training.model import gemma
from training.protocol import fragments

ALL_PRESETS = [*PRESETS, *GEMMA_PRESETS]


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_param_count_matches_model(preset):
    cfg = ModelConfig(preset=preset)
    abstract = model.abstract_params(cfg)
    assert sum(int(np.prod(v.shape)) for v in abstract.values()) == cfg.param_count()


def test_preset_sizes():
    # golden sizes: update only when a preset is deliberately changed
    sizes = {p: ModelConfig(preset=p).param_count() for p in ["tiny", "small", "125m", "1b", "12b"]}
    assert sizes["tiny"] < 1_000_000
    assert 10_000_000 <= sizes["small"] <= 20_000_000
    assert sizes == {
        "tiny": 434_816,
        "small": 14_358_912,
        "125m": 124_373_760,
        "1b": 1_013_262_336,
        "12b": 12_232_688_640,
    }


def test_gemma_preset_sizes():
    # golden sizes, derived by hand (d = d_model, L = n_layers, N / K = query / kv heads,
    # hd = d / N, f = d_ff, V = vocab; per layer 2d^2 (q, out) + 2d*K*hd (k, v) + 3d*f (gate,
    # up, down) + 2d (attn / mlp norms) + 2hd (q / k norms); plus V*d (tied embedding) + d):
    # gemma-tiny  d 128, L 2, N 4, K 2, hd 32, f 384, V 256:
    #   32768 + 16384 + 147456 + 256 + 64 = 196928; x2 = 393856; + 32768 + 128 = 426752
    # gemma-small d 384, L 8, N 6, K 2, hd 64, f 1152, V 256:
    #   294912 + 98304 + 1327104 + 768 + 128 = 1721216; x8 = 13769728; + 98304 + 384
    # gemma-125m  d 768, L 12, N 12, K 4, hd 64, f 2304, V 50304:
    #   1179648 + 393216 + 5308416 + 1536 + 128 = 6882944; x12 = 82595328; + 38633472 + 768
    # gemma-1b    d 2048, L 18, N 16, K 4, hd 128, f 6144, V 50304:
    #   8388608 + 2097152 + 37748736 + 4096 + 256 = 48238848; x18 = 868299264; + 103022592 + 2048
    # gemma-12b   d 5120, L 38, N 40, K 8, hd 128, f 15360, V 50304:
    #   52428800 + 10485760 + 235929600 + 10240 + 256 = 298854656; x38 = 11356476928
    #   + 257556480 + 5120
    assert {p: ModelConfig(preset=p).param_count() for p in GEMMA_PRESETS} == {
        "gemma-tiny": 426_752,
        "gemma-small": 13_868_416,
        "gemma-125m": 121_229_568,
        "gemma-1b": 971_323_904,
        "gemma-12b": 11_614_038_528,
    }


def test_gemma_attention_groups_query_heads_over_fewer_kv_heads():
    cfg = ModelConfig(preset="gemma-small")  # d 384, 6 query heads, 2 kv heads of 64
    shapes = model.abstract_params(cfg)
    assert shapes["blocks/0/q/kernel"].shape == (384, 6 * 64)
    assert shapes["blocks/0/kv/kernel"].shape == (384, 2 * 2 * 64)
    assert not any("pos_embed" in name for name in shapes)  # positions are rotary


def test_rotary_scores_depend_only_on_the_relative_position():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 16)).astype(np.float32)

    def score(m, n):  # q at position m, k at position n, in a sequence of 12
        seq = np.zeros((2, 1, 12, 1, 16), np.float32)
        seq[0, 0, m, 0], seq[1, 0, n, 0] = q, k
        rq, rk = (np.asarray(gemma.rope(s)) for s in seq)
        return float(rq[0, m, 0] @ rk[0, n, 0])

    assert score(5, 2) == pytest.approx(score(9, 6), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


def test_gemma_balanced_fragments_keep_blocks_whole_and_even():
    shapes = {
        k: v.shape for k, v in model.abstract_params(ModelConfig(preset="gemma-small")).items()
    }
    assignment = fragments.assign_fragments(shapes, 4, "balanced")
    for block in range(8):
        assert len({p for n, p in assignment.items() if f"blocks/{block}/" in n}) == 1
    sizes = fragment_sizes(shapes, assignment, 4)
    assert max(sizes) <= 4 / 3 * sum(sizes) / 4  # within Graham's bound of the perfect split
    assert [n for n in shapes if fragments.is_embedding(n)] == ["embed/embedding"]


def test_a_gemma_model_trains_on_islands_and_merges_by_fragment():
    small = {"preset": "gemma-tiny", "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 96}
    cfg = small_config(
        model={**small, "max_seq_len": 32},
        outer={"method": "nesterov"},
        fragments={"count": 2, "strategy": "balanced"},
        islands=({"name": "a", "max_tokens": 4 * 128},),
    )
    store = new_store(cfg)
    theta0 = store.load_params()
    Island(cfg, "a", store).run()  # H = 4 steps: one publish of each fragment
    result = Merger(cfg, store).merge_once()
    assert result.versions == {0: 1, 1: 1}
    merged = store.load_params()
    assert all(not np.array_equal(merged[k], theta0[k]) for k in merged)  # every tensor moved


def test_kv_heads_need_the_gemma_family_and_divide_the_query_heads():
    with pytest.raises(ConfigError, match="n_kv_heads 2 needs a gemma preset"):
        ModelConfig(preset="tiny", n_kv_heads=2).dims()
    with pytest.raises(ConfigError, match="n_heads 4 is not divisible by n_kv_heads 3"):
        ModelConfig(preset="gemma-tiny", n_kv_heads=3).dims()


def test_init_is_deterministic_and_named():
    cfg = ModelConfig()
    a, b = model.init_params(cfg, 3), model.init_params(cfg, 3)
    assert "embed/embedding" in a and "blocks/1/mlp_up/kernel" in a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("preset", ["tiny", "gemma-tiny"])
def test_logits_shape_and_causality(preset):
    cfg = ModelConfig(preset=preset)
    params = model.init_params(cfg, 0)
    x = np.arange(16, dtype=np.int32).reshape(2, 8)
    y = x.copy()
    y[:, -1] = 99
    la, lb = model.apply(cfg, params, x), model.apply(cfg, params, y)
    assert la.shape == (2, 8, 256)
    # changing the last token must not change earlier positions' logits
    np.testing.assert_allclose(la[:, :-1], lb[:, :-1], atol=1e-5)


def test_auto_compute_dtype_is_float32_on_cpu_and_bfloat16_on_accelerators(monkeypatch):
    assert model.compute_dtype(ModelConfig()) == np.float32  # this machine: CPU only
    assert model.compute_dtype(ModelConfig(compute_dtype="bfloat16")) == jax.numpy.bfloat16
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert model.compute_dtype(ModelConfig()) == jax.numpy.bfloat16
    assert model.compute_dtype(ModelConfig(compute_dtype="float32")) == np.float32
