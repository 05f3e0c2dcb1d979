"""MAPS uncertainty-aware calibration (UAC): a one-sided conformal upper bound on output length.

MAPS (Zhang et al., ICML 2026, arXiv 2609.15359, §2 "UAC") turns a point prediction L̂ of a
request's output length into an upper bound L̂_up that covers the true length L with probability
at least 1 - α, whatever the predictor, as long as calibration and test requests are
exchangeable (split conformal prediction; Vovk et al. 2005, Angelopoulos & Bates 2021 §1.1):

    s_i  = max(0, L_i - L̂_i)                    one-sided score: only underestimation costs
    q_α  = the ⌈(1-α)(n+1)⌉-th smallest s_i      over n calibration requests
    L̂_up = L̂ + q_α                               P(L ≤ L̂_up) ≥ 1 - α

Why one-sided (spec §6): a two-sided |L - L̂| score also pads requests the predictor
overestimates, which wastes KV memory the dispatcher could give to other requests.

Finite-sample guarantee: with n exchangeable calibration scores and no ties, the coverage of a
new request is exactly k/(n+1), k = ⌈(1-α)(n+1)⌉, hence in [1-α, 1-α + 1/(n+1)) (Angelopoulos &
Bates 2021, Thm D.1). Ties only raise it: the lower bound always holds, the upper bound holds for
continuous scores. Ours are not continuous: every overestimated request scores exactly 0, and
lengths are integers, so empirical coverage above the upper bound is expected, not an error.
If k > n there is no finite quantile with the guarantee: q_α = +inf (n must be ≥ (1-α)/α).

The paper runs UAC online over a window of the last n = 500 completed requests (`OnlineUAC`);
the offline split (a held-out calibration set) is `conformal_quantile` on that set.

Metrics (`quality`): MAE; Acc-k = share of predictions within k tokens of the truth, |L̂ - L| ≤ k
(Acc-50 / Acc-100 as the paper's predictor table reports them, the definition of the PO-IT paper
it compares with, Zheng et al. 2023, arXiv 2305.13144 §4 [reconstructed: maps.md names the metric,
not its formula]); coverage of L̂_up; the underestimation rate P(L > L̂) without UAC.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Iterable, Sequence

import numpy as np


def conformal_rank(n: int, alpha: float) -> int:
    """k = ⌈(1-α)(n+1)⌉, the rank (1-based) of the calibration score that is q_α.

    The product is rounded to 9 decimals first, so floating point cannot push an exact integer
    over the ceiling ((1 - 0.1) * 10 must give 9, not 10).
    """
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha = {alpha}: must be in (0, 1)")
    if n < 0:
        raise ValueError(f"n = {n}: must be >= 0")
    return math.ceil(round((1.0 - alpha) * (n + 1), 9))


def min_calibration_size(alpha: float) -> int:
    """The smallest n with a finite q_α (k ≤ n)."""
    n = 1
    while conformal_rank(n, alpha) > n:
        n += 1
    return n


def conformal_quantile(residuals: Sequence[float], alpha: float) -> float:
    """q_α: the ⌈(1-α)(n+1)⌉-th smallest one-sided score s_i = max(0, r_i).

    `residuals` are signed, r_i = L_i - L̂_i (true minus predicted); clipping at 0 is monotone, so
    the k-th smallest clipped score is max(0, k-th smallest residual). Returns +inf when the
    calibration set is too small for the guarantee (k > n).
    """
    r = np.asarray(residuals, dtype=np.float64).ravel()
    if r.size and not np.all(np.isfinite(r)):
        raise ValueError("residuals contain NaN or inf")
    k = conformal_rank(r.size, alpha)
    if k > r.size:
        return math.inf
    scores = np.maximum(0.0, r)
    return float(np.partition(scores, k - 1)[k - 1])


def upper_bound(pred: float | Sequence[float], q: float) -> float | np.ndarray:
    """L̂_up = L̂ + q_α (MAPS §2, UAC)."""
    if q < 0 or math.isnan(q):
        raise ValueError(f"q = {q}: a one-sided conformal quantile is >= 0")
    if np.isscalar(pred):
        return float(pred) + q
    return np.asarray(pred, dtype=np.float64) + q


def coverage_bounds(n: int, alpha: float) -> tuple[float, float]:
    """[1-α, 1-α + 1/(n+1)]: the split-conformal coverage guarantee with n calibration points
    (the upper end assumes no ties)."""
    conformal_rank(n, alpha)  # validates
    return 1.0 - alpha, 1.0 - alpha + 1.0 / (n + 1)


# --- predictor quality ------------------------------------------------------------------------

def mae(pred: Sequence[float], true: Sequence[float]) -> float:
    p, t = _pair(pred, true)
    return float(np.mean(np.abs(p - t)))


def acc_within(pred: Sequence[float], true: Sequence[float], k: float) -> float:
    """Acc-k: the share of predictions within k tokens of the true length, |L̂ - L| ≤ k."""
    p, t = _pair(pred, true)
    return float(np.mean(np.abs(p - t) <= k))


def coverage(upper: Sequence[float], true: Sequence[float]) -> float:
    """Empirical coverage: the share of requests with L ≤ L̂_up."""
    u, t = _pair(upper, true)
    return float(np.mean(t <= u))


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion: the test-set sampling noise of an empirical
    coverage (with 150 test requests at 0.9 it is about ±0.05, wider than 1/(n_cal+1))."""
    if n < 1 or not 0 <= hits <= n:
        raise ValueError(f"need 0 <= hits <= n and n >= 1, got hits={hits}, n={n}")
    phat = hits / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def quality(pred: Sequence[float], true: Sequence[float], q: float,
            acc_tokens: Iterable[float] = (50, 100)) -> dict[str, float]:
    """MAE, Acc-k, underestimation rate without UAC, coverage (with its Wilson 95% interval)
    and worst underestimation with UAC (the numbers of MAPS §2's predictor table and UAC
    paragraph)."""
    p, t = _pair(pred, true)
    up = p + q
    hits = int(np.sum(t <= up))
    low, high = wilson_interval(hits, len(t))
    out = {"mae": mae(p, t), "underestimate_rate": float(np.mean(t > p)),
           "coverage": hits / len(t), "coverage_ci_low": low, "coverage_ci_high": high,
           "worst_underestimate": float(np.max(np.maximum(0.0, t - p))),
           "worst_underestimate_uac": float(np.max(np.maximum(0.0, t - up))),
           "mean_padding_uac": float(np.mean(up - t))}
    for k in acc_tokens:
        out[f"acc_{k:g}"] = acc_within(p, t, k)
    return out


