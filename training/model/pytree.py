"""Optimizer states as named host arrays, and back, for checkpoints and global versions."""

from __future__ import annotations

import jax
import numpy as np


def state_to_named(state, prefix: str = "") -> dict[str, np.ndarray]:
    """Leaves of any pytree as `{prefix + "0000": array, ...}` in tree order."""
    leaves = jax.tree_util.tree_leaves(state)
    return {f"{prefix}{i:04d}": np.asarray(jax.device_get(x)) for i, x in enumerate(leaves)}


def named_to_state(named: dict[str, np.ndarray], template, prefix: str = ""):
    """Rebuild a pytree shaped like `template` (a state or its `jax.eval_shape`); checks each leaf."""
    ref_leaves, treedef = jax.tree_util.tree_flatten(template)
    leaves = []
    for i, ref in enumerate(ref_leaves):
        key = f"{prefix}{i:04d}"
        x = named.get(key)
        if x is None:
            raise ValueError(f"optimizer state: missing leaf {key}")
        if tuple(x.shape) != tuple(ref.shape) or np.dtype(x.dtype) != np.dtype(ref.dtype):
            raise ValueError(
                f"optimizer state leaf {key}: got {x.shape} {x.dtype}, expected {ref.shape} {ref.dtype}"
            )
        leaves.append(x)
    return jax.tree_util.tree_unflatten(treedef, leaves)
