"""RACER math on hand-computed numbers, the solver against cvxpy, judges' parsing, baselines."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stages.racer.compare import random_share, threshold_at_budget
from stages.racer import racer
from stages.racer.judges import (direct_target, judge_prompt, mix_counts,
                                        parse_verdict, reasoning_target, stated_value)
from stages.racer.outcomes import score

E = math.e


def test_worst_case_cost_weights_up_weight_high_cost():
    # rho~ ∝ (1/2)[e^{-1/2}, e^{1/2}] -> [1/(1+e), e/(1+e)]; density ratios x2
    w = racer.kl_tilt_weights(np.array([0.0, 1.0]), tau=1.0, sign=+1)
    assert w == pytest.approx([2 / (1 + E), 2 * E / (1 + E)])      # [0.5379, 1.4621]
    assert w.mean() == pytest.approx(1.0)


def test_worst_case_reward_weights_up_weight_low_reward():
    w = racer.kl_tilt_weights(np.array([0.0, 1.0]), tau=1.0, sign=-1)
    assert w == pytest.approx([2 * E / (1 + E), 2 / (1 + E)])
    assert racer.kl_tilt_weights(np.array([0.0, 1.0]), tau=None, sign=-1) == pytest.approx([1, 1])
    # log-sum-exp keeps tiny temperatures finite: all mass on the worst item
    assert racer.kl_tilt_weights(np.array([0.0, 1000.0]), 1e-3, +1) == pytest.approx([0.0, 2.0])
    with pytest.raises(ValueError, match="tau"):
        racer.kl_tilt_weights(np.array([0.0, 1.0]), 0.0, +1)


def test_robust_reward_and_cost_closed_forms():
    f = np.array([0.0, 1.0])
    assert racer.robust_cost(f, 1.0) == pytest.approx(math.log((1 + E) / 2))       # 0.6201
    assert racer.robust_reward(f, 1.0) == pytest.approx(-math.log((1 + 1 / E) / 2))  # 0.3799
    assert racer.robust_cost(f, None) == racer.robust_reward(f, None) == 0.5
    # as tau -> inf the robust values approach the mean; as tau -> 0 the worst case
    assert racer.robust_cost(f, 1e4) == pytest.approx(0.5, abs=1e-4)
    assert racer.robust_cost(f, 1e-3) == pytest.approx(1.0, abs=1e-2)


def test_tilted_mean_is_the_worst_case_expected_cost():
    f = np.array([0.0, 1.0])
    # rho_high = [1, e]/(1+e): E_rho_high[f] = e/(1+e) = 0.7311
    assert racer.tilted_mean(f, 1.0, +1) == pytest.approx(E / (1 + E))
    assert racer.tilted_mean(f, 1.0, -1) == pytest.approx(1 / (1 + E))
    assert racer.tilted_mean(f, None, +1) == 0.5
    # it exceeds the penalised C_tau by exactly tau KL(rho_high || rho_n)
    rho = np.array([1.0, E]) / (1 + E)
    kl = float(np.sum(rho * np.log(rho / 0.5)))
    for tau in (1.0, 2.0):
        rho_t = np.array([1.0, math.exp(1 / tau)]) / (1 + math.exp(1 / tau))
        kl_t = float(np.sum(rho_t * np.log(rho_t / 0.5)))
        assert racer.tilted_mean(f, tau, +1) - racer.robust_cost(f, tau) == pytest.approx(
            tau * kl_t)
    # 0.2689 ln 0.5379 + 0.7311 ln 1.4621 = -0.1667 + 0.2777 = 0.1109 = 0.7311 - 0.6201
    assert kl == pytest.approx(0.1109, abs=1e-4)
    # the stage's constraint: tilted mean by default, the penalised form on request
    assert racer.constrained_cost(f, 1.0, "tilted_mean") == pytest.approx(0.7311, abs=1e-4)
    assert racer.constrained_cost(f, 1.0, "penalized") == pytest.approx(0.6201, abs=1e-4)
    with pytest.raises(ValueError, match="constraint"):
        racer.constrained_cost(f, 1.0, "robust")


def test_arm_temperatures_override_the_stage_defaults():
    cfg = racer.Config(arms=[{"name": "racer", "robust_reward": True, "robust_cost": True}],
                       budgets=[1.5], tau_r=0.5, tau_c=1.0)
    assert cfg.constraint == "tilted_mean"
    assert racer.Arm(name="a", robust_reward=True, robust_cost=True).taus(cfg) == (0.5, 1.0)
    assert racer.Arm(name="a", robust_reward=False, robust_cost=True,
                     tau_c=0.25).taus(cfg) == (None, 0.25)
    assert racer.Arm(name="a", robust_reward=False, robust_cost=False,
                     tau_c=0.25).taus(cfg) == (None, None)


def test_multiplier_step_grows_when_over_budget():
    # closed form max(0, (C_U - C)/beta)
    assert racer.multiplier_step(0.0, 3.5, 3.0, 0.01) == pytest.approx(50.0)
    assert racer.multiplier_step(7.0, 2.5, 3.0, 0.01) == 0.0
    # damped: 1 - 0.5 * (0.1 * 1 - 0.5) = 1.2 (over budget: up); 1 - 0.5 * (0.1 + 0.5) = 0.7
    assert racer.multiplier_step(1.0, 3.5, 3.0, 0.1, eta=0.5) == pytest.approx(1.2)
    assert racer.multiplier_step(1.0, 2.5, 3.0, 0.1, eta=0.5) == pytest.approx(0.7)
    assert racer.multiplier_step(0.1, 0.0, 3.0, 0.1, eta=0.5) == 0.0          # projected


def test_policy_step_softmax_of_weighted_gain():
    r, c = np.array([[0.0, 1.0]]), np.array([[1.0, 3.0]])
    # gain = 1*1 - 0.25*1*2 = 0.5; p = sigmoid(0.5/0.5)
    p = racer.policy_step(r, c, np.ones(1), np.ones(1), lam=0.25, beta=0.5)
    assert p == pytest.approx([1 / (1 + math.exp(-1))])
    assert racer.policy_step(r, c, np.ones(1), np.ones(1), lam=1.0, beta=0.0) == [0.0]
    assert racer.entropy(np.array([0.5])) == pytest.approx([math.log(2)])


def test_linear_rate_of_a_geometric_sequence():
    q, r2 = racer.linear_rate(0.5 ** np.arange(20))
    assert q == pytest.approx(0.5) and r2 == pytest.approx(1.0)


def test_linear_rate_ignores_the_reference_solvers_precision_plateau():
    # 1, 0.1, ..., 1e-4, then stuck at 2e-5 (lambda* known to ~1e-5) for 1000 iterations: the
    # fit stops before 10 x 2e-5 = 2e-4, on 1, 0.1, 0.01, 0.001 (q = 0.1, a straight line).
    e = np.concatenate([10.0 ** -np.arange(5), np.full(1000, 2e-5)])
    q, r2 = racer.linear_rate(e)
    assert q == pytest.approx(0.1) and r2 == pytest.approx(1.0)
    # without the cut the plateau dominates the fit and hides the rate
    t = np.arange(len(e))
    assert math.exp(np.polyfit(t, np.log(e), 1)[0]) > 0.99


def _instance(n: int = 12, seed: int = 3) -> tuple[np.ndarray, np.ndarray, float]:
    rng = np.random.default_rng(seed)
    d = rng.integers(2, 6, n)
    r = np.stack([rng.random(n) < 1.0 - 0.15 * d, rng.random(n) < 0.95], 1).astype(float)
    c = np.stack([np.ones(n), 1 + 2 * d + rng.random(n)], 1)
    c = c / c.max()
    return r, c, float(np.mean(c[:, 0] + 0.3 * (c[:, 1] - c[:, 0])))


@pytest.mark.parametrize("constraint", ["tilted_mean", "penalized"])
@pytest.mark.parametrize("taus", [(None, None), (0.5, 1.0)])
def test_primal_dual_matches_the_direct_solution_and_converges_linearly(taus, constraint):
    r, c, budget = _instance()
    if constraint == "penalized":      # one convex program
        ref = racer.solve_cvxpy(r, c, budget, beta=0.1, tau_r=taus[0], tau_c=taus[1])
    else:                              # the 1-D search for lambda*
        ref = racer.solve_lambda_search(r, c, budget, beta=0.1, tau_r=taus[0], tau_c=taus[1])
    assert ref["lam"] > 0       # the budget binds: reasoning everywhere would cost more
    m = float(np.abs(c[:, 1] - c[:, 0]).max())
    k = 1.0 if taus[1] is None else math.exp(m / taus[1])
    pd = racer.primal_dual(r, c, budget, beta=0.1, tau_r=taus[0], tau_c=taus[1], iters=3000,
                           eta=1 / (0.1 + (m * k) ** 2 / 0.4), alpha=0.1, constraint=constraint)
    assert np.abs(pd["p"] - ref["p"]).max() < 1e-3
    assert pd["lam"] == pytest.approx(ref["lam"], abs=1e-3)
    q, r2 = racer.linear_rate(np.abs(pd["lams"] - ref["lam"]))
    assert q < 1.0 and r2 > 0.8       # a straight line on the log scale: linear rate


def _two_items() -> tuple[np.ndarray, np.ndarray, float]:
    """Item 0 costs 1 either way; item 1 costs 1 direct, 1.5 reasoning; reasoning is right on
    both, direct on neither. With tau_c = 0.25, beta = 0.1, tau_r = None (hand-computed):
    - p_0 = sigmoid(gain / beta) = sigmoid(1 / 0.1) = sigmoid(10) (no cost gap, so no lambda);
    - at p_1 = 1/2, f_c = (1, 1.25) and rho_high ∝ (e^(1/0.25), e^(1.25/0.25)) ∝ (1, e), so
      w_1 = 2e/(1+e); the policy step gives p_1 = 1/2 iff gain 1 - lambda w_1 0.5 = 0, i.e.
      lambda* = (1+e)/e = 1 + 1/e = 1.3679;
    - C_rho_high = (1 + 1.25e)/(1+e) = 1.1828, and the multiplier's fixed point
      lambda* = (C_rho_high - C)/beta holds at C = 1.1828 - 0.1 (1 + 1/e) = 1.0460."""
    r = np.array([[0.0, 1.0], [0.0, 1.0]])
    c = np.array([[1.0, 1.0], [1.0, 1.5]])
    return r, c, 1 + 0.25 * E / (1 + E) - 0.1 * (1 + 1 / E)


def test_tilted_mean_saddle_point_by_hand():
    r, c, budget = _two_items()
    assert budget == pytest.approx(1.04598, abs=1e-5)
    sig10 = 1 / (1 + math.exp(-10))
    kw = dict(beta=0.1, tau_r=None, tau_c=0.25)
    ref = racer.solve_lambda_search(r, c, budget, **kw)
    assert ref["p"] == pytest.approx([sig10, 0.5], abs=1e-4)
    assert ref["lam"] == pytest.approx(1 + 1 / E, abs=1e-4)
    # the KL radius of rho_high = (1, e)/(1+e): 0.1109 (test_tilted_mean_is_the_worst_case...)
    assert ref["delta"] == pytest.approx(0.1109, abs=1e-4)
    pd = racer.primal_dual(r, c, budget, iters=2000, eta=0.5, alpha=0.5, **kw)
    assert pd["p"] == pytest.approx([sig10, 0.5], abs=1e-6)
    assert pd["lam"] == pytest.approx(1 + 1 / E, abs=1e-6)
    # the same radius as a convex program: the ball's worst case is the tilt at tau_c = 0.25
    ball = racer.solve_kl_ball_cvxpy(r, c, budget, beta=0.1, tau_r=None, delta=ref["delta"])
    assert ball["p"] == pytest.approx([sig10, 0.5], abs=1e-4)
    assert ball["lam"] == pytest.approx(1 + 1 / E, abs=1e-3)
    assert ball["tau"] == pytest.approx(0.25, abs=1e-3)
    # the penalised variant holds the smaller C_tau to the same budget: less binding, a smaller
    # multiplier and more reasoning on item 1; its fixed point is its own lambda equation
    pen = racer.primal_dual(r, c, budget, iters=2000, eta=0.5, alpha=0.5,
                            constraint="penalized", **kw)
    assert pen["p"][1] > 0.55 and pen["lam"] < 1.30
    c_tau = racer.robust_cost(racer.expected(pen["p"], c), 0.25)
    assert pen["lam"] == pytest.approx((c_tau - budget) / 0.1, abs=1e-6)
    with pytest.raises(ValueError, match="constraint"):
        racer.primal_dual(r, c, budget, constraint="robust", **kw)


def test_lambda_search_agrees_with_the_convex_program_on_the_penalised_form():
    r, c, budget = _instance()
    for taus in ((None, None), (0.5, 1.0)):
        cvx = racer.solve_cvxpy(r, c, budget, beta=0.1, tau_r=taus[0], tau_c=taus[1])
        got = racer.solve_lambda_search(r, c, budget, beta=0.1, tau_r=taus[0], tau_c=taus[1],
                                        constraint="penalized")
        assert np.abs(got["p"] - cvx["p"]).max() < 1e-3
        assert got["lam"] == pytest.approx(cvx["lam"], abs=1e-4)
    # a loose budget binds nothing: lambda* = 0 and the best response at 0
    free = racer.solve_lambda_search(r, c, float(c.max()) + 1, beta=0.1, tau_r=0.5, tau_c=1.0)
    assert free["lam"] == 0.0 and free["evals"] == 1


def test_kl_ball_extremum_is_the_tilted_mean():
    # max_{KL(q||rho) <= delta} E_q[f] over the simplex, by cvxpy, equals E_rho_high[f] at the
    # tau whose tilt has KL = delta: f = (0, 1), tau = 1 gives delta = 0.1109, e/(1+e) = 0.7311
    import cvxpy as cp

    f = np.array([0.0, 1.0])
    w = racer.kl_tilt_weights(f, 1.0, +1)
    delta = float(np.mean(w * np.log(w)))
    q = cp.Variable(2)
    problem = cp.Problem(cp.Maximize(q @ f), [cp.sum(q) == 1, q >= 0,
                                            cp.sum(cp.rel_entr(q, np.full(2, 0.5))) <= delta])
    problem.solve(solver=cp.CLARABEL)
    assert problem.value == pytest.approx(racer.tilted_mean(f, 1.0, +1), abs=1e-6)
    assert problem.value == pytest.approx(E / (1 + E), abs=1e-6)


def test_verdict_parsing_and_malformed_outputs():
    assert stated_value(" 23+45=68; 68-17=51 #### 51") == 51
    assert stated_value(" 23+45-17=-51") == -51
    assert parse_verdict(" 23+45-17=51", 51) == "yes"
    assert parse_verdict(" 23+45=68; 68-17=51 #### 51", 50) == "no"
    assert parse_verdict("", 3) is None and parse_verdict(" 23+45=68; 68-1", 51) is None
    assert score(True, 51, " 23+45-17=51") == (True, False)
    assert score(False, 50, " 23+45-17=50") == (False, False)     # agrees with a wrong answer
    assert score(False, 50, " 23+45-17=51") == (True, False)
    assert score(True, 51, "garbage") == (False, True)    # malformed: counted, scored wrong


def test_judge_formats_and_mixes():
    assert judge_prompt("23+45-17", 51) == "Check 51. Q: 23+45-17=? A:"
    assert reasoning_target("23+45-17") == " 23+45=68; 68-17=51 #### 51"
    assert direct_target("23+45-17") == " 23+45-17=51"
    assert mix_counts(10, [0.4, 0.3, 0.2, 0.1]) == [4, 3, 2, 1]
    assert sum(mix_counts(7, [1, 1, 1])) == 7


def test_budget_baselines():
    c = np.array([[1.0, 5.0], [1.0, 9.0]])     # mean c0 = 1, mean c1 = 7
    assert random_share(c, 4.0) == pytest.approx(0.5)
    assert random_share(c, 0.5) == 0.0 and random_share(c, 9.0) == 1.0
    score_ = np.array([0.9, 0.1])
    t = threshold_at_budget(score_, c, 3.0)    # first item adds 2 -> 3.0 fits, second does not
    assert (score_ > t).tolist() == [True, False]
    assert threshold_at_budget(score_, c, 1.0) == float("inf")


def test_summarize_violations_at_the_budget_boundary():
    """Hand-made evaluation rows: cost exactly C is within budget, C + 1e-6 is over."""
    import polars as pl

    from stages.racer.compare import summarize

    rows = []
    for seed, (erm_cost, racer_cost) in enumerate([(1.5, 1.5), (1.5 + 1e-6, 1.4)]):
        rows += [{"method": "erm", "budget": 1.5, "split": "test_hard", "seed": seed,
                  "acc": 0.70, "cost": erm_cost},
                 {"method": "racer", "budget": 1.5, "split": "test_hard", "seed": seed,
                  "acc": 0.60 + 0.02 * seed, "cost": racer_cost}]
    m = summarize(pl.DataFrame(rows))
    assert m["erm/C1.5/test_hard/violation_rate"] == 0.5       # one seed of two over C
    assert m["racer/C1.5/test_hard/violation_rate"] == 0.0     # exactly C is within budget
    assert m["racer/C1.5/test_hard/acc_mean"] == pytest.approx(0.61)
    assert m["racer/C1.5/test_hard/acc_std"] == pytest.approx(0.01)   # population std
    assert not any(k.startswith("claim_") for k in m)           # the old booleans are gone


def test_claims_by_the_house_rule_on_hand_made_runs():
    """3 seeds at C = 1.5 on test_hard, t_{0.975, 2} = 4.303:
    - ERM costs 1.7, 1.8, 1.9: cost - C = 0.2, 0.3, 0.4, mean 0.3, sd 0.1, half-width
      4.303 * 0.1 / sqrt(3) = 0.248: [0.052, 0.548] above 0: reproduced;
    - RACER costs 1.4 on every seed: cost - C = -0.1, sd 0: three identical differences fail
      the sign test (2 * 0.5^3 > 0.05), so no interval: inconclusive;
    - accuracy RACER 0.60, 0.62, 0.64 vs ERM 0.70: -0.08 +- 4.303 * 0.02 / sqrt(3) =
      [-0.130, -0.030], below 0 against the paper's direction: contradicted;
    - vs the threshold router (one run, 0.65 for every seed): -0.03 +- 0.050 = [-0.080, +0.020]
      holds 0 and the paper's +0.011: inconclusive."""
    import polars as pl

    from stages.racer.compare import Config, results_table, summarize

    rows = [{"method": "threshold", "budget": 1.5, "split": "test_hard", "seed": 0,
             "acc": 0.65, "cost": 2.0}]
    for seed in range(3):
        rows += [{"method": "erm", "budget": 1.5, "split": "test_hard", "seed": seed,
                  "acc": 0.70, "cost": 1.7 + 0.1 * seed},
                 {"method": "racer", "budget": 1.5, "split": "test_hard", "seed": seed,
                  "acc": 0.60 + 0.02 * seed, "cost": 1.4}]
    m = summarize(pl.DataFrame(rows), Config(paper_gain_vs_best_router=0.011))
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert m["claim/erm_overspends/diff"] == pytest.approx(0.3)
    assert m["claim/erm_overspends/ci_low"] == pytest.approx(0.3 - half, abs=1e-5)
    assert m["claim/erm_overspends/ci_high"] == pytest.approx(0.3 + half, abs=1e-5)
    assert m["claim/erm_overspends/verdict"] == 1.0 and m["claim/erm_overspends/pairs"] == 3
    assert m["claim/racer_within_budget/verdict"] == 0.0
    assert m["claim/racer_within_budget/diff"] == pytest.approx(-0.1)
    assert m["claim/racer_acc_vs_erm/verdict"] == -1.0
    assert m["claim/racer_acc_vs_erm/ci_high"] == pytest.approx(-0.08 + half / 5, abs=1e-5)
    assert m["claim/racer_acc_vs_threshold/verdict"] == 0.0
    assert m["claim/racer_acc_vs_threshold/paper_effect"] == 0.011
    assert "claim/racer_c_within_budget/verdict" not in m        # arm not run: no claim
    table = results_table({"evaluate": m})
    assert ("ERM (ACER) breaks the budget under the shift (cost - C > 0): **reproduced**: "
            "+0.300 [+0.052, +0.548] over 3 pairs") in table
    assert "**contradicted**: -0.080 [-0.130, -0.030] over 3 pairs" in table
    assert "**inconclusive**: -0.030 [-0.080, +0.020] over 3 pairs; MDE" in table
    assert "paper: +0.011" in table


