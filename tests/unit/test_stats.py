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
    (-1.0, 2.0, 1, 5.0, 0),      # includes 0, excludes the paper's +5: inconclusive, smaller
    (-3.0, -1.0, 1, 5.0, -1),    # excludes 0 the other way (and the paper's effect)
    (math.nan, math.nan, 1, None, 0),
])
def test_verdict_rule(low, high, direction, paper, expected):
    c = stats.claim_from_ci((low + high) / 2, low, high, n=3, direction=direction,
                            paper_effect=paper, mde_value=1.0)
    assert c.verdict == stats.verdict(low, high, direction) == expected
    assert c.excludes_paper_effect == (paper is not None and not low <= paper <= high)
    assert c.sentence().endswith("(outside the CI)") == (expected == 0 and paper == 5.0)


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


def test_spearman_ties_nan_and_length_by_hand():
    # ranks x = 1..5, y = [1, 2, 3, 5, 4]: d^2 sums to 2, rho = 1 - 6*2 / (5*24) = 0.9
    assert stats.spearman([1, 2, 3, 4, 5], [10, 20, 30, 50, 40]) == pytest.approx(0.9)
    # y ranks [1.5, 1.5, 3, 4]: Pearson of the ranks = 3 / sqrt(10)
    assert stats.spearman([1, 2, 3, 4], [0, 0, 1, 2]) == pytest.approx(3 / math.sqrt(10))
    assert stats.ranks([10.0, 30.0, 20.0, 20.0]) == [1.0, 4.0, 2.5, 2.5]
    with pytest.raises(ValueError, match="2 x values but 1 y values"):
        stats.spearman([1, 2], [1])


def test_claim_by_key_pairs_by_seed_and_drops_undefined_pairs():
    # seeds listed in another order on each side: paired by key, d = [2, 3, 4] as in
    # test_paired_t_interval_by_hand; seed 9 has no value on one side and is dropped
    c = stats.claim_by_key({2: 7.0, 0: 3.0, 1: 5.0, 9: math.nan},
                           {0: 1.0, 1: 2.0, 2: 3.0, 9: 4.0}, paper_effect=2.0)
    assert (c.diff, c.n, c.verdict) == (3.0, 3, 1)
    assert c.low == pytest.approx(3 - 2.484138, abs=1e-5)
    with pytest.raises(ValueError, match=r"on one side only: \[3\]"):
        stats.claim_by_key({0: 1.0, 3: 1.0}, {0: 1.0})
    none = stats.claim_by_key({0: math.nan}, {0: 1.0}, direction=-1)
    assert none.verdict == 0 and none.n == 0 and math.isnan(none.diff)


def test_claim_by_key_relative_to_the_baseline_mean():
    # baseline mean 2: d = [2, 3, 4] / 2 = [1, 1.5, 2]: mean 1.5, CI 1.5 +- 2.484138 / 2
    c = stats.claim_by_key({0: 3.0, 1: 5.0, 2: 7.0}, {0: 1.0, 1: 2.0, 2: 3.0}, relative=True,
                           paper_effect=0.5)
    assert c.diff == pytest.approx(1.5)
    assert (c.low, c.high) == (pytest.approx(1.5 - 1.242069, abs=1e-5),
                               pytest.approx(1.5 + 1.242069, abs=1e-5))
    assert c.verdict == 1 and c.paper_effect == 0.5
    # a zero baseline has no relative change: inconclusive, whatever the paper says
    zero = stats.claim_by_key({0: 0.0, 1: 1.0}, {0: 0.0, 1: 0.0}, relative=True,
                              paper_effect=-0.5)
    assert zero.verdict == 0 and zero.n == 2 and math.isnan(zero.low)


def test_claim_metrics_round_trip_without_nan():
    c = stats.claim([3, 5, 7], [1, 2, 3], paper_effect=2.0)
    m = stats.claim_metrics(c, "claim/acc")
    assert m["claim/acc/paper_effect"] == 2.0 and m["claim/acc/verdict"] == 1.0
    assert stats.read_claim(m, "claim/acc") == c
    one = stats.claim([0.5], [0.25])                 # one pair: no CI, no MDE, no paper effect
    m = stats.claim_metrics(one, "x")
    assert set(m) == {"x/diff", "x/pairs", "x/verdict"}
    back = stats.read_claim(m, "x")
    assert back.diff == 0.25 and math.isnan(back.low) and back.paper_effect is None
    assert back.sentence() == "**inconclusive**: +0.250 [n/a, n/a] over 1 pairs; MDE n/a"
    assert stats.read_claim({}, "x") is None


def test_identical_differences_get_no_interval_and_no_verdict():
    # hsir at cpu: h_grpo one prompt (0.01) below grpo on each of 3 seeds; the t interval of
    # three equal differences is a point, which would call the difference certain
    c = stats.claim([0.42, 0.43, 0.42], [0.43, 0.44, 0.43], direction=1, paper_effect=0.05)
    assert c.diff == pytest.approx(-0.01)
    assert math.isnan(c.low) and math.isnan(c.high)
    assert c.verdict == 0
    mean, low, high = stats.paired_ci([1.0, 2.0], [0.5, 1.5], method="bootstrap")
    assert mean == 0.5 and math.isnan(low) and math.isnan(high)
    # six equal-signed pairs pass the exact sign test (2 * 0.5**6 < 0.05): the point stands
    assert stats.paired_ci([1.0] * 6, [0.5] * 6) == (0.5, 0.5, 0.5)
    assert math.isnan(stats.paired_ci([1.0] * 5, [0.5] * 5)[1])
    # one differing pair is enough spread for an interval
    assert stats.claim([0.42, 0.43, 0.44], [0.43, 0.44, 0.43]).low < 0


@pytest.mark.parametrize("low, high, direction, expected", [
    (-0.005, 0.020, 1, 1),      # any loss is under the 0.01 margin: does not fall
    (0.002, 0.020, 1, 1),       # a gain holds too
    (-0.030, -0.015, 1, -1),    # the whole CI is a loss beyond the margin
    (-0.020, 0.005, 1, 0),      # straddles -margin
    (-0.010, 0.005, 1, 0),      # touching -margin is not above it
    (-0.020, 0.005, -1, 1),     # lower is better: mirrored, every rise is under +0.01
    (0.015, 0.030, -1, -1),     # lower is better: a rise beyond the margin
    (math.nan, math.nan, 1, 0),
])
def test_noninferiority_rule_by_hand(low, high, direction, expected):
    assert stats.noninferiority(low, high, 0.01, direction) == expected


def test_noninferiority_refuses_bad_margin_and_direction():
    with pytest.raises(ValueError, match="margin"):
        stats.noninferiority(-0.1, 0.1, -0.01)
    with pytest.raises(ValueError, match="direction"):
        stats.noninferiority(-0.1, 0.1, 0.01, direction=0)
