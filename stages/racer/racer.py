"""RACER: robust, budgeted routing between a reasoning judge (a=1) and a direct judge (a=0).

The method in three lines (spec §2, Zhang et al., ICML 2026, arXiv 2605.10805):
  max_pi  min_{rho~ in U} E[f_r]  s.t.  max_{rho~ in U} E[f_c] <= C,  U a KL ball around rho_n;
  the worst cases are closed-form exponential tiltings (Thm 3.1), the entropy- and
  lambda^2-regularised Lagrangian has one saddle point (Thm 4.1), found by primal-dual steps.

Here (all [reconstructed], listed in pipelines/racer/README.md):
- The KL ball is used at a fixed temperature tau (the spec: "tau replaces delta"), separately
  for reward (tau_r, accuracy units) and cost (tau_c, cost units). The policy step ascends the
  penalised forms
      R_tau(pi) = min_rho~ E_rho~[f_r] + tau_r KL = -tau_r log E_rho_n exp(-f_r / tau_r)
      C_tau(pi) = max_rho~ E_rho~[f_c] - tau_c KL =  tau_c log E_rho_n exp( f_c / tau_c)
  whose gradients are the closed-form reweightings w^r, w^c below (Danskin).
  tau = None means tau -> infinity: the plain average (ERM; the paper's non-robust ACER).
- The multiplier step holds C_{rho_high}(pi) = E_rho_high[f_c] (`tilted_mean`) to the budget,
  as Algorithm 1 does: the worst-case expected cost over the KL ball whose radius is
  KL(rho_high || rho_n). `constraint="penalized"` holds C_tau = C_{rho_high} - tau_c KL instead
  (weaker). With `penalized` the saddle point is the optimum of one convex problem
  (`solve_cvxpy`); with `tilted_mean` it is found directly by a 1-D search for lambda*
  (`solve_lambda_search`) and is the optimum of the convex problem over the ball of that radius
  (`solve_kl_ball_cvxpy`). Both are checked against `primal_dual` by stage `solver_check`.
- H(pi) = mean_i H(pi(.|z_i)) (nats); weights are density ratios w = rho~ / rho_n (mean 1).
- The lambda-step is a projected gradient step on the regularised dual,
      lambda <- max(0, lambda - eta (beta lambda - (C_{rho_high}(pi) - C))),
  whose eta = 1/beta is the spec's closed form max(0, (C_{rho_high} - C)/beta); a smaller eta
  damps it.

Stage `train_router` (this module's `run`): the MLP router (4 layers on sentence embeddings, as
the paper) per arm x budget x seed; each outer step reweights a mini-batch (>= 256, spec §6),
takes a few Adam steps on the weighted, entropy-regularised objective (the policy step) and then
a multiplier step; the best iterate on validation (highest accuracy within budget) is kept.

    python -m stages racer train_router
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core.checks import read_array_checked, read_json_checked
from stages.core import io

# --- the math: small pure functions (numpy) ------------------------------------------------------


def _log_mean_exp(x: np.ndarray, rho: np.ndarray | None) -> float:
    """log sum_i rho_i exp(x_i), stable (log-sum-exp, spec §6)."""
    logw = np.log(rho) if rho is not None else np.full(len(x), -math.log(len(x)))
    z = x + logw
    m = float(np.max(z))
    return m + math.log(float(np.sum(np.exp(z - m))))


def kl_tilt_weights(values: np.ndarray, tau: float | None, sign: int,
                    rho: np.ndarray | None = None) -> np.ndarray:
    """Density ratios w_i = rho~(i) / rho_n(i) of the worst case in the KL set (Thm 3.1):
    rho~(i) ∝ rho_n(i) exp(sign (v_i - v_bar) / tau). sign=-1 up-weights low values (reward),
    sign=+1 high values (cost). The batch mean v_bar cancels after normalisation; it only keeps
    the exponent small. E_rho_n[w] = 1. tau=None (infinite): all ones."""
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    if tau is None:
        return np.ones(n)
    if tau <= 0:
        raise ValueError(f"tau = {tau}: must be > 0 (None for the non-robust average)")
    rho_n = np.full(n, 1.0 / n) if rho is None else np.asarray(rho, dtype=np.float64)
    z = sign * (values - float(np.dot(rho_n, values))) / tau + np.log(rho_n)
    z -= z.max()
    tilted = np.exp(z)
    tilted /= tilted.sum()
    return tilted / rho_n


def robust_reward(f_r: np.ndarray, tau: float | None, rho: np.ndarray | None = None) -> float:
    """R_tau = min_rho~ E_rho~[f_r] + tau KL(rho~||rho_n) = -tau log E_rho_n exp(-f_r/tau)."""
    f_r = np.asarray(f_r, dtype=np.float64)
    if tau is None:
        return float(np.mean(f_r) if rho is None else np.dot(rho, f_r))
    return -tau * _log_mean_exp(-f_r / tau, rho)


def robust_cost(f_c: np.ndarray, tau: float | None, rho: np.ndarray | None = None) -> float:
    """C_tau = max_rho~ E_rho~[f_c] - tau KL(rho~||rho_n) = tau log E_rho_n exp(f_c/tau)."""
    f_c = np.asarray(f_c, dtype=np.float64)
    if tau is None:
        return float(np.mean(f_c) if rho is None else np.dot(rho, f_c))
    return tau * _log_mean_exp(f_c / tau, rho)


def tilted_mean(values: np.ndarray, tau: float | None, sign: int,
                rho: np.ndarray | None = None) -> float:
    """E_rho~[v] at the worst case rho~ of the KL set (Thm 3.1). For costs (sign=+1) this is the
    spec's C_{rho_high}(pi) in Algorithm 1's multiplier step: the worst-case expected cost over
    the ball KL(rho~||rho_n) <= delta whose dual temperature is tau. It exceeds the penalised
    value C_tau = robust_cost by tau KL(rho~||rho_n) >= 0."""
    values = np.asarray(values, dtype=np.float64)
    rho_n = np.full(len(values), 1.0 / len(values)) if rho is None else np.asarray(rho, float)
    return float(np.dot(rho_n * kl_tilt_weights(values, tau, sign, rho), values))


CONSTRAINTS = ("tilted_mean", "penalized")


def constrained_cost(f_c: np.ndarray, tau_c: float | None, constraint: str) -> float:
    """The cost held to the budget C by the multiplier step and the best-iterate check:
    `tilted_mean` = C_{rho_high} = E_rho_high[f_c] (Algorithm 1: the worst-case expected cost in
    the KL ball), `penalized` = C_tau = C_{rho_high} - tau_c KL (weaker). The plain mean when
    tau_c is None (both coincide)."""
    if constraint == "tilted_mean":
        return tilted_mean(f_c, tau_c, +1)
    if constraint == "penalized":
        return robust_cost(f_c, tau_c)
    raise ValueError(f"constraint = {constraint!r}: expected one of {CONSTRAINTS}")


def expected(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """f(z_i; pi) = sum_a pi(a|z_i) v_i(a) with p = pi(1|z): v has shape (n, 2), a in {0, 1}."""
    return (1.0 - p) * v[:, 0] + p * v[:, 1]


def policy_step(r: np.ndarray, c: np.ndarray, w_r: np.ndarray, w_c: np.ndarray, lam: float,
                beta: float) -> np.ndarray:
    """Tabular policy step: pi(a|z_i) ∝ exp((w_i^r r_i(a) - lam w_i^c c_i(a)) / beta);
    returns p_i = pi(1|z_i). beta = 0: the argmax (0.5 on a tie)."""
    gain = w_r * (r[:, 1] - r[:, 0]) - lam * w_c * (c[:, 1] - c[:, 0])
    if beta == 0:
        return np.where(gain > 0, 1.0, np.where(gain < 0, 0.0, 0.5))
    return 1.0 / (1.0 + np.exp(-np.clip(gain / beta, -700, 700)))


def multiplier_step(lam: float, cost: float, budget: float, beta: float,
                    eta: float | None = None) -> float:
    """lambda_{t+1} = max(0, lambda - eta (beta lambda - (cost - budget))): a projected gradient
    step on the dual of L_beta. eta = None is eta = 1/beta, the closed form
    max(0, (cost - budget)/beta) [sign reconstructed, spec §6]: lambda grows when over budget."""
    if eta is None:
        if beta <= 0:
            raise ValueError("the closed-form multiplier step needs beta > 0")
        return max(0.0, (cost - budget) / beta)
    return max(0.0, lam - eta * (beta * lam - (cost - budget)))


def entropy(p: np.ndarray) -> np.ndarray:
    """H(pi(.|z_i)) in nats for p = pi(1|z_i)."""
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-300, 1.0)
    q = np.clip(1.0 - np.asarray(p, dtype=np.float64), 1e-300, 1.0)
    return -(p * np.log(p) + q * np.log(q))


def regularized_objective(p: np.ndarray, r: np.ndarray, c: np.ndarray, budget: float,
                          beta: float, tau_r: float | None, tau_c: float | None) -> float:
    """max_pi min_{lambda>=0} L_beta = R_tau + beta H - max(0, C_tau - C)^2 / (2 beta): the
    objective of the `penalized` constraint (C_tau held to the budget)."""
    f_r, f_c = expected(p, r), expected(p, c)
    excess = max(0.0, robust_cost(f_c, tau_c) - budget)
    return robust_reward(f_r, tau_r) + beta * float(np.mean(entropy(p))) - excess ** 2 / (2 * beta)


def primal_dual(r: np.ndarray, c: np.ndarray, budget: float, *, beta: float,
                tau_r: float | None, tau_c: float | None, iters: int = 500, lam0: float = 0.0,
                eta: float | None = None, alpha: float = 1.0, tol: float = 0.0,
                constraint: str = "tilted_mean") -> dict[str, Any]:
    """Algorithm 1 on a tabular policy: reweight at pi_t, policy step at lambda_t, multiplier
    step at pi_{t+1} on `constraint`'s cost (`constrained_cost`): by default C_{rho_high}, the
    tilted mean, as Algorithm 1 and `train_router` do; `penalized` steps on C_tau instead.
    Returns p, lambda and the lambda trajectory (for the linear rate).
    alpha < 1 damps the policy step in logit space (a mirror-ascent step: logit <- (1 - alpha)
    logit + alpha * best-response logit); alpha = 1 is the exact policy step of the spec, which
    oscillates when the reweighting moves faster than beta allows."""
    if constraint not in CONSTRAINTS:
        raise ValueError(f"constraint = {constraint!r}: expected one of {CONSTRAINTS}")
    n = len(r)
    p = np.full(n, 0.5)
    logit = np.zeros(n)
    lam, lams = lam0, [lam0]
    for _ in range(iters):
        w_r = kl_tilt_weights(expected(p, r), tau_r, -1)
        w_c = kl_tilt_weights(expected(p, c), tau_c, +1)
        best = policy_step(r, c, w_r, w_c, lam, beta)
        if alpha >= 1.0:
            p = best
        else:
            target = np.log(np.clip(best, 1e-300, 1)) - np.log(np.clip(1 - best, 1e-300, 1))
            logit = (1 - alpha) * logit + alpha * target
            p = 1.0 / (1.0 + np.exp(-logit))
        new = multiplier_step(lam, constrained_cost(expected(p, c), tau_c, constraint), budget,
                              beta, eta)
        lams.append(new)
        done = tol > 0 and abs(new - lam) < tol
        lam = new
        if done:
            break
    return {"p": p, "lam": lam, "lams": np.array(lams)}


def solve_cvxpy(r: np.ndarray, c: np.ndarray, budget: float, *, beta: float,
                tau_r: float | None, tau_c: float | None) -> dict[str, Any]:
    """The `penalized` saddle point by a general convex solver:
    max_p R_tau(p) + beta H(p) - pos(C_tau(p) - C)^2 / (2 beta), 0 <= p <= 1.
    lambda* = max(0, C_tau(p*) - C) / beta (the inner minimisation in closed form)."""
    import cvxpy as cp

    n = len(r)
    p = cp.Variable(n)
    f_r = r[:, 0] + cp.multiply(r[:, 1] - r[:, 0], p)
    f_c = c[:, 0] + cp.multiply(c[:, 1] - c[:, 0], p)
    log_rho = -math.log(n)
    reward = (cp.sum(f_r) / n if tau_r is None
              else -tau_r * cp.log_sum_exp(-f_r / tau_r + log_rho))
    cost = cp.sum(f_c) / n if tau_c is None else tau_c * cp.log_sum_exp(f_c / tau_c + log_rho)
    ent = cp.sum(cp.entr(p) + cp.entr(1 - p)) / n
    objective = reward + beta * ent - cp.square(cp.pos(cost - budget)) / (2 * beta)
    problem = cp.Problem(cp.Maximize(objective), [p >= 0, p <= 1])
    problem.solve(solver=cp.CLARABEL)
    if p.value is None:
        raise RuntimeError(f"cvxpy: no solution ({problem.status})")
    p_star = np.clip(np.asarray(p.value, dtype=np.float64), 0.0, 1.0)
    lam = max(0.0, robust_cost(expected(p_star, c), tau_c) - budget) / beta
    return {"p": p_star, "lam": lam, "value": float(problem.value), "status": problem.status}


def lagrangian(p: np.ndarray, r: np.ndarray, c: np.ndarray, lam: float, beta: float,
               tau_r: float | None, tau_c: float | None) -> float:
    """R_tau(p) - lam C_tau(p) + beta H(p): the objective the policy step ascends at a fixed
    multiplier (its gradient in f_r, f_c is the reweighted one, w^r / n and w^c / n, Danskin)."""
    return (robust_reward(expected(p, r), tau_r) - lam * robust_cost(expected(p, c), tau_c)
            + beta * float(np.mean(entropy(p))))


def _cvx_reward_entropy(r: np.ndarray, p: Any, beta: float, tau_r: float | None) -> Any:
    """cvxpy expression R_tau(p) + beta H(p) (the reward and entropy terms of every problem)."""
    import cvxpy as cp

    n = len(r)
    f_r = r[:, 0] + cp.multiply(r[:, 1] - r[:, 0], p)
    reward = (cp.sum(f_r) / n if tau_r is None
              else -tau_r * cp.log_sum_exp(-f_r / tau_r - math.log(n)))
    return reward + beta * cp.sum(cp.entr(p) + cp.entr(1 - p)) / n


def best_response_solver(r: np.ndarray, c: np.ndarray, *, beta: float, tau_r: float | None,
                         tau_c: float | None) -> Callable[[float], np.ndarray]:
    """lambda -> argmax_{0 <= p <= 1} R_tau(p) - lambda C_tau(p) + beta H(p), by cvxpy (Clarabel;
    compiled once, lambda a parameter): the policy step's fixed point at a fixed multiplier, a
    concave problem with one maximiser when beta > 0."""
    import cvxpy as cp

    n = len(r)
    p = cp.Variable(n)
    lam = cp.Parameter(nonneg=True)
    f_c = c[:, 0] + cp.multiply(c[:, 1] - c[:, 0], p)
    cost = cp.sum(f_c) / n if tau_c is None else tau_c * cp.log_sum_exp(f_c / tau_c - math.log(n))
    problem = cp.Problem(cp.Maximize(_cvx_reward_entropy(r, p, beta, tau_r) - lam * cost),
                         [p >= 0, p <= 1])

    def solve(value: float) -> np.ndarray:
        lam.value = float(value)
        problem.solve(solver=cp.CLARABEL)
        if p.value is None:
            raise RuntimeError(f"cvxpy: no best response at lambda = {value} ({problem.status})")
        return np.clip(np.asarray(p.value, dtype=np.float64), 0.0, 1.0)

    return solve


def solve_lambda_search(r: np.ndarray, c: np.ndarray, budget: float, *, beta: float,
                        tau_r: float | None, tau_c: float | None,
                        constraint: str = "tilted_mean", xtol: float = 1e-12) -> dict[str, Any]:
    """The saddle point of Algorithm 1 directly, by a 1-D search for lambda*.

    A fixed point of `primal_dual` is p* = p(lambda*) with p(lambda) the best response
    (`best_response_solver`) and lambda* = max(0, (G(p(lambda*)) - C) / beta), G the
    constrained cost (`constrained_cost`: the tilted mean C_{rho_high} or the penalised C_tau).
    So lambda* = 0 when G(p(0)) <= C, else the root of h(lambda) = beta lambda - (G(p(lambda))
    - C), bracketed by 0 (h < 0) and (G(p(0)) - C) / beta (h >= 0 when G falls with lambda;
    else (max c - C) / beta + 1, where h > 0 since G <= max c), found by Brent's method.
    For `penalized` this is the optimum `solve_cvxpy` finds. For `tilted_mean` no single convex
    program has this point as its optimum at a fixed tau (the tilted mean is not convex in f_c),
    but it is the optimum of the convex problem with the KL ball's radius fixed at
    delta* = KL(rho_high(p*) || rho_n) (`solve_kl_ball_cvxpy`: the ball's worst case at p* is
    rho_high, and its gradient there the same w^c). Returns p, lam, delta (that radius) and the
    number of best responses solved."""
    from scipy.optimize import brentq

    if beta <= 0:
        raise ValueError(f"beta = {beta}: the search needs beta > 0 (a unique best response)")
    best_response = best_response_solver(r, c, beta=beta, tau_r=tau_r, tau_c=tau_c)
    evals = 0

    def cost(lam: float) -> tuple[np.ndarray, float]:
        nonlocal evals
        evals += 1
        p = best_response(lam)
        return p, constrained_cost(expected(p, c), tau_c, constraint)

    def h(lam: float) -> float:
        return beta * lam - (cost(lam)[1] - budget)

    p0, g0 = cost(0.0)
    if g0 <= budget:
        lam = 0.0
    else:
        # h((G(p(0)) - C)/beta) >= 0 when G(p(lambda)) falls with lambda (the usual case, and a
        # tight bracket keeps the best responses at moderate lambda); else the safe bound
        hi = (g0 - budget) / beta
        if h(hi) <= 0:
            hi = (float(np.max(c)) - budget) / beta + 1.0
        lam = float(brentq(h, 0.0, hi, xtol=xtol))
    p = p0 if lam == 0.0 else cost(lam)[0]
    f_c = expected(p, c)
    w = kl_tilt_weights(f_c, tau_c, +1)
    delta = float(np.mean(w * np.log(np.clip(w, 1e-300, None))))   # KL(rho_high || rho_n)
    return {"p": p, "lam": lam, "delta": delta, "evals": evals}


def solve_kl_ball_cvxpy(r: np.ndarray, c: np.ndarray, budget: float, *, beta: float,
                        tau_r: float | None, delta: float) -> dict[str, Any]:
    """The regularised problem with the cost constraint over a KL ball of fixed radius delta:
    max_p R_tau(p) + beta H(p) - pos(C_delta(p) - C)^2 / (2 beta), 0 <= p <= 1, with
    C_delta(p) = max_{KL(rho~||rho_n) <= delta} E_rho~[f_c] = min_{s > 0} s log E_rho_n
    exp(f_c / s) + s delta (Lagrange duality of the ball; the minimising s is the temperature
    whose tilt has KL = delta). C_delta is convex in f_c (a max of linear functions), so this is
    one convex program: s log E exp(f_c / s) <= v is sum_i rho_n(i) z_i <= s with (f_i - v, s,
    z_i) in the exponential cone. At delta = KL(rho_high(p*) || rho_n) its optimum is the
    tilted-mean saddle point (`solve_lambda_search`). lambda* = pos(C_delta(p*) - C) / beta."""
    import cvxpy as cp

    if delta <= 0:
        raise ValueError(f"delta = {delta}: the KL ball needs a radius > 0")
    n = len(r)
    p = cp.Variable(n)
    s_, v, z = cp.Variable(pos=True), cp.Variable(), cp.Variable(n)
    f_c = c[:, 0] + cp.multiply(c[:, 1] - c[:, 0], p)
    ball = v + s_ * delta                                   # >= C_delta(p), tight at the optimum
    cons = [p >= 0, p <= 1, cp.sum(z) / n <= s_,
            cp.constraints.ExpCone(f_c - v, s_ * np.ones(n), z)]
    objective = (_cvx_reward_entropy(r, p, beta, tau_r)
                 - cp.square(cp.pos(ball - budget)) / (2 * beta))
    problem = cp.Problem(cp.Maximize(objective), cons)
    problem.solve(solver=cp.CLARABEL)
    if p.value is None:
        raise RuntimeError(f"cvxpy: no solution ({problem.status})")
    p_star = np.clip(np.asarray(p.value, dtype=np.float64), 0.0, 1.0)
    return {"p": p_star, "lam": max(0.0, float(ball.value) - budget) / beta,
            "tau": float(s_.value), "status": problem.status}


def linear_rate(errors: Sequence[float], floor: float = 1e-5) -> tuple[float, float]:
    """Fit log e_t = a + t log q over the iterates before e_t first drops below the floor: (q,
    R^2). Linear convergence: a straight line, q < 1. The floor is the larger of `floor` and 10x
    the smallest error reached: |lambda_t - lambda*| cannot fall below the reference solver's
    own error in lambda* (about its tolerance in p / beta, 1e-5 to 1e-4 at beta = 0.05), and the
    flat tail at that level says nothing about the iteration's rate."""
    e = np.asarray(errors, dtype=np.float64)
    positive = e[e > 0]
    if len(positive):
        floor = max(floor, 10.0 * float(positive.min()))
    below = np.nonzero(e <= floor)[0]
    end = int(below[0]) if len(below) else len(e)
    t = np.nonzero(e[:end] > 0)[0]
    if len(t) < 3:
        return math.nan, math.nan
    y = np.log(e[t])
    slope, icept = np.polyfit(t, y, 1)
    resid = y - (slope * t + icept)
    ss = float(np.sum((y - y.mean()) ** 2))
    return float(math.exp(slope)), (1.0 - float(np.sum(resid ** 2)) / ss) if ss > 0 else 1.0


