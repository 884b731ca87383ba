"""The one place that defines the pseudo-gradient sign.

    delta = global_base - island_local

An outer optimizer then treats `delta` like a gradient: `theta <- theta - lr * delta` moves the
global parameters toward the island's. With outer SGD, lr = 1 and no momentum, applying the mean of
the islands' deltas gives exactly the average of their parameters (FedAvg); `tests/test_outer.py`
checks that, and a flipped sign fails it.
"""

from __future__ import annotations


def delta(global_base, island_local):
    """`global_base - island_local` for one tensor of any array type (numpy, or jax arrays
    inside a jitted function: training/island/encode.py)."""
    return global_base - island_local
