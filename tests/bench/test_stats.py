"""kiln's own t distribution and Welch test, against closed forms and printed t tables."""

from __future__ import annotations

import importlib.util
import math
import statistics

import pytest

from kiln.bench.stats import (
    BETTER,
    TOO_FEW,
    WITHIN_NOISE,
    WORSE,
    Summary,
    regularized_incomplete_beta,
    student_t_cdf,
    student_t_ppf,
    verdict,
    welch,
)

# Two-sided critical values of Student's t, as printed in standard tables (3 decimals):
# df -> (t for p = 0.10, t for p = 0.05, t for p = 0.01)
T_TABLE = {
    1: (6.314, 12.706, 63.657),
    2: (2.920, 4.303, 9.925),
    3: (2.353, 3.182, 5.841),
    5: (2.015, 2.571, 4.032),
    10: (1.812, 2.228, 3.169),
    20: (1.725, 2.086, 2.845),
    30: (1.697, 2.042, 2.750),
    120: (1.658, 1.980, 2.617),
    math.inf: (1.645, 1.960, 2.576),
}


@pytest.mark.parametrize("df", list(T_TABLE))
def test_two_sided_p_values_match_the_printed_t_table(df):
    for alpha, t in zip((0.10, 0.05, 0.01), T_TABLE[df], strict=True):
        p = 2 * (1 - student_t_cdf(t, df))
        # the table rounds t to 3 decimals; the p that moves by is at most ~0.4 % of alpha
        assert p == pytest.approx(alpha, rel=5e-3), (df, t)
        assert student_t_ppf(1 - alpha / 2, df) == pytest.approx(t, abs=6e-4), (df, alpha)


def test_cdf_matches_the_closed_forms_of_one_and_two_degrees_of_freedom():
    for t in (-30.0, -2.5, -0.7, 0.0, 0.3, 1.0, 4.2, 100.0):
        cauchy = 0.5 + math.atan(t) / math.pi  # df = 1
        assert student_t_cdf(t, 1) == pytest.approx(cauchy, abs=1e-12)
        two = 0.5 + t / (2 * math.sqrt(2 + t * t))  # df = 2
        assert student_t_cdf(t, 2) == pytest.approx(two, abs=1e-12)
    assert student_t_cdf(math.inf, 4) == 1.0 and student_t_cdf(-math.inf, 4) == 0.0


def test_incomplete_beta_identities():
    for x in (0.0, 0.01, 0.3, 0.5, 0.77, 0.999, 1.0):
        assert regularized_incomplete_beta(x, 1, 1) == pytest.approx(x, abs=1e-13)
        assert regularized_incomplete_beta(x, 3.5, 1) == pytest.approx(x ** 3.5, abs=1e-13)
        assert regularized_incomplete_beta(x, 1, 2.5) == pytest.approx(1 - (1 - x) ** 2.5, abs=1e-13)
        # symmetry I_x(a, b) = 1 - I_{1-x}(b, a), on both sides of the fraction's switch point
        assert regularized_incomplete_beta(x, 7.0, 0.5) == pytest.approx(
            1 - regularized_incomplete_beta(1 - x, 0.5, 7.0), abs=1e-12)
    with pytest.raises(ValueError):
        regularized_incomplete_beta(1.5, 1, 1)


def test_p_values_agree_with_scipy_where_it_is_installed():
    """The printed table above is the reference; scipy, when present, checks a finer grid too."""
    assert 2 * (1 - student_t_cdf(2.228, 10)) == pytest.approx(0.05, rel=5e-3)
    if importlib.util.find_spec("scipy") is None:
        return  # scipy is no kiln dependency; the tabulated checks above always run
    from scipy import stats as scipy_stats

    for df in (1, 1.5, 2, 3.7, 9, 25.3, 200):
        for t in (-5, -1.3, 0, 0.4, 2, 7.5):
            assert student_t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), abs=1e-10)


def test_summary_mean_median_and_cv():
    s = Summary.of([10.0, 12.0, 14.0, 100.0])
    assert (s.n, s.mean, s.median, s.min, s.max) == (4, 34.0, 13.0, 10.0, 100.0)
    assert s.stdev == pytest.approx(statistics.stdev([10, 12, 14, 100]))
    assert s.cv == pytest.approx(s.stdev / 34.0)
    assert Summary.of([5.0]).cv is None and Summary.of([]).n == 0


def test_welch_statistic_and_degrees_of_freedom_by_hand():
    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 4.0, 5.0, 6.0, 7.5]
    # variances 2.5 and 3.05; squared standard errors 0.5 and 0.61
    test = welch(a, b)
    assert test.t == pytest.approx(-2.1 / math.sqrt(1.11))
    assert test.df == pytest.approx(1.11 ** 2 / (0.5 ** 2 / 4 + 0.61 ** 2 / 4))
    assert test.p == pytest.approx(2 * student_t_cdf(test.t, test.df))
    half = student_t_ppf(0.975, test.df) * math.sqrt(1.11)
    assert (test.ci_low, test.ci_high) == pytest.approx((-2.1 - half, -2.1 + half))
    # p crosses 0.05 exactly where the interval stops containing 0
    assert (test.p < 0.05) == (test.ci_high < 0 or test.ci_low > 0)


def test_verdict_direction_follows_the_metric():
    fast, slow = [100.0, 102.0, 98.0, 101.0], [80.0, 82.0, 79.0, 81.0]
    assert verdict(fast, slow, higher_is_better=True).verdict == BETTER
    assert verdict(slow, fast, higher_is_better=True).verdict == WORSE
    assert verdict(fast, slow, higher_is_better=False).verdict == WORSE  # e.g. a longer TTFT
    result = verdict(fast, slow, higher_is_better=True)
    assert result.change == pytest.approx((100.25 - 80.5) / 80.5)
    assert result.change_low < result.change < result.change_high


def test_a_small_gain_with_large_noise_is_within_noise():
    # +2 % with a CV around 5 %: not a win (the case Genesis refuses to count)
    a = [102.0 * f for f in (0.95, 1.05, 0.93, 1.07, 1.0)]
    b = [100.0 * f for f in (1.04, 0.96, 1.06, 0.94, 1.0)]
    result = verdict(a, b, higher_is_better=True)
    assert result.verdict == WITHIN_NOISE and result.p > 0.05
    assert result.change_low < 0 < result.change_high


def test_too_few_samples_and_constant_samples():
    assert verdict([1.0], [2.0, 3.0], True).verdict == TOO_FEW
    assert verdict([5.0, 5.0], [5.0, 5.0], True).verdict == WITHIN_NOISE
    assert verdict([6.0, 6.0], [5.0, 5.0], True).verdict == BETTER