# --- the MLP router (torch) -------------------------------------------------------------------------


class Arm(BaseModel):
    """One router variant: which of reward / cost are robustified (spec §3)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="arm name (erm, racer, racer_r, racer_c)")
    robust_reward: bool = Field(description="reweight rewards by rho_low (tau_r)")
    robust_cost: bool = Field(description="reweight costs by rho_high (tau_c)")
    tau_r: float | None = Field(None, gt=0, description="this arm's reward temperature "
                                                        "(None: the stage's tau_r)")
    tau_c: float | None = Field(None, gt=0, description="this arm's cost temperature "
                                                        "(None: the stage's tau_c)")

    def taus(self, cfg: "Config") -> tuple[float | None, float | None]:
        """(tau_r, tau_c) this arm trains with; None where it is not robust (tau -> inf)."""
        return ((self.tau_r or cfg.tau_r) if self.robust_reward else None,
                (self.tau_c or cfg.tau_c) if self.robust_cost else None)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    features: str = Field("racer_features", description="paths key of the features stage output")
    outcomes: str = Field("racer_outcomes", description="paths key of the judge_outcomes output")
    out: str = Field("racer_routers", description="paths key of the routers folder")
    arms: list[Arm] = Field(description="router variants trained per budget and seed")
    budgets: list[float] = Field(description="token budgets C, in cost units (mean direct-judge "
                                             "tokens on the training mix = 1)")
    seeds: list[int] = Field([0, 1, 2], min_length=1, description="router training seeds")
    beta: float = Field(0.01, ge=0, le=10, description="entropy / lambda^2 regularisation")
    tau_r: float = Field(0.5, gt=0, description="reward temperature (accuracy units)")
    tau_c: float = Field(2.0, gt=0, description="cost temperature (cost units)")
    eta: float | None = Field(None, gt=0, description="multiplier step size; None: 1/beta "
                                                      "(the closed form)")
    constraint: Literal["tilted_mean", "penalized"] = Field(
        "tilted_mean", description="the cost the multiplier step and the best-iterate check hold "
        "to the budget: tilted_mean = E_rho_high[f_c] (Algorithm 1, the worst case in the KL "
        "ball); penalized = C_tau = E_rho_high[f_c] - tau_c KL, a weaker constraint")
    iters: int = Field(150, ge=1, le=100000, description="outer primal-dual iterations")
    policy_steps: int = Field(3, ge=1, le=1000, description="Adam steps per policy step")
    batch_size: int = Field(512, ge=1, description="mini-batch per outer step (>= 256, spec §6)")
    hidden: int = Field(128, ge=4, le=8192, description="MLP width")
    layers: int = Field(4, ge=2, le=12, description="linear layers of the MLP router [paper: 4]")
    lr: float = Field(1e-3, gt=0, le=1, description="Adam learning rate")
    eval_every: int = Field(10, ge=1, description="validation every N outer steps (best iterate)")
    register_as: str | None = Field("racer-router", description="registered model name")
    register_budget: float | None = Field(None, description="budget whose seed-0 routers are "
                                                            "registered (None: the middle one)")
    num_threads: int = Field(0, ge=0, le=256, description="torch CPU threads (0: all cores)")

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, v: list[float]) -> list[float]:
        if not v or any(b <= 0 for b in v):
            raise ValueError(f"budgets = {v}: expected a non-empty list of positive cost ratios")
        return v

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[Arm]) -> list[Arm]:
        names = [a.name for a in v]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names repeat: {names}")
        return v


def build_router(dim: int, hidden: int, layers: int) -> Any:
    """pi(a=1|z) as an MLP on the embedding z: `layers` linear maps, ReLU between, one logit."""
    import torch

    mods: list[Any] = []
    width = dim
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    mods.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*mods)


def policy_loss(logits: Any, r: Any, c: Any, w_r: Any, w_c: Any, lam: float, beta: float) -> Any:
    """-(mean w^r f_r - lam mean w^c f_c + beta mean H): the policy step's objective (torch)."""
    import torch

    p = torch.sigmoid(logits)
    f_r = (1 - p) * r[:, 0] + p * r[:, 1]
    f_c = (1 - p) * c[:, 0] + p * c[:, 1]
    logsig = torch.nn.functional.logsigmoid
    ent = -(p * logsig(logits) + (1 - p) * logsig(-logits))   # H(pi(.|z)) in nats
    return -((w_r * f_r).mean() - lam * (w_c * f_c).mean() + beta * ent.mean())