def test_judge_claim_pairs_the_two_judges_per_item():
    from stages.racer.compare import judge_claim

    # reasoning right on 9 of 10 items, direct on 4 of them: per-item differences 0 (5 items)
    # and +1 (5 items), mean 0.5; a resample's mean is 0 only when it draws no +1 item
    # (probability 0.5^10), so the bootstrap CI lies above 0
    r = np.array([[1.0, 1.0]] * 4 + [[0.0, 1.0]] * 5 + [[0.0, 0.0]])
    m = judge_claim(r, paper_effect=0.10)
    assert m["claim/reasoning_gain/diff"] == pytest.approx(0.5)
    assert m["claim/reasoning_gain/pairs"] == 10
    assert m["claim/reasoning_gain/ci_low"] > 0 and m["claim/reasoning_gain/verdict"] == 1.0
    assert m["claim/reasoning_gain/paper_effect"] == 0.10


def test_solver_check_bound_is_thm42_rate_for_lambda():
    # ERM (no tilt: K = 1), cost gaps up to M = 1, beta = 0.5: Thm 4.2's KL bound decays as
    # q^(2t) with q = M^2K^2 / (M^2K^2 + 2 beta^2) = 1 / 1.5, so |lambda_t - lambda*| as q^t
    from stages.racer import solver_check as racer_solver

    r = np.array([[0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    c = np.array([[0.1, 1.0], [0.1, 0.6], [0.0, 1.0], [0.1, 0.5]])  # M = 1 (row 3)
    got = racer_solver.check_instance(r, c, 0.4, beta=0.5, tau_r=None, tau_c=None, iters=200)
    assert got["rate_bound"] == pytest.approx(2 / 3)
    assert got["objective_gap"] >= 0 and got["max_abs_dp"] < 1e-3
    with pytest.raises(ValueError, match="greater than 0"):
        racer_solver.Config(betas=[0.0, 0.1])


def test_solver_check_names_its_constraint_and_certifies_the_tilted_mean():
    from stages.racer import solver_check as racer_solver

    r, c, budget = _instance()
    got = racer_solver.check_instance(r, c, budget, 0.1, 0.5, 1.0, iters=3000)
    assert got["max_abs_dp"] < 1e-3 and got["abs_dlambda"] < 1e-3
    assert got["delta_star"] > 0 and got["ball_max_abs_dp"] < 1e-3   # the KL-ball program agrees
    pen = racer_solver.check_instance(r, c, budget, 0.1, 0.5, 1.0, iters=3000,
                                      constraint="penalized")
    assert "ball_max_abs_dp" not in pen and pen["max_abs_dp"] < 1e-3
    # C_tau <= C_rho_high: the penalised constraint binds less, its multiplier is smaller
    assert pen["lambda_star"] < got["lambda_star"]
    assert racer_solver.Config().constraint == "tilted_mean"
    with pytest.raises(ValueError, match="constraint"):
        racer_solver.check_instance(r, c, budget, 0.1, 0.5, 1.0, iters=10, constraint="robust")
