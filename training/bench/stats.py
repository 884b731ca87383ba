"""Statistics for benchmarks over seeds, and the config diff that says what a comparison varies.

- `mean_std(xs)`: mean and sample standard deviation (ddof = 1; 0.0 for one value).
- `paired_interval(a, b)`: the mean of the paired differences a_i - b_i with a two-sided
  Student-t confidence interval, `mean +- t_{(1+c)/2, n-1} * sd / sqrt(n)` (no interval for n < 2).
- `relative_interval(a, b)`: the same over the per-pair relative differences a_i / b_i - 1, in %.
- `config_diff(a, b, ignore)`: the dotted fields where two configs differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from scipy import stats as _scipy_stats


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    if n == 0:
        raise ValueError("mean_std of no values")
    mean = math.fsum(xs) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))


@dataclass(frozen=True)
class Interval:
    mean: float
    sd: float
    n: int
    lo: float | None  # None when n < 2: one pair has no spread to estimate
    hi: float | None
    confidence: float

    def to_dict(self) -> dict:
        return asdict(self)


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"t_quantile needs df >= 1, got {df}")
    return float(_scipy_stats.t.ppf(p, df))


def interval(xs: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of `xs` with a two-sided t-interval (the differences of paired runs)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    mean, sd = mean_std(xs)
    n = len(xs)
    if n < 2:
        return Interval(mean, sd, n, None, None, confidence)
    half = t_quantile((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean, sd, n, mean - half, mean + half, confidence)


def paired_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of a_i - b_i over pairs (same seed), with its t-interval."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    return interval([x - y for x, y in zip(a, b, strict=True)], confidence)


def relative_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of 100 * (a_i / b_i - 1) over pairs, in percent, with its t-interval."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    return interval([100.0 * (x / y - 1.0) for x, y in zip(a, b, strict=True)], confidence)


def flatten(obj, prefix: str = "") -> dict:
    """Nested dicts as {"a.b.c": leaf}; lists are leaves."""
    if not isinstance(obj, dict):
        return {prefix: obj}
    out = {}
    for key, value in obj.items():
        out.update(flatten(value, f"{prefix}{key}." if isinstance(value, dict) else prefix + key))
        if isinstance(value, dict) and not value:
            out[prefix + key] = {}
    return out


def config_diff(a: dict, b: dict, ignore: Iterable[str] = ()) -> dict[str, tuple]:
    """{dotted field: (value in a, value in b)} for every field where the configs differ."""
    fa, fb = flatten(a), flatten(b)
    skip = set(ignore)
    keys = sorted((fa.keys() | fb.keys()) - skip)
    return {k: (fa.get(k), fb.get(k)) for k in keys if fa.get(k) != fb.get(k)}


def format_diff(diff: dict[str, tuple]) -> str:
    """`inner.lr 0.002 vs 0.003; inner.dylu true vs false` (empty string: no difference)."""

    def show(v) -> str:
        if isinstance(v, bool):
            return str(v).lower()
        return f"{v:g}" if isinstance(v, float) else str(v)

    return "; ".join(f"{k} {show(x)} vs {show(y)}" for k, (x, y) in diff.items())