def router_probs(model: Any, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return torch.sigmoid(model(torch.as_tensor(x, dtype=torch.float32)).squeeze(-1)).numpy()


def train_router(x: np.ndarray, r: np.ndarray, c: np.ndarray, x_val: np.ndarray,
                 r_val: np.ndarray, c_val: np.ndarray, budget: float, *, tau_r: float | None,
                 tau_c: float | None, cfg: Config, seed: int,
                 log: Any = None) -> dict[str, Any]:
    """Algorithm 1 with the MLP router. Returns the best-on-validation model and its history."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = build_router(x.shape[1], cfg.hidden, cfg.layers)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    xt = torch.as_tensor(x, dtype=torch.float32)
    rt, ct = torch.as_tensor(r, dtype=torch.float32), torch.as_tensor(c, dtype=torch.float32)
    lam, lams, history = 0.0, [0.0], []
    best: dict[str, Any] | None = None
    bs = min(cfg.batch_size, len(x))
    for t in range(1, cfg.iters + 1):
        idx = torch.as_tensor(rng.choice(len(x), size=bs, replace=False))
        xb, rb, cb = xt[idx], rt[idx], ct[idx]
        with torch.no_grad():  # reweight at pi_t (closed form, Thm 3.1)
            p = torch.sigmoid(model(xb).squeeze(-1)).numpy().astype(np.float64)
        w_r = kl_tilt_weights(expected(p, rb.numpy()), tau_r, -1)
        w_c = kl_tilt_weights(expected(p, cb.numpy()), tau_c, +1)
        wr, wc = torch.as_tensor(w_r, dtype=torch.float32), torch.as_tensor(w_c, dtype=torch.float32)
        for _ in range(cfg.policy_steps):  # policy step: a few gradient steps
            opt.zero_grad()
            loss = policy_loss(model(xb).squeeze(-1), rb, cb, wr, wc, lam, cfg.beta)
            loss.backward()
            opt.step()
        with torch.no_grad():
            p = torch.sigmoid(model(xb).squeeze(-1)).numpy().astype(np.float64)
        # lambda_{t+1} from C_{rho_high}(pi_{t+1}): rho_high recomputed at the updated policy
        lam = multiplier_step(lam, constrained_cost(expected(p, cb.numpy()), tau_c, cfg.constraint),
                              budget, cfg.beta, cfg.eta)
        lams.append(lam)
        if t % cfg.eval_every == 0 or t == cfg.iters:
            pv = router_probs(model, x_val).astype(np.float64)
            acc, cost = float(expected(pv, r_val).mean()), float(expected(pv, c_val).mean())
            rcost = constrained_cost(expected(pv, c_val), tau_c, cfg.constraint)
            point = {"iter": t, "lam": lam, "val_acc": acc, "val_cost": cost,
                     "val_robust_cost": rcost, "reasoning_share": float(pv.mean())}
            history.append(point)
            if log is not None:
                log(point, t)
            # best iterate: highest validation accuracy among those within budget (robust cost
            # for the robust arms), else the cheapest
            feasible = rcost <= budget
            key = (feasible, acc if feasible else -rcost)
            if best is None or key > best["key"]:
                best = {"key": key, "state": {k: v.clone() for k, v in
                                              model.state_dict().items()}, **point}
    assert best is not None
    model.load_state_dict(best["state"])
    return {"model": model, "best": {k: v for k, v in best.items() if k not in ("key", "state")},
            "lams": lams, "history": history}


def load_arrays(features_dir: Path, outcomes_dir: Path, split: str) -> tuple[np.ndarray, ...]:
    """(x, r, c, difficulty) of one split: features aligned to outcomes by item id."""
    import polars as pl

    from stages.racer.outcomes import read_outcomes

    ids = read_json_checked(features_dir / f"{split}.ids.json", kind=list)
    feats = read_array_checked(features_dir / f"{split}.npy", ndim=2, rows=len(ids))
    out = read_outcomes(outcomes_dir / f"{split}.parquet")
    pos = {i: k for k, i in enumerate(ids)}
    missing = [i for i in out["id"].to_list() if i not in pos]
    if missing:
        raise ValueError(f"{features_dir}/{split}.npy: no features for {len(missing)} items, "
                         f"e.g. {missing[:3]}: rerun the features stage")
    x = feats[[pos[i] for i in out["id"].to_list()]]
    unit = read_json_checked(outcomes_dir / "cost_unit.json", {"tokens": float})["tokens"]
    r = out.select(pl.col("direct_correct"), pl.col("reasoning_correct")).to_numpy().astype(float)
    c = out.select(pl.col("direct_tokens"), pl.col("reasoning_tokens")).to_numpy() / unit
    return x, r, c, out["difficulty"].to_numpy()


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import torch
    from safetensors.torch import save_file

    from stages.models.base import set_threads

    set_threads(cfg.num_threads)
    fdir, odir = ctx.path(cfg.features), ctx.path(cfg.outcomes)
    x, r, c, _ = load_arrays(fdir, odir, "train")
    xv, rv, cv, _ = load_arrays(fdir, odir, "val")
    reg_budget = cfg.register_budget if cfg.register_budget is not None else \
        sorted(cfg.budgets)[len(cfg.budgets) // 2]
    if reg_budget not in cfg.budgets:
        raise ValueError(f"register_budget = {reg_budget} is not one of budgets {cfg.budgets}")
    metrics: dict[str, float] = {"train_items": len(x), "val_items": len(xv),
                                 "feature_dim": x.shape[1]}
    curves = []
    out = ctx.path(cfg.out)
    started = time.perf_counter()
    with io.atomic_path(out, is_dir=True) as tmp:
        for arm in cfg.arms:
            tau_r, tau_c = arm.taus(cfg)
            for budget in cfg.budgets:
                for seed in cfg.seeds:
                    t0 = time.perf_counter()
                    got = train_router(x, r, c, xv, rv, cv, budget, tau_r=tau_r, tau_c=tau_c,
                                       cfg=cfg, seed=seed)
                    folder = tmp / arm.name / f"C{budget:g}" / f"seed{seed}"
                    folder.mkdir(parents=True)
                    save_file({k: v.contiguous() for k, v in got["model"].state_dict().items()},
                              str(folder / "model.safetensors"))
                    io.write_json(folder / "config.json", {
                        "architecture": "mlp_router", "input_dim": int(x.shape[1]),
                        "hidden": cfg.hidden, "layers": cfg.layers, "arm": arm.name,
                        "budget": budget, "seed": seed, "tau_r": tau_r, "tau_c": tau_c,
                        "beta": cfg.beta, "output": "logit of pi(reasoning|z)",
                        "best": got["best"]})
                    key = f"{arm.name}/C{budget:g}/seed{seed}"
                    metrics[f"{key}/val_acc"] = got["best"]["val_acc"]
                    metrics[f"{key}/val_cost"] = got["best"]["val_cost"]
                    metrics[f"{key}/lambda"] = got["lams"][-1]
                    ctx.log_metrics({f"{key}/seconds": time.perf_counter() - t0})
                    curves += [{"arm": arm.name, "budget": budget, "seed": seed, "iter": i,
                                "lam": float(v)} for i, v in enumerate(got["lams"])]
        import polars as pl

        io.write_parquet(tmp / "lambda.parquet", pl.DataFrame(curves))
        # which routers go to the registry: `evaluate` tags those versions with its test
        # scores (`StageTracker.annotate_model`)
        registered = [arm.name for arm in cfg.arms] if cfg.register_as else []
        io.write_json(tmp / "registered.json", {
            f"{name}/C{reg_budget:g}/seed{cfg.seeds[0]}": cfg.register_as for name in registered})
    ctx.log_metrics({"train_seconds": time.perf_counter() - started})
    if ctx.tracker is not None:
        seed = cfg.seeds[0]
        for name in registered:
            folder = out / name / f"C{reg_budget:g}" / f"seed{seed}"
            ctx.tracker.register_model(folder, cfg.register_as, aliases=[name.replace("_", "-")],
                                       tags={"paperline.method": name,
                                             "paperline.budget": f"{reg_budget:g}",
                                             "paperline.seed": str(seed)},
                                       artifact_path=f"router-{name}")
    del torch
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the data the routers trained on; every router's validation accuracy, cost
    and lambda per (arm, budget, seed) stay in details/train_router.json."""
    return {k: metrics[k] for k in ("train_items", "val_items") if k in metrics}
