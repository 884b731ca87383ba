import itertools
import math

import numpy as np
import pytest

from tests.helpers import fragment_sizes
from training.protocol import fragments


def model_shapes(n_layers: int = 6, d: int = 64, vocab: int = 256, seq: int = 128) -> dict:
    shapes = {"embed/embedding": (vocab, d), "pos_embed/embedding": (seq, d)}
    for i in range(n_layers):
        shapes |= {
            f"blocks/{i}/attn_norm/scale": (d,),
            f"blocks/{i}/qkv/kernel": (d, 3 * d),
            f"blocks/{i}/attn_out/kernel": (d, d),
            f"blocks/{i}/mlp_norm/scale": (d,),
            f"blocks/{i}/mlp_up/kernel": (d, 4 * d),
            f"blocks/{i}/mlp_down/kernel": (4 * d, d),
        }
    shapes["final_norm/scale"] = (d,)
    return shapes


def _optimal_makespan(sizes: list[int], bins: int) -> int:
    best = math.inf
    for choice in itertools.product(range(bins), repeat=len(sizes)):
        loads = [0] * bins
        for size, b in zip(sizes, choice, strict=True):
            loads[b] += size
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("strategy", fragments.STRATEGIES)
@pytest.mark.parametrize("P", [1, 2, 3, 6])
def test_every_name_assigned_once_and_no_empty_fragment(strategy, P):
    shapes = model_shapes()
    assignment = fragments.assign_fragments(shapes, P, strategy)
    assert list(assignment) == list(shapes)
    assert set(assignment.values()) == set(range(P))
    parts = [fragments.split_by_fragment(shapes, assignment, p) for p in range(P)]
    assert sum(len(part) for part in parts) == len(shapes)
    assert set().union(*parts) == set(shapes)
    if strategy == "tensors":
        return  # single tensors: a block may straddle fragments by design
    for p in range(P):  # a block never straddles fragments
        blocks = {fragments.block_index(n) for n in parts[p]} - {None}
        for other in range(P):
            if other != p:
                assert not blocks & ({fragments.block_index(n) for n in parts[other]} - {None})


def test_tensor_strategy_reaches_p_beyond_the_layer_count_and_balances():
    shapes = model_shapes()
    P = len(fragments.layer_groups(shapes)) + 1  # more fragments than layer groups
    sizes = fragment_sizes(shapes, fragments.assign_fragments(shapes, P, "tensors"), P)
    assert min(sizes) > 0
    biggest = max(int(np.prod(s)) for s in shapes.values())
    assert max(sizes) <= max(biggest, 4 / 3 * sum(sizes) / P)  # LPT: 4/3 of optimal or one tensor


def test_strided_layout():
    shapes = model_shapes(n_layers=6)
    assignment = fragments.assign_fragments(shapes, 3, "strided")
    assert assignment["blocks/4/qkv/kernel"] == 1
    assert assignment["blocks/5/mlp_up/kernel"] == 2
    for name in ("embed/embedding", "pos_embed/embedding", "final_norm/scale"):
        assert assignment[name] == 0
    assert fragments.assign_fragments(shapes, 1, "strided") == dict.fromkeys(shapes, 0)
    with pytest.raises(ValueError, match="number of blocks"):
        fragments.assign_fragments(shapes, 7, "strided")


def test_block_index_parsing():
    assert fragments.block_index("blocks/12/attn/qkv/kernel") == 12
    assert fragments.block_index("model/blocks/3/x") == 3
    assert fragments.block_index("blocks/7") == 7
    assert fragments.block_index("myblocks/3/x") is None
    assert fragments.block_index("embed/embedding") is None


def test_balanced_is_within_four_thirds_of_lower_bound():
    for n_layers, vocab, P in [(6, 256, 4), (12, 32000, 5), (24, 50257, 8), (8, 256, 8)]:
        shapes = model_shapes(n_layers=n_layers, d=128, vocab=vocab)
        assignment = fragments.assign_fragments(shapes, P, "balanced")
        sizes = fragment_sizes(shapes, assignment, P)
        groups = fragments.layer_groups(shapes)
        group_sizes = [sum(math.prod(shapes[n]) for n in names) for names in groups.values()]
        lower = max(sum(group_sizes) / P, max(group_sizes))
        assert max(sizes) <= 4 / 3 * lower
        assert sum(sizes) == sum(group_sizes)


