"""Islands of different hardware: per-island batch size and device count, validated at init;
DyLU and token weighting on each island's own batch (numbers derived by hand)."""

from __future__ import annotations

import pytest

from tests.helpers import new_store, small_config
from training.config.experiment import ConfigError, OuterConfig, parse_config
from training.island.process import Island
from training.merge.selection import vote_weight
from training.protocol import claims

# data.batch_size 16, seq_len 64; a: speed 1, batch 16; b: speed 1 (tokens/s), batch 32;
# c: speed 2, batch 32 (twice the hardware: twice the batch at a's step time)
MIXED = {
    "name": "mixed",
    "inner": {"H": 32},
    "data": {"batch_size": 16, "seq_len": 64},
    "islands": [
        {"name": "a"},
        {"name": "b", "batch_size": 32},
        {"name": "c", "batch_size": 32, "speed": 2.0},
    ],
}


def test_dylu_scales_h_with_each_islands_step_rate():
    cfg = parse_config(MIXED)
    # step rate = speed x 16 / batch: 1, 0.5, 1 -> H = floor(32 x rate / 1)
    assert [cfg.inner_steps(n) for n in "abc"] == [32, 16, 32]


def test_a_round_counts_the_tokens_of_the_islands_own_batch():
    cfg = parse_config(MIXED)
    per_round = [cfg.inner_steps(n) * cfg.tokens_per_step(n) for n in "abc"]
    assert per_round == [32 * 16 * 64, 16 * 32 * 64, 32 * 32 * 64] == [32768, 32768, 65536]


def test_token_weights_of_mixed_islands_are_one_two_four():
    cfg = parse_config(MIXED)
    outer = OuterConfig(staleness_decay=False)
    w = {
        n: vote_weight(outer, cfg.inner_steps(n) * cfg.tokens_per_step(n), cfg.inner_steps(n), 0)
        for n in "abc"
    }
    # tokens^2 / steps: 32768^2 / 32, 32768^2 / 16, 65536^2 / 32
    assert w == {"a": 33554432.0, "b": 67108864.0, "c": 134217728.0}


def test_the_claim_bound_is_each_islands_own_tokens_per_step():
    limits = claims.Limits.from_config(parse_config(MIXED))
    big = claims.Claim("b", 0, 0, 0, steps=16, tokens=16 * 32 * 64)
    assert claims.check_claim(big, limits, now=0.0) is None
    same_from_a = claims.Claim("a", 0, 0, 0, steps=16, tokens=16 * 32 * 64)
    assert "exceed 16 steps x 1024 tokens per step" in claims.check_claim(
        same_from_a, limits, now=0.0
    )


@pytest.mark.parametrize(
    "island, words",
    [
        ({"name": "a", "batch_size": 12, "devices": 8}, "batch_size 12 does not divide over its 8"),
        ({"name": "a", "hardware": {"accelerator_type": "v5p-64"}}, "data.batch_size 16"),
        ({"name": "a", "hardware": {"topology": "2x4"}, "batch_size": 4}, "over its 8 devices"),
    ],
)
def test_init_refuses_a_batch_that_does_not_split_over_the_islands_devices(island, words):
    with pytest.raises(ConfigError, match=words) as err:
        parse_config({**MIXED, "islands": [island]})
    assert "\n" not in str(err.value)


def test_a_batch_that_splits_over_the_hardware_is_accepted():
    cfg = parse_config({**MIXED, "islands": [{"name": "a", "batch_size": 64, "devices": 32}]})
    assert cfg.batch_size("a") == 64


def test_an_island_trains_and_claims_its_own_batch():
    cfg = small_config(islands=["a", {"name": "b", "batch_size": 8}])
    store = new_store(cfg)
    island = Island(cfg, "b", store)
    island.start()
    assert island.H == cfg.inner.H // 2  # twice the batch at the same speed: half the steps
    for _ in range(island.H):
        island.step()
    (ref,) = store.list_pseudograds("b")
    assert ref.manifest["tokens"] == island.H * 8 * cfg.data.seq_len
    assert island.state.loader.next_batch()[0].shape == (8, cfg.data.seq_len)


def test_an_island_asking_for_more_devices_than_it_sees_does_not_start():
    cfg = small_config(islands=[{"name": "a", "devices": 4}])
    with pytest.raises(RuntimeError, match="asks for 4 devices"):
        Island(cfg, "a", new_store(cfg))
