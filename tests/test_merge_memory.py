"""What a merge shard keeps in memory (training/merge/memory.py): the warm limit, the refusal
of a shard that cannot fit one merge, and the table docs/AIRFLOW.md prints."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from tests.helpers import new_store, small_config
from training.config.experiment import parse_config
from training.merge import memory
from training.merge.merger import Merger
from training.model.runtime import fragment_shapes

GiB = memory.GiB
DOC = Path(__file__).resolve().parents[1] / "docs" / "AIRFLOW.md"


def _frag(p: int, state_gib: float, working_gib: float) -> memory.FragmentMemory:
    return memory.FragmentMemory(p, int(state_gib * GiB), int(working_gib * GiB))


def test_the_warm_limit_is_memory_less_the_largest_working_set():
    frags = [_frag(0, 3, 1), _frag(1, 3, 2), _frag(2, 3, 1)]
    # 10 GiB less the largest working set (2) = 8 GiB, of the 9 GiB of state
    assert memory.warm_limit(frags, 10 * GiB) == 8 * GiB
    # 20 GiB holds every fragment's state: the limit is all of it (9 GiB)
    assert memory.warm_limit(frags, 20 * GiB) == 9 * GiB


def test_a_shard_that_cannot_fit_one_merge_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        memory.check_fits([_frag(0, 3, 1), _frag(5, 6, 2)], 7 * GiB, "shard 1")
    # fragment 5 needs 6 + 2 = 8 GiB
    assert str(err.value).startswith(
        "shard 1 cannot merge fragment 5 in 7.0 GiB: one merge needs 8.0"
    )
    assert "\n" not in str(err.value)


def test_a_merger_without_the_memory_for_one_merge_refuses_to_start():
    cfg = small_config(syncer={"memory_gib": 1e-6})
    with pytest.raises(ValueError, match="cannot merge fragment 0 in 0.0 MiB: one merge needs"):
        Merger(cfg, new_store(cfg))


def test_a_merger_that_cannot_hold_every_fragment_warm_says_so(caplog):
    cfg = small_config(fragments={"count": 2, "strategy": "tensors"})
    frags = memory.shard_memory(cfg, [0, 1], fragment_shapes(cfg))
    # room for one merge of the larger fragment (its state and working set), not both states
    budget = max(f.peak for f in frags) + 1
    cfg = small_config(
        fragments={"count": 2, "strategy": "tensors"}, syncer={"memory_gib": budget / GiB}
    )
    with caplog.at_level(logging.WARNING, "diloco.merge"):
        merger = Merger(cfg, new_store(cfg))
    assert merger.warm_bytes < sum(f.state for f in frags)
    assert "the others start cold" in caplog.text


def _doc_rows() -> list[tuple[str, int, float, float]]:
    rows = re.findall(r"^\s*\| (1b|12b) \| (\d) \| ([\d.]+) \| ([\d.]+) \|$", DOC.read_text(), re.M)
    return [(m, int(s), float(a), float(b)) for m, s, a, b in rows]


def test_the_docs_table_is_what_the_memory_model_gives():
    want = []
    for preset in ("1b", "12b"):
        cfg = parse_config(
            {
                "name": "x",
                "model": {"preset": preset},
                "fragments": {"count": 24, "strategy": "tensors"},
                "islands": [{"name": f"i{m}"} for m in range(4)],
            }
        )
        frags = fragment_shapes(cfg)
        for S in (1, 2, 4):
            fm = memory.shard_memory(cfg, [p for p in range(24) if p % S == 0], frags)
            warm = (sum(f.state for f in fm) + max(f.working for f in fm)) / GiB
            want.append((preset, S, round(warm, 1), round(max(f.peak for f in fm) / GiB, 1)))
    assert _doc_rows() == want
