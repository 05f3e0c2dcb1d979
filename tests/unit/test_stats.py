"""stages/core/stats.py on hand-computed values: spreads, ranks, paired CIs, MDE, the claim rule."""

from __future__ import annotations

import math

import pytest

from stages.core import stats


def test_mean_std_is_population_std_over_finite_values():
    m, s = stats.mean_std([1.0, 2.0, 3.0, math.nan])
    assert m == 2.0 and s == pytest.approx(math.sqrt(2 / 3))
    assert all(math.isnan(v) for v in stats.mean_std([math.nan]))


def test_spearman_on_hand_ranked_values():
    # y ranks [1, 2, 4, 3]; Pearson of [1..4] with them: cov 4 / sqrt(5 * 5) = 0.8
    assert stats.spearman([1, 2, 3, 4], [10, 20, 30, 25]) == pytest.approx(0.8)
    assert stats.ranks([5, 1, 5]) == [2.5, 1.0, 2.5]  # ties share their average rank
    assert math.isnan(stats.spearman([1, 2, 3], [7, 7, 7]))  # constant side
    assert stats.spearman([1, 2, math.nan, 3], [1, 2, 9, 3]) == pytest.approx(1.0)


def test_paired_t_interval_by_hand():
    # d = [2, 3, 4]: mean 3, sd 1, t_{0.975,2} = 4.302653 -> half-width 4.302653 / sqrt(3)
    diff, lo, hi = stats.paired_ci([3, 5, 7], [1, 2, 3])
    assert diff == 3.0
    assert lo == pytest.approx(3 - 2.484138, abs=1e-5)
    assert hi == pytest.approx(3 + 2.484138, abs=1e-5)
    # MDE at 80% power: (t_{0.975,2} + t_{0.8,2}) * sd / sqrt(n) = (4.302653 + 1.060660) / sqrt(3)
    assert stats.mde([2, 3, 4]) == pytest.approx(3.096509, abs=1e-5)


def test_paired_bootstrap_of_constant_differences_is_that_difference():
    diff, lo, hi = stats.paired_ci([1.0] * 20, [0.75] * 20, method="bootstrap", draws=200)
    assert (diff, lo, hi) == (0.25, 0.25, 0.25)


def test_paired_ci_refuses_unpaired_input():
    with pytest.raises(ValueError, match="equally long"):
        stats.paired_ci([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="method"):
        stats.paired_ci([1.0, 2.0], [1.0, 0.0], method="z")  # type: ignore[arg-type]


@pytest.mark.parametrize("low, high, direction, paper, expected", [
    (0.5, 5.5, 1, None, 1),      # excludes 0 in the paper's direction
    (-3.0, -1.0, 1, None, -1),   # excludes 0 the other way
    (-3.0, -1.0, -1, None, 1),   # the paper says lower: reproduced
    (-1.0, 2.0, 1, None, 0),     # includes 0: inconclusive
    (-1.0, 2.0, 1, 1.5, 0),      # includes the paper's effect too
    (-1.0, 2.0, 1, 5.0, -1),     # includes 0 but excludes the paper's +5: contradicted
    (math.nan, math.nan, 1, None, 0),
])
def test_verdict_rule(low, high, direction, paper, expected):
    assert stats.verdict(low, high, direction, paper) == expected


def test_claim_end_to_end_and_its_metrics():
    c = stats.claim([3, 5, 7], [1, 2, 3], paper_effect=2.0)
    assert c.verdict == 1 and c.name == "reproduced" and c.n == 3
    m = c.metrics("acc")
    assert m["acc/verdict"] == 1.0 and m["acc/pairs"] == 3.0 and m["acc/diff"] == 3.0
    back = stats.Claim.from_metrics(m, "acc", paper_effect=2.0)
    assert back == c
    assert c.sentence("{:+.2f}") == ("**reproduced**: +3.00 [+0.52, +5.48] over 3 pairs; "
                                     "MDE 3.10; paper: +2.00")
    assert stats.Claim.from_metrics({}, "acc") is None


def test_check_budgets_names_arm_and_key():
    stats.check_budgets({"a": {"rounds": 3}, "b": {"rounds": 3}}, ["rounds"])
    with pytest.raises(ValueError, match=r"arm 'b' ran with rounds = 4 but 'a' with 3"):
        stats.check_budgets({"a": {"rounds": 3}, "b": {"rounds": 4}}, ["rounds"])
