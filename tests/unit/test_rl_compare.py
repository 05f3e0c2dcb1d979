"""The RL comparison arithmetic on hand-computed curves, and its claims' verdicts."""

from __future__ import annotations

import math

import pytest

from stages.core.stats import check_budgets
from stages.r2vpo.compare import (
    BUDGET_KEYS,
    Config,
    auc,
    control_claims,
    llm_claims,
    results_table,
    rollouts_to_reach,
    summarize,
)

T975_2 = 4.302653  # t_{0.975, 2}: 3 seeds
T80_2 = 1.060660   # t_{0.80, 2}


def test_rollouts_to_reach_and_auc_by_hand():
    pts = [(0.0, 0.2), (100.0, 0.5), (200.0, 0.6)]
    assert rollouts_to_reach(pts, 0.5) == 100.0
    assert rollouts_to_reach(pts, 0.61) is None
    # trapezoids: 100 * 0.35 + 100 * 0.55 = 90, over a span of 200
    assert auc(pts) == pytest.approx(0.45)
    assert auc([(0.0, 0.3)]) == 0.3


def test_summarize_by_hand():
    curves = {
        "grpo": {0: [(0.0, 0.2), (100.0, 0.4)], 1: [(0.0, 0.2), (100.0, 0.6)]},
        "r2vpo": {0: [(0.0, 0.2), (50.0, 0.55), (100.0, 0.6)],
                  1: [(0.0, 0.2), (50.0, 0.3), (100.0, 0.6)]},
    }
    m = summarize(curves, "grpo", reach_frac=0.8)
    # start 0.2, best final mean 0.6: 0.2 + 0.8 * (0.6 - 0.2)
    assert m["reach_level"] == pytest.approx(0.52) and m["start_acc"] == pytest.approx(0.2)
    assert m["grpo/final_acc_mean"] == pytest.approx(0.5)
    assert m["grpo/final_acc_std"] == pytest.approx(0.1)
    assert m["r2vpo/gain_vs_grpo"] == pytest.approx(0.2)     # (0.6 - 0.5) / 0.5
    # grpo seed 0 never reaches 0.52 (counts the budget, 100), seed 1 at 100
    assert m["grpo/rollouts_to_reach_mean"] == 100.0 and m["grpo/reached_frac"] == 0.5
    assert m["r2vpo/rollouts_to_reach_mean"] == pytest.approx(75.0)  # 50 and 100
    assert m["r2vpo/reached_frac"] == 1.0
    table = results_table({"compare": m})
    assert "| r2vpo | 0.600 ± 0.000 | +20.0% |" in table


def test_unequal_budgets_are_refused_with_the_key_named():
    same = {"rounds": 3, "prompts_per_round": 2, "num_generations": 4, "minibatches": 1,
            "num_iterations": 2, "max_completion_length": 16}
    check_budgets({"a": same, "b": dict(same)}, BUDGET_KEYS)
    with pytest.raises(ValueError, match="'b' ran with rounds = 4"):
        check_budgets({"a": same, "b": {**same, "rounds": 4}}, BUDGET_KEYS)


def test_config_checks_the_baseline_and_duplicates():
    with pytest.raises(ValueError, match="baseline"):
        Config(arms=["a", "b"], baseline="c")
    with pytest.raises(ValueError, match="twice"):
        Config(arms=["a", "a"], baseline="a")
    with pytest.raises(ValueError, match="method 'r2vpo' is not one of"):
        Config(arms=["grpo", "b"], baseline="grpo")
    with pytest.raises(ValueError, match="both 'grpo'"):
        Config(arms=["grpo"], baseline="grpo", method="grpo")


# --- claims: one reproduced, one inconclusive, one contradicted ------------------------------

CURVES = {  # start 0.2 everywhere; grpo ends 0.4 / 0.5 / 0.6, r2vpo 0.48 / 0.6 / 0.72
    "grpo": {0: [(0.0, 0.2), (100.0, 0.3), (200.0, 0.4)],
             1: [(0.0, 0.2), (100.0, 0.3), (200.0, 0.5)],
             2: [(0.0, 0.2), (100.0, 0.3), (200.0, 0.6)]},
    "r2vpo": {0: [(0.0, 0.2), (100.0, 0.3), (200.0, 0.48)],
              1: [(0.0, 0.2), (100.0, 0.55), (200.0, 0.6)],
              2: [(0.0, 0.2), (100.0, 0.6), (200.0, 0.72)]},
}