def test_balanced_lpt_bound_against_brute_force_optimum():
    rng = np.random.default_rng(0)
    for _ in range(30):
        P = int(rng.integers(2, 4))
        sizes = [int(s) for s in rng.integers(1, 100, size=int(rng.integers(P, 8)))]
        shapes = {f"t{i}": (s,) for i, s in enumerate(sizes)}
        assignment = fragments.assign_fragments(shapes, P, "balanced")
        makespan = max(fragment_sizes(shapes, assignment, P))
        assert makespan <= (4 / 3 - 1 / (3 * P)) * _optimal_makespan(sizes, P) + 1e-9


def test_balanced_is_deterministic_and_validates_P():
    shapes = model_shapes()
    a = fragments.assign_fragments(shapes, 4, "balanced")
    assert a == fragments.assign_fragments(dict(reversed(shapes.items())), 4, "balanced")
    n_groups = len(fragments.layer_groups(shapes))
    assert n_groups == 6 + 3
    assert set(fragments.assign_fragments(shapes, n_groups, "balanced").values()) == set(
        range(n_groups)
    )
    for bad in (0, n_groups + 1):
        with pytest.raises(ValueError, match="num_fragments"):
            fragments.assign_fragments(shapes, bad, "balanced")
    with pytest.raises(ValueError, match="strategy"):
        fragments.assign_fragments(shapes, 2, "random")


def test_offsets():
    assert fragments.fragment_offsets(24, 24) == list(range(24))
    assert fragments.fragment_offsets(8, 4) == [0, 2, 4, 6]
    assert fragments.fragment_offsets(10, 3) == [0, 3, 6]
    assert fragments.fragment_offsets(5, 1) == [0]
    with pytest.raises(ValueError):
        fragments.fragment_offsets(0, 1)


@pytest.mark.parametrize(("H", "P"), [(1, 1), (5, 1), (8, 4), (10, 3), (24, 24), (4, 6), (3, 8)])
def test_schedule(H, P):
    offsets = fragments.fragment_offsets(H, P)
    steps = range(1, H * P * 3 + 1)
    due = {s: fragments.fragments_due(s, H, P) for s in steps}
    counts = [sum(p in d for d in due.values()) for p in range(P)]
    assert max(counts) - min(counts) <= 1  # fragment 0 starts first
    for p, offset in enumerate(offsets):
        publishes = [s for s, d in due.items() if p in d]
        assert publishes[0] == H + offset
        assert all(b - a == H for a, b in itertools.pairwise(publishes))
    # after warm-up every window of H steps publishes each fragment exactly once
    window = [p for s in range(H, H + 3 * P * H) for p in fragments.fragments_due(s, H, P)]
    assert [window.count(p) for p in range(P)] == [3 * P] * P
    per_step = max(len(d) for d in due.values())
    assert per_step <= math.ceil(P / H)
    if P <= H:
        assert per_step == 1
    assert all(not fragments.fragments_due(s, H, P) for s in range(0, H))


def test_single_fragment_every_H_steps():
    assert [s for s in range(1, 50) if fragments.fragments_due(s, 7, 1)] == [
        7,
        14,
        21,
        28,
        35,
        42,
        49,
    ]
    assert fragments.fragments_due(14, 7, 1) == [0]


def test_is_embedding_and_split_validation():
    assert fragments.is_embedding("embed/embedding")
    assert fragments.is_embedding("pos_embed/embedding")
    assert not fragments.is_embedding("blocks/0/qkv/kernel")
    with pytest.raises(ValueError, match="without a fragment"):
        fragments.split_by_fragment({"x": 1, "y": 2}, {"x": 0}, 0)
    assert fragments.split_by_fragment({"x": 1, "y": 2}, {"x": 0, "y": 1}, 1) == {"y": 2}
