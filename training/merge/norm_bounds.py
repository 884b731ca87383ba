"""The merge's norm bounds: how large a contribution may be (`clip_limit`: k x the running
median of merged norms, `norm_verdict`: clip or quarantine), how many merged norms a fragment
keeps (`NORM_HISTORY`), and how large a restored outer state may be
(`check_outer_state_bound`). Pure functions, no store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from training.config.experiment import OuterConfig
from training.merge import stream as merge_stream
from training.protocol import claims

NORM_HISTORY = 64  # merged norms kept per fragment for the clipping median
QUARANTINE_FACTOR = 1000.0  # a norm over this x the clip limit is quarantined, not clipped

# A restored outer state's norm over the bound its chain's merged norms allow: refused (a
# promotion, replayed instead). The momentum is a decaying sum of combined updates, each at
# most the largest merged norm; the margin covers older, larger norms that left the history.
STATE_NORM_MARGIN = 100.0


def check_outer_state_bound(
    outer: OuterConfig, tensors: Mapping[str, np.ndarray], norms: Sequence[Any]
) -> None:
    """ValueError when an outer state read from the bucket (a promotion's) is larger than its
    version's history allows: each of its momentum and Delayed Nesterov buffer norms at most
    STATE_NORM_MARGIN x the largest merged norm of the version's history / (1 - momentum)
    (times the delay period for the buffer, which sums that many updates). No bound before a
    norm is recorded (a version 0 state is zeros)."""
    recorded = [float(n[1]) for n in norms if math.isfinite(float(n[1]))]
    if not recorded:
        return
    beta = min(outer.momentum, 0.999)
    bound = STATE_NORM_MARGIN * max(recorded) / (1.0 - beta)
    for kind in ("momentum", "buffer"):
        names = [n for n in tensors if n.startswith(f"{kind}/")]
        if not names:
            continue
        norm = merge_stream.norm_of(tensors, names)
        limit = bound * (outer.delay_period or 64 if kind == "buffer" else 1)
        if not norm <= limit:
            raise ValueError(
                f"outer state {kind} norm {norm:.4g} is over the {limit:.4g} its version's "
                "merged norms allow"
            )


def clip_limit(outer: OuterConfig, norms: Sequence[Any]) -> float | None:
    """k x the running median of merged norms (entries [island, norm]: one vote per island,
    claims.norm_median), or None until four norms are known."""
    return outer.clip_multiplier * claims.norm_median(norms) if len(norms) >= 4 else None


def norm_verdict(
    outer: OuterConfig, norm: float, limit: float | None, params_norm: float
) -> tuple[float, str | None]:
    """(scale to apply, reason to quarantine or None) for a contribution of norm `norm`.

    Over the clip limit it is scaled down to it; over 1000x the limit and over k x the
    parameters' norm it is quarantined (a norm within k x the parameters' own norm is clipped,
    never quarantined: a median dragged down by one island's tiny norms cannot reject everyone
    else). Until the median exists the bound is 1000 x k x the fragment parameters' norm.
    """
    if limit is not None and limit > 0:
        plausible = norm <= outer.clip_multiplier * params_norm
        if not norm <= QUARANTINE_FACTOR * limit and not plausible:
            return 0.0, f"norm {norm:.3g} is over 1000x the clip limit {limit:.3g}"
        return (limit / norm if norm > limit else 1.0), None
    bound = QUARANTINE_FACTOR * outer.clip_multiplier * params_norm
    if params_norm > 0 and not norm <= bound:
        return 0.0, (
            f"norm {norm:.3g} is over 1000x the bound {bound / QUARANTINE_FACTOR:.3g} "
            "(k x the parameters' norm; no running median yet)"
        )
    return 1.0, None