def test_llm_claims_by_hand():
    m = summarize(CURVES, "grpo", reach_frac=0.8)
    assert m["reach_level"] == pytest.approx(0.52)       # 0.2 + 0.8 * (0.6 - 0.2)
    c = llm_claims(CURVES, m["reach_level"], "r2vpo", "grpo", 0.17, -0.5)
    # final accuracy: d = [0.08, 0.10, 0.12] / grpo's mean 0.5 = [0.16, 0.20, 0.24], sd 0.04
    p = "claim/final_acc/r2vpo_vs_grpo"
    half = T975_2 * 0.04 / math.sqrt(3)
    assert c[f"{p}/diff"] == pytest.approx(0.2)
    assert c[f"{p}/ci_low"] == pytest.approx(0.2 - half, abs=1e-5)
    assert c[f"{p}/ci_high"] == pytest.approx(0.2 + half, abs=1e-5)
    assert c[f"{p}/mde"] == pytest.approx((T975_2 + T80_2) * 0.04 / math.sqrt(3), abs=1e-5)
    assert c[f"{p}/verdict"] == 1.0 and c[f"{p}/pairs"] == 3.0       # reproduced
    assert c[f"{p}/paper_effect"] == 0.17
    # rollouts to reach 0.52: grpo never (200, 200, 200: the budget), r2vpo 200, 100, 100;
    # relative to 200: d = [0, -0.5, -0.5], mean -1/3, sd sqrt(1/12)
    p = "claim/rollouts_to_reach/r2vpo_vs_grpo"
    half = T975_2 * math.sqrt(1 / 12) / math.sqrt(3)
    assert c[f"{p}/diff"] == pytest.approx(-1 / 3)
    assert c[f"{p}/ci_low"] == pytest.approx(-1 / 3 - half, abs=1e-5)
    assert c[f"{p}/ci_high"] == pytest.approx(-1 / 3 + half, abs=1e-5)
    assert c[f"{p}/verdict"] == 0.0                                   # inconclusive
    # no arm improves: level = start, everyone reaches it at 0 rollouts: no relative change
    flat = {a: {s: [(0.0, 0.2), (100.0, 0.2)] for s in (0, 1)} for a in ("grpo", "r2vpo")}
    c = llm_claims(flat, 0.2, "r2vpo", "grpo", 0.17, -0.5)
    assert c["claim/rollouts_to_reach/r2vpo_vs_grpo/verdict"] == 0.0
    assert "claim/rollouts_to_reach/r2vpo_vs_grpo/diff" not in c      # NaN is not a metric


def test_control_claims_by_hand():
    lasts = {("Pendulum-v1", "ppo"): {0: -100.0, 1: -120.0, 2: -110.0},
             ("Pendulum-v1", "r2vpo"): {0: -150.0, 1: -170.0, 2: -161.0},
             ("sparse:Pendulum-v1", "ppo"): {0: -300.0, 1: -400.0, 2: -350.0},
             ("sparse:Pendulum-v1", "r2vpo"): {0: -250.0, 1: -420.0, 2: -300.0}}
    c = control_claims(lasts, "r2vpo", "ppo")
    # dense: d = [-50, -50, -51], mean -50.333, sd sqrt(1/3): the CI is below 0
    p = "claim/control/Pendulum-v1/r2vpo_vs_ppo"
    half = T975_2 * math.sqrt(1 / 3) / math.sqrt(3)
    assert c[f"{p}/diff"] == pytest.approx(-151 / 3)
    assert c[f"{p}/ci_high"] == pytest.approx(-151 / 3 + half, abs=1e-4)
    assert c[f"{p}/verdict"] == -1.0                                  # contradicted
    assert f"{p}/paper_effect" not in c                               # the paper gives none
    # sparse: d = [50, -20, 50]: inconclusive; gap vs dense: [100, 30, 101], mean 77
    assert c["claim/control/sparse_Pendulum-v1/r2vpo_vs_ppo/verdict"] == 0.0
    p = "claim/control_sparse_gap/sparse_Pendulum-v1/r2vpo_vs_ppo"
    assert c[f"{p}/diff"] == pytest.approx(77.0) and c[f"{p}/verdict"] == 0.0
    with pytest.raises(ValueError, match="lack arm 'r2vpo'"):
        control_claims({("Pendulum-v1", "ppo"): {0: 1.0}}, "r2vpo", "ppo")


def test_results_table_renders_each_claim_sentence():
    m = summarize(CURVES, "grpo", reach_frac=0.8)
    m.update(llm_claims(CURVES, m["reach_level"], "r2vpo", "grpo", 0.17, -0.5))
    table = results_table({"compare": dict(sorted(m.items()))})
    row = next(line for line in table.splitlines() if line.startswith("| r2vpo vs grpo: final"))
    assert row == ("| r2vpo vs grpo: final accuracy, change relative to grpo (paper: higher) | "
                   "**reproduced**: +20.0% [+10.1%, +29.9%] over 3 pairs; MDE 12.4%; "
                   "paper: +17.0% |")
    assert "**inconclusive**: -33.3%" in table
    assert table.index("final accuracy, change") < table.index("rollouts to reach the target")
