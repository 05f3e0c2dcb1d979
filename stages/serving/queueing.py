"""Queueing theory the simulator is checked against (issue check 1), as small pure functions.

Notation: arrival rate lambda, service time S with moments E[S], E[S^2], load rho = lambda E[S]
(< 1 for a stable queue), mean wait in queue W_q, mean time in system (sojourn) T = W_q + E[S].

- M/M/1 (exponential service, mu = 1/E[S]):  W_q = rho / (mu - lambda),  T = 1 / (mu - lambda)
- M/D/1 (deterministic service s):           W_q = rho s / (2 (1 - rho))
- M/G/1, Pollaczek-Khinchine mean wait:      W_q = lambda E[S^2] / (2 (1 - rho))
  (M/M/1 and M/D/1 are its cases E[S^2] = 2 E[S]^2 and E[S^2] = s^2.)
- M/G/1 processor sharing (every job in service at rate 1/n): T = E[S] / (1 - rho), whatever
  the service distribution (insensitivity; Kleinrock, Queueing Systems vol. 2, sec. 4.4).
- Little's law: L = lambda W, for any queue and any discipline (time averages on a sample
  path; exact when every customer arrives and leaves within the horizon).
- Kleinrock's conservation law for a work-conserving, non-preemptive M/G/1 whose discipline
  does not use the service times' realisations beyond ordering (FCFS, SJF, priorities):
      sum_p rho_p W_p = rho W_0 / (1 - rho),   W_0 = lambda E[S^2] / 2   (mean residual work)
  The load-weighted wait is the same for every such discipline; SJF only redistributes it.
  Over a sample path, sum_p rho_p W_p is estimated by (1/T) sum_j S_j W_j.

Statistics: `batch_means_ci` (one long run cut into contiguous batches, the t interval over
batch means; batches much longer than the queue's relaxation time are close to independent).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def _stable(lam: float, es: float) -> float:
    if lam < 0 or es <= 0:
        raise ValueError(f"need lambda >= 0 and E[S] > 0, got lambda={lam}, E[S]={es}")
    rho = lam * es
    if rho >= 1:
        raise ValueError(f"unstable queue: rho = lambda E[S] = {rho:.4g} >= 1")
    return rho


def mm1_wait(lam: float, mu: float) -> float:
    """M/M/1 mean wait in queue: rho / (mu - lambda)."""
    rho = _stable(lam, 1.0 / mu)
    return rho / (mu - lam)


def mm1_sojourn(lam: float, mu: float) -> float:
    """M/M/1 mean time in system: 1 / (mu - lambda)."""
    _stable(lam, 1.0 / mu)
    return 1.0 / (mu - lam)


def md1_wait(lam: float, s: float) -> float:
    """M/D/1 mean wait in queue: rho s / (2 (1 - rho))."""
    rho = _stable(lam, s)
    return rho * s / (2 * (1 - rho))


def mg1_wait(lam: float, es: float, es2: float) -> float:
    """M/G/1 mean wait in queue (Pollaczek-Khinchine): lambda E[S^2] / (2 (1 - rho))."""
    rho = _stable(lam, es)
    if es2 < es * es:
        raise ValueError(f"E[S^2] = {es2} < E[S]^2 = {es * es}: not the moments of a distribution")
    return lam * es2 / (2 * (1 - rho))


def mg1_ps_sojourn(lam: float, es: float) -> float:
    """M/G/1 processor sharing mean time in system: E[S] / (1 - rho)."""
    rho = _stable(lam, es)
    return es / (1 - rho)


def little_l(lam: float, w: float) -> float:
    """Little's law: mean number in the system L = lambda W."""
    return lam * w


def kleinrock_load_weighted_wait(lam: float, es: float, es2: float) -> float:
    """Kleinrock's conserved quantity sum_p rho_p W_p = rho W_0 / (1 - rho), W_0 = lam E[S^2]/2."""
    rho = _stable(lam, es)
    return rho * (lam * es2 / 2) / (1 - rho)


def load_weighted_wait(service: Sequence[float], wait: Sequence[float], horizon: float) -> float:
    """Sample-path estimate of sum_p rho_p W_p: (1/T) sum_j S_j W_j."""
    s, w = np.asarray(service, dtype=float), np.asarray(wait, dtype=float)
    if s.shape != w.shape:
        raise ValueError(f"{s.size} service times but {w.size} waits")
    return float(np.dot(s, w) / horizon)


def batch_means_ci(x: Sequence[float], batches: int = 20, level: float = 0.95,
                   warmup: int = 0) -> tuple[float, float]:
    """(mean, half-width) of the `level` t interval over `batches` contiguous batch means of
    x[warmup:] (a trailing remainder shorter than a batch is dropped)."""
    from scipy.stats import t

    v = np.asarray(x, dtype=float)[warmup:]
    size = v.size // batches
    if batches < 2 or size < 1:
        raise ValueError(f"{v.size} values cannot make {batches} batches")
    means = v[: size * batches].reshape(batches, size).mean(axis=1)
    half = t.ppf(0.5 + level / 2, batches - 1) * means.std(ddof=1) / math.sqrt(batches)
    return float(means.mean()), float(half)


def discrete_moments(values: Sequence[float], probs: Sequence[float] | None = None
                     ) -> tuple[float, float]:
    """(E[X], E[X^2]) of a discrete distribution (uniform over `values` when probs is None)."""
    v = np.asarray(values, dtype=float)
    p = np.full(v.size, 1.0 / v.size) if probs is None else np.asarray(probs, dtype=float)
    if not math.isclose(float(p.sum()), 1.0, rel_tol=1e-9):
        raise ValueError(f"probabilities sum to {p.sum()}, not 1")
    return float(p @ v), float(p @ (v * v))
