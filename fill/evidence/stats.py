"""The statistics of ``mlx-fill report``: exact binomial tails, Clopper-Pearson bounds,
McNemar's paired test of an agreement drop, and distribution-free bounds on a median ratio
(the verdict contract is in :mod:`mlx_fill.evidence.report`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Sequence

ALPHA = 0.05
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


# ----------------------------------------------------------------------------- exact binomial

def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (stable for large n)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    lgn = math.lgamma(n + 1)
    total = 0.0
    for i in range(k + 1):
        total += math.exp(lgn - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
    return min(1.0, total)


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return 1.0 - binom_cdf(k - 1, n, p)


def _bisect(f, lo: float, hi: float, iterations: int = 80) -> float:
    """Root of a function increasing on [lo, hi] (f(lo) <= 0 <= f(hi))."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if f(mid) > 0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def clopper_pearson_lower(successes: int, trials: int, alpha: float = ALPHA) -> float:
    """One-sided (1 - alpha) lower confidence bound on a binomial proportion."""
    if successes <= 0:
        return 0.0
    return _bisect(lambda t: binom_sf(successes, trials, t) - alpha, 0.0, 1.0)


def clopper_pearson_upper(successes: int, trials: int, alpha: float = ALPHA) -> float:
    """One-sided (1 - alpha) upper confidence bound on a binomial proportion."""
    if successes >= trials:
        return 1.0
    return _bisect(lambda t: alpha - binom_cdf(successes, trials, t), 0.0, 1.0)


# ----------------------------------------------------------------------------- verdict math

@dataclass(frozen=True)
class McNemar:
    """Paired agreement counts and the one-sided test that B's agreement is not below A's."""

    pairs: int
    both: int
    a_only: int
    b_only: int
    neither: int
    p_drop: float
    drop_lower95: float
    drop_upper95: float

    @property
    def a_rate(self) -> float:
        return (self.both + self.a_only) / self.pairs if self.pairs else 0.0

    @property
    def b_rate(self) -> float:
        return (self.both + self.b_only) / self.pairs if self.pairs else 0.0

    @property
    def drop(self) -> float:
        """Observed drop in agreement rate, A minus B."""
        return self.a_rate - self.b_rate

    @property
    def significant_drop(self) -> bool:
        return self.drop_lower95 > 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "a_rate": self.a_rate, "b_rate": self.b_rate, "drop": self.drop,
                "significant_drop": self.significant_drop}


def mcnemar_drop(a_agrees: Sequence[bool], b_agrees: Sequence[bool], alpha: float = ALPHA) -> McNemar:
    """McNemar's exact one-sided test for a drop in agreement from arm A to arm B.

    Conditional on the ``m = a_only + b_only`` discordant pairs, ``a_only ~ Binomial(m, theta)``
    and the agreement drop equals ``(2 theta - 1) m / pairs``. ``p_drop = P(X >= a_only | theta
    = 1/2)``; the drop bounds map the one-sided Clopper-Pearson bounds on theta.
    """
    if len(a_agrees) != len(b_agrees):
        raise ValueError(f"paired outcomes differ in length: {len(a_agrees)} vs {len(b_agrees)}")
    both = sum(1 for a, b in zip(a_agrees, b_agrees) if a and b)
    a_only = sum(1 for a, b in zip(a_agrees, b_agrees) if a and not b)
    b_only = sum(1 for a, b in zip(a_agrees, b_agrees) if b and not a)
    pairs = len(a_agrees)
    discordant = a_only + b_only
    if discordant == 0:
        return McNemar(pairs, both, 0, 0, pairs - both, 1.0, 0.0, 0.0)
    scale = discordant / pairs
    lower = (2 * clopper_pearson_lower(a_only, discordant, alpha) - 1) * scale
    upper = (2 * clopper_pearson_upper(a_only, discordant, alpha) - 1) * scale
    return McNemar(pairs, both, a_only, b_only, pairs - both - discordant,
                   binom_sf(a_only, discordant, 0.5), lower, upper)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of a non-empty sample."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of an empty sample")
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class RatioSummary:
    """Median of per-pair ratios B/A, its one-sided 95% bounds and the distribution.

    ``lower95``/``upper95`` are None when there are too few pairs for a distribution-free bound
    (fewer than 5 at alpha = 0.05).
    """

    n: int
    median: float
    lower95: float | None
    upper95: float | None
    quantiles: dict[str, float]

    @property
    def verdict(self) -> str:
        if self.lower95 is not None and self.lower95 > 1.0:
            return "slower"
        if self.upper95 is not None and self.upper95 < 1.0:
            return "faster"
        return "inconclusive"

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def median_bounds(values: Sequence[float], alpha: float = ALPHA) -> tuple[float | None, float | None]:
    """Distribution-free one-sided (1 - alpha) bounds on the median (sign-test order statistics).

    The upper bound is the k-th smallest value for the least k with P(Bin(n, 1/2) <= k - 1) >=
    1 - alpha; the lower bound is the k-th largest.
    """
    ordered = sorted(values)
    n = len(ordered)
    for k in range(1, n + 1):
        if binom_cdf(k - 1, n, 0.5) >= 1 - alpha:
            return ordered[n - k], ordered[k - 1]
    return None, None


def paired_ratio(a: Sequence[float], b: Sequence[float], alpha: float = ALPHA) -> RatioSummary:
    """Summarize per-pair ratios ``b[i] / a[i]`` (both strictly positive)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    if not a:
        raise ValueError("no pairs to compare")
    if any(x <= 0 for x in (*a, *b)):
        raise ValueError("wall-clock times must be positive")
    ratios = [y / x for x, y in zip(a, b)]
    lower, upper = median_bounds(ratios, alpha)
    return RatioSummary(len(ratios), statistics.median(ratios), lower, upper,
                        {f"p{int(q * 100)}": quantile(ratios, q) for q in QUANTILES})


# ----------------------------------------------------------------------------- agreement keys
