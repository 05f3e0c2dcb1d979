"""HSIR's comparison on hand cases: budget refusal, per-arm summaries, pool statistics, the
claims' verdicts (reproduced, inconclusive, contradicted) and the README table."""

from __future__ import annotations

import math

import polars as pl
import pytest
from pydantic import ValidationError

from stages.core.stats import check_budgets
from stages.hsir import compare as hc

T975_2 = 4.302653  # t_{0.975, 2}: 3 seeds
T80_2 = 1.060660   # t_{0.80, 2}


def test_unequal_budgets_are_refused_with_arm_and_key():
    same = {"rounds": 2, "samples_per_query": 4, "sft_steps_per_round": 16}
    check_budgets({"star": same, "hsir": dict(same)}, ["rounds", "sft_steps_per_round"])
    with pytest.raises(ValueError, match="'hsir' ran with sft_steps_per_round = 32"):
        check_budgets({"star": same, "hsir": {**same, "sft_steps_per_round": 32}},
                      hc.SELF_BUDGET_KEYS)


def test_summarize_arms_and_relative_changes():
    finals = {"star": {"acc": [0.4, 0.6], "hard_acc": [0.1, 0.1], "tokens_per_solved": [50, 50]},
              "hsir": {"acc": [0.55, 0.55], "hard_acc": [0.2, 0.2],
                       "tokens_per_solved": [30, 30]}}
    m = hc.summarize_arms(finals, "star", "self")
    assert m["self/star/acc_mean"] == 0.5 and m["self/star/acc_std"] == pytest.approx(0.1)
    assert m["self/hsir/acc_vs_star"] == pytest.approx(0.1)
    assert m["self/hsir/hard_acc_vs_star"] == pytest.approx(1.0)
    assert m["self/hsir/tokens_per_solved_vs_star"] == pytest.approx(-0.4)
    assert m["self/star/acc_vs_star"] == 0.0 and m["self/hsir/order"] == 1.0
    assert math.isnan(hc.relative(0.3, 0.0))


def test_results_table_is_the_metrics_rendered():
    finals = {"star": {"acc": [0.5], "hard_acc": [0.1], "tokens_per_solved": [50.0]},
              "hsir": {"acc": [0.6], "hard_acc": [0.2], "tokens_per_solved": [40.0]}}
    m = {**hc.summarize_arms(finals, "star", "self"),
         **hc.summarize_arms({"grpo": finals["star"]}, "grpo", "rl"),
         "self/hsir/pool_hard_share": 0.25, "self/hsir/faithful_rate": 0.5,
         "self/hsir/pool_hard_coverage": 0.125,
         "indiv/eigenscore/spearman_repeats": -0.8}
    table = hc.results_table({"compare": dict(sorted(m.items()))})
    lines = table.splitlines()
    star_row = next(i for i, line in enumerate(lines) if line.startswith("| star |"))
    hsir_row = next(i for i, line in enumerate(lines) if line.startswith("| hsir |"))
    assert star_row < hsir_row                     # compare's order, not alphabetical
    assert "| 0.600 ± 0.000 | +20.0% |" in lines[hsir_row] and "| -20.0% |" in lines[hsir_row]
    assert "| 25.0% | 12.5% |" in lines[hsir_row] and "| 50% |" in lines[hsir_row]
    assert "| grpo |" in table and "| eigenscore | -0.800 | n/a |" in table
    assert "Claims" not in table                   # none in the metrics: none rendered
    assert hc.results_table({}) == "_No results yet: run the pipeline._\n"


def test_pool_summary_weights_faithfulness_by_rows():
    frame = pl.DataFrame({"round": [0.0, 1.0, 2.0], "pool_hard_share": [None, 0.2, 0.4],
                          "pool_size": [None, 10.0, 20.0], "pool_mean_repeats": [None, 1.0, 0.0],
                          "pool_veriexit_rows": [None, 1.0, 3.0],
                          "pool_veriexit_faithful": [None, 1.0, 1.0],
                          "pool_hard_coverage": [None, 0.1, 0.3],
                          "mean_repeats": [0.5, 0.5, 0.5]})  # greedy outputs', not the pool's
    s = hc.pool_summary(frame)
    assert s["pool_hard_share"] == pytest.approx(0.3) and s["faithful_rate"] == 0.5
    assert s["veriexit_rows"] == 2.0 and s["pool_size"] == 15.0
    assert s["pool_hard_coverage"] == pytest.approx(0.2)


# --- claims ------------------------------------------------------------------------------------

PER_SEED = {  # arm -> metric -> seed -> final-round value
    "star": {"acc": {0: 0.4, 1: 0.5, 2: 0.6}, "hard_acc": {0: 0.0, 1: 0.1, 2: 0.2},
             "tokens_per_solved": {0: 50.0, 1: 40.0, 2: 60.0}},
    "hsir": {"acc": {0: 0.48, 1: 0.6, 2: 0.72}, "hard_acc": {0: 0.1, 1: 0.0, 2: 0.2},
             "tokens_per_solved": {0: 60.0, 1: 51.0, 2: 70.0}},
}


