"""MAPS UAC: the one-sided conformal quantile on hand-made residuals, its finite-sample coverage,
the online window, the quality metrics and the spec's noise-model predictor."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stages.maps.predictor import NOISE_LEVELS, noise_predictions
from stages.maps.uac import (OnlineUAC, acc_within, conformal_quantile, conformal_rank,
                             coverage, coverage_bounds, mae, min_calibration_size, quality,
                             upper_bound, wilson_interval)

# r_i = L_i - L̂_i; one-sided scores max(0, r) sorted: 0 0 0 2 4 5 7 9 12 20   (n = 10)
RESIDUALS = [5, -3, 12, 0, 7, 2, -1, 9, 4, 20]


@pytest.mark.parametrize("alpha, k, q", [
    (0.2, 9, 12.0),     # ceil(0.8 * 11) = ceil(8.8) = 9  -> 9th smallest score
    (0.1, 10, 20.0),    # ceil(0.9 * 11) = ceil(9.9) = 10 -> the largest
    (0.5, 6, 5.0),      # ceil(0.5 * 11) = ceil(5.5) = 6
    (0.75, 3, 0.0),     # ceil(0.25 * 11) = 3: the 3rd smallest is a clipped negative residual
])
def test_conformal_quantile_hand_values(alpha, k, q):
    assert conformal_rank(len(RESIDUALS), alpha) == k
    assert conformal_quantile(RESIDUALS, alpha) == q


def test_one_sided_score_ignores_overestimates():
    # large overestimates (r < 0) inflate a two-sided |r| score but not max(0, r):
    # one-sided sorted 0 0 0 1 2 3 4 5 6 7 -> 9th = 6; two-sided 1 .. 7 30 40 50 -> 9th = 40
    r = [-50, -40, -30, 1, 2, 3, 4, 5, 6, 7]
    assert conformal_quantile(r, 0.2) == 6.0
    assert float(np.sort(np.abs(r))[conformal_rank(10, 0.2) - 1]) == 40.0


def test_too_few_calibration_points_give_an_infinite_bound():
    assert conformal_rank(10, 0.05) == 11           # ceil(0.95 * 11) = ceil(10.45)
    assert conformal_quantile(RESIDUALS, 0.05) == math.inf
    assert conformal_quantile([], 0.1) == math.inf
    assert min_calibration_size(0.1) == 9          # ceil(0.9 * 10) = 9 <= 9
    assert min_calibration_size(0.2) == 4          # ceil(0.8 * 5) = 4


def test_rank_is_not_pushed_up_by_floating_point():
    # (1 - 0.7) * 10 = 3.0000000000000004 in floating point; the rank is exactly 3
    assert conformal_rank(9, 0.7) == 3
    assert conformal_quantile(list(range(9)), 0.7) == 2.0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="alpha"):
        conformal_quantile(RESIDUALS, 1.0)
    with pytest.raises(ValueError, match="NaN"):
        conformal_quantile([1.0, float("nan")], 0.1)
    with pytest.raises(ValueError, match="q ="):
        upper_bound(10.0, -1.0)


def test_upper_bound_and_coverage_bounds():
    assert upper_bound(10.0, 12.0) == 22.0
    assert upper_bound([10, 20], 12.0).tolist() == [22.0, 32.0]
    lo, hi = coverage_bounds(10, 0.2)
    assert lo == pytest.approx(0.8) and hi == pytest.approx(0.8 + 1 / 11)


def test_coverage_is_k_over_n_plus_one_on_exchangeable_continuous_data():
    """Split conformal: with continuous scores, P(L ≤ L̂ + q) = k/(n+1), inside the bounds."""
    rng = np.random.default_rng(0)
    n, alpha, trials = 19, 0.1, 4000
    k = conformal_rank(n, alpha)                     # ceil(0.9 * 20) = 18
    lo, hi = coverage_bounds(n, alpha)
    hits = []
    for _ in range(trials):
        r = rng.normal(5.0, 3.0, n + 1)              # all positive-ish: few ties at 0
        q = conformal_quantile(r[:n], alpha)
        hits.append(r[n] <= q)
    rate = float(np.mean(hits))
    se = math.sqrt(0.9 * 0.1 / trials)
    assert rate == pytest.approx(k / (n + 1), abs=4 * se)
    assert lo - 4 * se <= rate <= hi + 4 * se


def test_online_window_keeps_the_last_n_scores():
    uac = OnlineUAC(window=3, alpha=0.5)             # k = ceil(0.5 * 4) = 2
    assert uac.q == math.inf                         # empty: no guarantee yet
    for true, pred in [(10, 4), (10, 12), (10, 1)]:  # scores 6, 0, 9
        uac.observe(true, pred)
    assert uac.q == 6.0                              # sorted 0 6 9 -> 2nd
    uac.observe(10, 10)                              # 6 leaves the window: 0 9 0
    assert len(uac) == 3 and uac.q == 0.0
    assert uac.upper(50.0) == 50.0
    seeded = OnlineUAC(window=500, alpha=0.2, initial=RESIDUALS)
    assert seeded.q == conformal_quantile(RESIDUALS, 0.2) == 12.0


def test_quality_metrics_hand_values():
    pred, true = [100, 150, 40, 300], [120, 100, 45, 80]
    # errors 20, 50, 5, 220 -> MAE 73.75; within 50: 3 of 4; within 100: 3 of 4
    assert mae(pred, true) == 73.75
    assert acc_within(pred, true, 50) == 0.75 and acc_within(pred, true, 10) == 0.25
    m = quality(pred, true, q=10.0, acc_tokens=[50, 100])
    assert m["acc_50"] == 0.75 and m["acc_100"] == 0.75
    assert m["underestimate_rate"] == 0.5            # 120 > 100 and 45 > 40
    assert m["coverage"] == coverage([110, 160, 50, 310], true) == 0.75   # 120 > 110
    assert m["worst_underestimate"] == 20.0 and m["worst_underestimate_uac"] == 10.0
    # Wilson 95% interval of 3 successes in 4: (0.3006, 0.9544), the textbook value
    assert (m["coverage_ci_low"], m["coverage_ci_high"]) == pytest.approx((0.3006, 0.9544), abs=1e-4)
    with pytest.raises(ValueError, match="equal length"):
        mae([1, 2], [1])
    assert wilson_interval(0, 10)[0] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("level, want_mae, want_acc100", [("sp7b", 56, 0.85),
                                                          ("sp160m", 92.2, 0.65)])
def test_noise_levels_match_the_papers_predictor_quality(level, want_mae, want_acc100):
    """On the reference lengths (lognormal, median 100, σ 1) the two levels reproduce the
    paper's SP-7B / SP-160M MAE and Acc-100 (maps.md §2 table) within a few percent."""
    rng = np.random.default_rng(1)
    lengths = np.maximum(1, np.round(rng.lognormal(math.log(100), 1.0, 50_000)))
    pred = noise_predictions(lengths, level, seed=2)
    assert pred.min() >= 1.0
    assert mae(pred, lengths) == pytest.approx(want_mae, rel=0.05)
    assert acc_within(pred, lengths, 100) == pytest.approx(want_acc100, abs=0.03)
    assert np.array_equal(pred, noise_predictions(lengths, level, seed=2))   # seeded
    assert set(NOISE_LEVELS) == {"sp7b", "sp160m"}
    with pytest.raises(ValueError, match="noise level"):
        noise_predictions(lengths, "sp13b")
