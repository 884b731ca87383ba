"""The one place that defines the pseudo-gradient sign.

    delta = global_base - island_local

An outer optimizer then treats `delta` like a gradient: `theta <- theta - lr * delta` moves the
global parameters toward the island's. With outer SGD, lr = 1 and no momentum, applying the mean of
the islands' deltas gives exactly the average of their parameters (FedAvg); `tests/test_outer.py`
checks that, and a flipped sign fails it.
"""

from __future__ import annotations

import numpy as np


def delta(global_base, island_local):
    """`global_base - island_local` for one tensor of any array type (numpy, or jax arrays
    inside a jitted function: training/island/encode.py)."""
    return global_base - island_local


def pseudo_gradient(
    global_base: dict[str, np.ndarray], island_local: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """`global_base - island_local`, per tensor, in float32, over the keys of `island_local`."""
    missing = set(island_local) - set(global_base)
    if missing:
        raise KeyError(f"pseudo_gradient: no global base for {sorted(missing)[:3]}")
    return {
        k: delta(np.asarray(global_base[k], np.float32), np.asarray(v, np.float32))
        for k, v in island_local.items()
    }