def test_arm_claims_one_reproduced_one_inconclusive_one_contradicted():
    c = hc.arm_claims(PER_SEED, "hsir", "star", "self", 0.109, -0.424)
    # accuracy: d = [0.08, 0.10, 0.12] / star's mean 0.5 = [0.16, 0.20, 0.24], sd 0.04
    p = "claim/self/acc/hsir_vs_star"
    half = T975_2 * 0.04 / math.sqrt(3)
    assert c[f"{p}/diff"] == pytest.approx(0.2)
    assert (c[f"{p}/ci_low"], c[f"{p}/ci_high"]) == (pytest.approx(0.2 - half, abs=1e-5),
                                                     pytest.approx(0.2 + half, abs=1e-5))
    assert c[f"{p}/verdict"] == 1.0 and c[f"{p}/paper_effect"] == 0.109   # +0.109 in the CI
    # hard accuracy, in points: d = [0.1, -0.1, 0.0], sd 0.1: the CI holds 0
    p = "claim/self/hard_acc/hsir_vs_star"
    assert c[f"{p}/diff"] == pytest.approx(0.0, abs=1e-12) and c[f"{p}/verdict"] == 0.0
    assert c[f"{p}/mde"] == pytest.approx((T975_2 + T80_2) * 0.1 / math.sqrt(3), abs=1e-5)
    assert f"{p}/paper_effect" not in c
    # tokens per solved query: d = [10, 11, 10] / 50 = [0.2, 0.22, 0.2]; the paper says fewer
    p = "claim/self/tokens_per_solved/hsir_vs_star"
    sd = math.sqrt(((0.2 - 0.62 / 3) ** 2 * 2 + (0.22 - 0.62 / 3) ** 2) / 2)
    assert c[f"{p}/diff"] == pytest.approx(0.62 / 3)
    assert c[f"{p}/ci_low"] == pytest.approx(0.62 / 3 - T975_2 * sd / math.sqrt(3), abs=1e-5)
    assert c[f"{p}/verdict"] == -1.0 and c[f"{p}/paper_effect"] == -0.424


def test_arm_claims_drop_seeds_without_a_value_and_rl_has_no_hard_claim():
    per_seed = {arm: {k: dict(v) for k, v in metrics.items()} for arm, metrics in PER_SEED.items()}
    per_seed["hsir"]["tokens_per_solved"][2] = math.nan     # nothing solved on seed 2
    c = hc.arm_claims(per_seed, "hsir", "star", "rl", hard=False)
    assert c["claim/rl/tokens_per_solved/hsir_vs_star/pairs"] == 2.0
    # relative to star's mean over the 2 pairs left (45): d = [10, 11] / 45
    assert c["claim/rl/tokens_per_solved/hsir_vs_star/diff"] == pytest.approx(10.5 / 45)
    assert not any("hard_acc" in k for k in c)
    per_seed["star"]["acc"].pop(2)
    with pytest.raises(ValueError, match=r"on one side only: \[2\]"):
        hc.arm_claims(per_seed, "hsir", "star", "rl")


def test_pool_claim_and_per_seed_values_from_the_curve():
    rows = [{"seed": s, "round": float(r), "acc": 0.1 * r + 0.01 * s, "hard_acc": 0.0,
             "tokens_per_solved": 30.0, "pool_hard_share": None if r == 0 else 0.01 * r * (s + 1)}
            for s in (0, 1, 2) for r in (0, 1, 2)]
    frame = pl.DataFrame(rows)
    assert hc.seed_finals(frame, ("acc",)) == {"acc": pytest.approx({0: 0.2, 1: 0.21, 2: 0.22})}
    star = hc.seed_pool_hard_share(frame)              # mean of rounds 1 and 2: 0.015 * (s + 1)
    assert star == pytest.approx({0: 0.015, 1: 0.03, 2: 0.045})
    veri = {0: 0.03, 1: 0.05, 2: 0.06}                 # d = [0.015, 0.02, 0.015]
    c = hc.pool_claim({"veriexit": veri, "star": star}, "veriexit", "star")
    assert c["claim/self/pool_hard_share/veriexit_vs_star/diff"] == pytest.approx(0.05 / 3)
    assert c["claim/self/pool_hard_share/veriexit_vs_star/verdict"] == 1.0


def test_spearman_claim_by_hand():
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # every resample of a perfectly reversed ranking has rho -1 (or none, when constant)
    c = hc.spearman_claim(x, x[::-1], draws=200, seed=0)
    assert (c.diff, c.low, c.high) == (pytest.approx(-1.0), pytest.approx(-1.0),
                                       pytest.approx(-1.0))
    assert c.verdict == 1 and c.n == 6 and math.isnan(c.mde)
    assert hc.spearman_claim(x, x, draws=200, seed=0).verdict == -1   # positive: contradicted


def test_results_table_renders_each_claim_sentence():
    m = hc.summarize_arms({a: {k: list(v.values()) for k, v in PER_SEED[a].items()}
                           for a in ("star", "hsir")}, "star", "self")
    m.update(hc.arm_claims(PER_SEED, "hsir", "star", "self", 0.109, -0.424))
    table = hc.results_table({"compare": dict(sorted(m.items()))})
    assert ("| hsir vs star: held-out accuracy, change relative to star (paper: higher) | "
            "**reproduced**: +20.0% [+10.1%, +29.9%] over 3 pairs; MDE 12.4%; paper: +10.9% |"
            ) in table
    assert "| hsir vs star: hard-split accuracy, difference (spec: higher) | **inconclusive**:" \
        in table
    assert "**contradicted**: +20.7%" in table and "paper: -42.4% |" in table
    assert table.index("held-out accuracy, change") < table.index("hard-split accuracy, diff")


def test_config_checks_the_claim_arms():
    arms = ["star", "veriexit", "hsir"]
    hc.Config(arms=arms, rl_arms=["grpo", "h_grpo"])
    with pytest.raises(ValidationError, match="method 'hsir' must be one of the arms"):
        hc.Config(arms=["star", "veriexit"])
    with pytest.raises(ValidationError, match="veriexit_arm 'star'"):
        hc.Config(arms=arms, veriexit_arm="star")
    with pytest.raises(ValidationError, match="rl_method 'h_grpo'"):
        hc.Config(arms=arms, rl_arms=["grpo", "grpo_length"])
    hc.Config(arms=arms, rl_arms=["grpo", "grpo_length"], rl_method=None)
