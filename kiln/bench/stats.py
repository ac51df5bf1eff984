"""Summaries of samples and the Welch t-test that decides an A/B verdict, in pure Python.

Public API:
    Summary.of(values) -> Summary      n, mean, median, stdev, cv (stdev / mean), min, max
    welch(a, b, confidence) -> Welch   t, df (Welch-Satterthwaite), two-sided p, and the
                                       confidence interval of mean(a) - mean(b)
    verdict(a, b, higher_is_better, confidence) -> Comparison
                                       "better" / "worse" (for a, against b) / "within noise"
                                       / "too few samples"
    student_t_cdf(t, df), student_t_ppf(q, df), regularized_incomplete_beta(x, a, b)

The t distribution comes from the regularized incomplete beta function, evaluated with its
continued fraction (modified Lentz), so kiln needs neither scipy nor numpy at run time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

BETTER, WORSE, WITHIN_NOISE, TOO_FEW = "better", "worse", "within noise", "too few samples"

_EPS = 1e-15
_TINY = 1e-300


# -- the t distribution -----------------------------------------------------------------------


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b), converging for x < (a + 1) / (a + b + 2)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    fraction = d
    for m in range(1, 10_000):
        # the even step d_{2m}, then the odd step d_{2m+1} of the fraction's coefficients
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            fraction *= c * d
        if abs(c * d - 1.0) < _EPS:
            return fraction
    raise ArithmeticError(f"incomplete beta did not converge (x={x}, a={a}, b={b})")


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) for 0 <= x <= 1 and a, b > 0."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x={x} is outside [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(x, a, b) / a
    # the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction in its fast region
    return 1.0 - front * _beta_continued_fraction(1.0 - x, b, a) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (``math.inf``: the normal)."""
    if math.isnan(t):
        return math.nan
    if math.isinf(df):
        return 0.5 * math.erfc(-t / math.sqrt(2.0))
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_incomplete_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t > 0 else tail


def student_t_ppf(q: float, df: float) -> float:
    """The t with P(T <= t) = q (bisection on the CDF; plenty for confidence intervals)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile {q} is outside (0, 1)")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -student_t_ppf(1.0 - q, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < q:
        low, high = high, high * 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if student_t_cdf(middle, df) < q:
            low = middle
        else:
            high = middle
        if high - low < 1e-12 * max(1.0, high):
            break
    return (low + high) / 2.0


# -- summaries -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float | None
    median: float | None
    stdev: float | None  # sample standard deviation (n - 1)
    cv: float | None  # stdev / mean: the run-to-run noise, as a fraction of the mean
    min: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        values = [float(v) for v in values if v is not None]
        if not values:
            return cls(0, None, None, None, None, None, None)
        mean = statistics.fmean(values)
        stdev = statistics.stdev(values) if len(values) > 1 else None
        cv = stdev / mean if stdev is not None and mean != 0 else None
        return cls(len(values), mean, statistics.median(values), stdev, cv, min(values), max(values))

    def to_json(self) -> dict:
        return asdict(self)


# -- Welch's t-test ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Welch:
    t: float
    df: float
    p: float  # two-sided
    difference: float  # mean(a) - mean(b)
    ci_low: float  # confidence interval of the difference
    ci_high: float


def welch(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Welch:
    """Welch's unequal-variances t-test of mean(a) = mean(b); each side needs 2 samples."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's test needs at least 2 samples on each side")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence} is outside (0, 1)")
    mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
    se2_a, se2_b = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    difference = mean_a - mean_b
    se2 = se2_a + se2_b
    if se2 == 0.0:  # two constant samples: equal means are no difference, unequal ones certain
        p = 1.0 if difference == 0.0 else 0.0
        t = 0.0 if difference == 0.0 else math.copysign(math.inf, difference)
        return Welch(t, math.inf, p, difference, difference, difference)
    t = difference / math.sqrt(se2)
    df = se2 * se2 / (se2_a * se2_a / (len(a) - 1) + se2_b * se2_b / (len(b) - 1))
    p = min(1.0, 2.0 * student_t_cdf(-abs(t), df))
    half_width = student_t_ppf(0.5 + confidence / 2.0, df) * math.sqrt(se2)
    return Welch(t, df, p, difference, difference - half_width, difference + half_width)


@dataclass(frozen=True)
class Comparison:
    verdict: str  # BETTER / WORSE / WITHIN_NOISE / TOO_FEW, for a against b
    confidence: float
    p: float | None
    df: float | None
    change: float | None  # (mean(a) - mean(b)) / mean(b), a fraction
    change_low: float | None  # the confidence interval of that change
    change_high: float | None

    def to_json(self) -> dict:
        return asdict(self)


def verdict(a: Sequence[float], b: Sequence[float], higher_is_better: bool, confidence: float = 0.95) -> Comparison:
    """Is ``a`` better or worse than ``b`` at ``confidence``, or is the difference within noise?"""
    if len(a) < 2 or len(b) < 2:
        return Comparison(TOO_FEW, confidence, None, None, None, None, None)
    test = welch(a, b, confidence)
    base = statistics.fmean(b)

    def relative(value: float) -> float | None:
        return value / base if base else None

    if test.p < 1.0 - confidence:
        a_higher = test.difference > 0
        outcome = BETTER if a_higher == higher_is_better else WORSE
    else:
        outcome = WITHIN_NOISE
    return Comparison(outcome, confidence, test.p, test.df, relative(test.difference),
                      relative(test.ci_low), relative(test.ci_high))
