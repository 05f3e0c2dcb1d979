"""Stage `solver_check` of RACER: the primal-dual algorithm against a direct solution.

On small tabular instances drawn from the real judge outcomes (n items of the train split,
costs divided by their maximum so M <= 1), Algorithm 1 (`racer.primal_dual`) runs on the
regularised saddle problem of Thm 4.1 (Zhang et al., arXiv 2605.10805, §4), its multiplier
step holding `constraint`'s cost to the budget C:

- `tilted_mean` (default; Algorithm 1 as the paper states it and as `train_router` runs it):
  C_{rho_high}(p) = E_rho_high[f_c], the worst-case expected cost in the KL ball. The reference
  is a 1-D search for lambda* (`racer.solve_lambda_search`: the best response p(lambda) by cvxpy,
  lambda* the root of beta lambda = C_{rho_high}(p(lambda)) - C), certified by one convex
  program, the same problem with the KL ball's radius fixed at delta* = KL(rho_high(p*) ||
  rho_n) (`racer.solve_kl_ball_cvxpy`, `ball_max_abs_dp`). `objective_gap` is the gap in the
  Lagrangian R_tau - lambda* C_tau + beta H (the policy step's objective at lambda*).
- `penalized`: C_tau = C_{rho_high} - tau_c KL, a weaker constraint. Then the problem
  max_p R_tau(p) + beta H(p) - max(0, C_tau(p) - C)^2 / (2 beta) is one convex program, solved
  by cvxpy (Clarabel, `racer.solve_cvxpy`); `objective_gap` is the gap in that objective.

Metrics are named `<constraint>/<arm>/beta<b>/<key>`, per (beta, arm): max |p - p*|,
|lambda - lambda*|, the objective gap, and the linear rate q fitted to |lambda_t - lambda*|
(R^2 of the log-linear fit) next to the rate Thm 4.2 implies for it, q_bound = M^2K^2/(M^2K^2 +
2 beta^2): the theorem bounds KL(pi_t || pi*) by q_bound^(2t) (lambda_0 - lambda*)^2, and KL is
quadratic in lambda_t - lambda* near the optimum, so |lambda_t - lambda*| shrinks like
q_bound^t. M and K are reconstructed [ours]: M = max |c_i(1) - c_i(0)| (the constraint's range
in the normalised costs) and K = exp(M / tau_c), the cost tilt's density-ratio bound; the reward
tilt's e^(1/tau_r) is left out of K because eta is built from the same constants, and a K with
it makes eta ~50x smaller at tau_r = 0.5. tau_c here is in normalised cost units, not the
router's (cost / the direct judge's mean tokens).
The multiplier step is damped, eta = 1/(beta + M^2 K^2/(4 beta)), and the policy step too
(alpha = 0.1 in logit space): the closed form (eta = 1/beta, alpha = 1) cycles between 0 and a
large lambda on these instances (reported as `closed_form_cycles`).

    python -m stages racer solver_check
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stages.racer import racer


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    outcomes: str = Field("racer_outcomes", description="paths key of the judge_outcomes output")
    n_items: int = Field(40, ge=4, le=5000, description="items per instance")
    instances: int = Field(3, ge=1, le=100, description="instances (disjoint random draws)")
    betas: list[Annotated[float, Field(gt=0)]] = Field([0.05, 0.1], min_length=1,
                                                       description="beta values checked (> 0)")
    budget_share: float = Field(0.3, gt=0, lt=1, description="budget C = cost of routing this "
                                                             "share to reasoning")
    tau_r: float = Field(0.5, gt=0, description="reward temperature of the robust arm")
    tau_c: float = Field(1.0, gt=0, description="cost temperature (normalised cost units)")
    alpha: float = Field(0.1, gt=0, le=1, description="policy step size in logit space (1: "
                         "the exact best response, which oscillates with robust rewards)")
    iters: int = Field(20000, ge=10, le=10_000_000, description="primal-dual iterations")
    constraint: Literal["tilted_mean", "penalized"] = Field(
        "tilted_mean", description="the cost the multiplier step holds to the budget: "
        "tilted_mean = E_rho_high[f_c] (Algorithm 1); penalized = C_tau = E_rho_high[f_c] - "
        "tau_c KL (weaker); names the metrics")


def check_instance(r: np.ndarray, c: np.ndarray, budget: float, beta: float,
                   tau_r: float | None, tau_c: float | None, iters: int,
                   alpha: float = 0.1, constraint: str = "tilted_mean") -> dict[str, float]:
    """Algorithm 1 against the direct solution of `constraint`'s saddle point (module doc)."""
    got: dict[str, float] = {}
    if constraint == "penalized":
        ref = racer.solve_cvxpy(r, c, budget, beta=beta, tau_r=tau_r, tau_c=tau_c)

        def obj(p: np.ndarray) -> float:
            return racer.regularized_objective(p, r, c, budget, beta, tau_r, tau_c)
    elif constraint == "tilted_mean":
        ref = racer.solve_lambda_search(r, c, budget, beta=beta, tau_r=tau_r, tau_c=tau_c,
                                        constraint=constraint)
        if tau_c is not None and ref["delta"] > 0:
            got["delta_star"] = ref["delta"]
            ball = racer.solve_kl_ball_cvxpy(r, c, budget, beta=beta, tau_r=tau_r,
                                             delta=ref["delta"])
            got["ball_max_abs_dp"] = float(np.max(np.abs(ball["p"] - ref["p"])))

        def obj(p: np.ndarray) -> float:
            return racer.lagrangian(p, r, c, ref["lam"], beta, tau_r, tau_c)
    else:
        raise ValueError(f"constraint = {constraint!r}: expected one of {racer.CONSTRAINTS}")
    m = float(np.max(np.abs(c[:, 1] - c[:, 0])))
    k = 1.0 if tau_c is None else math.exp(m / tau_c)   # density-ratio bound of the tilt
    eta = 1.0 / (beta + (m * k) ** 2 / (4 * beta))
    pd = racer.primal_dual(r, c, budget, beta=beta, tau_r=tau_r, tau_c=tau_c, iters=iters,
                           eta=eta, alpha=alpha, constraint=constraint)
    rate, r2 = racer.linear_rate(np.abs(pd["lams"] - ref["lam"]))
    closed = racer.primal_dual(r, c, budget, beta=beta, tau_r=tau_r, tau_c=tau_c, iters=200,
                               constraint=constraint)
    tail = closed["lams"][-20:]
    return {"max_abs_dp": float(np.max(np.abs(pd["p"] - ref["p"]))),
            "abs_dlambda": abs(pd["lam"] - ref["lam"]),
            "objective_gap": abs(obj(ref["p"]) - obj(pd["p"])),
            "rate": rate, "rate_r2": r2,
            "rate_bound": (m * k) ** 2 / ((m * k) ** 2 + 2 * beta ** 2),  # of |lambda_t - lambda*|
            "lambda_star": ref["lam"],
            "closed_form_cycles": float(np.ptp(tail) > 1e-3 * max(1.0, abs(ref["lam"]))),
            **got}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.racer.outcomes import read_outcomes

    out = read_outcomes(ctx.path(cfg.outcomes) / "train.parquet")
    if out.height < cfg.n_items:
        raise ValueError(f"solver_check.n_items = {cfg.n_items}: the train split has only "
                         f"{out.height} items")
    r_all = out.select("direct_correct", "reasoning_correct").to_numpy().astype(float)
    c_all = out.select("direct_tokens", "reasoning_tokens").to_numpy().astype(float)
    rng = np.random.default_rng(ctx.seed)
    results: dict[str, list[float]] = {}
    for i in range(cfg.instances):
        idx = rng.choice(out.height, size=cfg.n_items, replace=False)
        r, c = r_all[idx], c_all[idx] / c_all[idx].max()
        budget = float(np.mean(c[:, 0] + cfg.budget_share * (c[:, 1] - c[:, 0])))
        for beta in cfg.betas:
            for arm, (tr, tc) in {"erm": (None, None), "racer": (cfg.tau_r, cfg.tau_c)}.items():
                got = check_instance(r, c, budget, beta, tr, tc, cfg.iters, cfg.alpha,
                                     cfg.constraint)
                prefix = f"{cfg.constraint}/{arm}/beta{beta:g}"
                for k, v in got.items():
                    results.setdefault(f"{prefix}/{k}", []).append(v)
                ctx.log_metrics({f"{prefix}/{k}": v for k, v in got.items()}, step=i)
    metrics = {}
    for key, vals in results.items():
        finite = [v for v in vals if v == v]
        metrics[key] = max(finite) if key.endswith(("max_abs_dp", "abs_dlambda", "objective_gap",
                                                    "rate")) and finite else \
            (sum(finite) / len(finite) if finite else math.nan)
    metrics["max_abs_dp"] = max(v for k, v in metrics.items() if k.endswith("/max_abs_dp"))
    metrics["max_rate"] = max(v for k, v in metrics.items() if k.endswith("/rate"))
    metrics["min_rate_r2"] = min(v for k, v in metrics.items() if k.endswith("/rate_r2"))
    ball = [v for k, v in metrics.items() if k.endswith("/ball_max_abs_dp")]
    if ball:
        metrics["max_ball_abs_dp"] = max(ball)
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the worst disagreement with the direct solution and the worst fitted rate;
    every instance stays in details/solver_check.json."""
    return {k: metrics[k] for k in ("max_abs_dp", "max_rate") if k in metrics}
