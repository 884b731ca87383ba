"""Streaming-DiLoCo fragments: which tensors travel together, and when each fragment is published.

Tensors are grouped into *layer groups*: all tensors of transformer block i (a name with the path
components `blocks/{i}`) form one group; every other tensor (embeddings, final norm, head) is a
group of its own. Strategies:
- "strided": block i goes to fragment i % P; all non-block tensors go to fragment 0. Needs P no
  larger than the number of blocks, so that no fragment is empty.
- "balanced": greedy longest-processing-time bin packing of the groups by element count into P
  fragments. Its largest fragment is at most (4/3 - 1/(3P)) times the optimal (Graham, 1969).
- "tensors": the same bin packing over single tensors (a layer may span fragments), so P can
  reach the number of tensors: the paper's P = 24 on models with fewer than 24 layers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

STRATEGIES = ("strided", "balanced", "tensors")
_BLOCK = re.compile(r"(?:^|/)blocks/(\d+)(?:/|$)")


def block_index(name: str) -> int | None:
    """The transformer block a tensor belongs to, or None for tensors outside the blocks."""
    match = _BLOCK.search(name)
    return int(match.group(1)) if match else None


def layer_groups(shapes: Mapping[str, Sequence[int]]) -> dict[str, list[str]]:
    """Group key -> tensor names; the key is `blocks/{i}` or the tensor's own name."""
    groups: dict[str, list[str]] = {}
    for name in shapes:
        index = block_index(name)
        groups.setdefault(name if index is None else f"blocks/{index}", []).append(name)
    return groups


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def assign_fragments(
    shapes: Mapping[str, Sequence[int]], num_fragments: int, strategy: str = "strided"
) -> dict[str, int]:
    """Tensor name -> fragment index in [0, num_fragments); every name exactly once."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown fragment strategy {strategy!r}; expected one of {STRATEGIES}")
    groups = layer_groups(shapes) if strategy != "tensors" else {n: [n] for n in shapes}
    if not 1 <= num_fragments <= max(1, len(groups)):
        unit = "tensors" if strategy == "tensors" else "layer groups"
        raise ValueError(
            f"num_fragments must be between 1 and the number of {unit} ({len(groups)}), "
            f"got {num_fragments}"
        )
    if num_fragments == 1:
        return dict.fromkeys(shapes, 0)
    if strategy == "strided":
        num_blocks = len({block_index(n) for n in shapes} - {None})
        if num_fragments > num_blocks:
            raise ValueError(
                f"strided fragments need num_fragments <= number of blocks ({num_blocks}), "
                f"got {num_fragments}; use 'balanced'"
            )
        out = {}
        for name in shapes:
            index = block_index(name)
            out[name] = 0 if index is None else index % num_fragments
        return out
    sizes = {key: sum(max(1, _numel(shapes[n])) for n in names) for key, names in groups.items()}
    loads = [0] * num_fragments
    group_fragment = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        target = min(range(num_fragments), key=lambda p: (loads[p], p))
        group_fragment[key] = target
        loads[target] += sizes[key]
    return {name: group_fragment[key] for key, names in groups.items() for name in names}


def fragment_offsets(H: int, P: int) -> list[int]:
    """Staggered publish offsets: fragment p is offset by (p * H) // P inner steps."""
    if H < 1 or P < 1:
        raise ValueError(f"H and P must be positive, got H={H}, P={P}")
    return [(p * H) // P for p in range(P)]


def fragments_due(step: int, H: int, P: int) -> list[int]:
    """Fragments to publish after inner step `step` (1-based count of inner steps done).

    Fragment p is due when `step - offset_p` is a positive multiple of H: first at H + offset_p,
    then every H steps. With P <= H at most one fragment is due per step.
    """
    due = []
    for p, offset in enumerate(fragment_offsets(H, P)):
        since = step - offset
        if since >= H and since % H == 0:
            due.append(p)
    return due


def is_embedding(name: str) -> bool:
    """Embedding tensors (token / position embedding, tied head) are merged by weighted mean."""
    return "embed" in name


def split_by_fragment(flat: Mapping[str, Any], assignment: Mapping[str, int], p: int) -> dict:
    """The tensors of `flat` assigned to fragment `p`, in `flat`'s order."""
    missing = [name for name in flat if name not in assignment]
    if missing:
        raise ValueError(f"tensors without a fragment assignment: {missing[:5]}")
    return {name: value for name, value in flat.items() if assignment[name] == p}