def _pair(a: Sequence[float], b: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"need two non-empty sequences of equal length, got {x.size} and {y.size}")
    return x, y


# --- online UAC over a sliding window (the paper's deployment form) ---------------------------

class OnlineUAC:
    """One-sided split conformal over the last `window` completed requests (MAPS §2: n = 500,
    α = 0.1). `observe(L, L̂)` when a request finishes; `q` is q_α of the current window.

    `initial` seeds the window with offline calibration residuals, so the first requests of a
    run get a finite bound. While the window is too small, q is +inf (no guarantee yet): the
    dispatcher then finds no decoder that fits and falls back (see stages.maps.dispatch).
    A workload shift breaks exchangeability until the window refreshes (spec §6): log rolling
    coverage.
    """

    def __init__(self, window: int = 500, alpha: float = 0.1, initial: Iterable[float] = ()):
        if window < 1:
            raise ValueError(f"window = {window}: must be >= 1")
        conformal_rank(window, alpha)
        self.window, self.alpha = window, alpha
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        for r in initial:
            self._push(float(r))

    def _push(self, score: float) -> None:
        s = max(0.0, score)
        if not math.isfinite(s):
            raise ValueError(f"residual {score}: not finite")
        self._fifo.append(s)
        bisect.insort(self._sorted, s)
        if len(self._fifo) > self.window:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def observe(self, true_len: float, pred_len: float) -> None:
        self._push(float(true_len) - float(pred_len))

    def __len__(self) -> int:
        return len(self._fifo)

    @property
    def q(self) -> float:
        k = conformal_rank(len(self._sorted), self.alpha)
        return math.inf if k > len(self._sorted) else self._sorted[k - 1]

    def upper(self, pred_len: float) -> float:
        return pred_len + self.q
