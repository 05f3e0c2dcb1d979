"""EDCO's comparison on hand cases: budget refusal, per-arm summaries, the claims' verdicts
(reproduced, inconclusive, contradicted) and the README table."""

from __future__ import annotations

import math

import polars as pl
import pytest
from pydantic import ValidationError

from stages.core.stats import check_budgets
from stages.edco import compare as ec

T975_2 = 4.302653  # t_{0.975, 2}: 3 seeds
T80_2 = 1.060660   # t_{0.80, 2}


def test_compare_refuses_unequal_budgets_naming_arm_and_key():
    same = {"rounds": 4, "top_n": 448, "batch_size": 32, "steps_per_round": 14}
    check_budgets({"sft_edco": same, "sft_random": dict(same)}, ec.SFT_BUDGET_KEYS)
    with pytest.raises(ValueError, match="'sft_random' ran with top_n = 224"):
        check_budgets({"sft_edco": same, "sft_random": {**same, "top_n": 224}},
                      ec.SFT_BUDGET_KEYS)


def _curve(accs: dict[int, list[float]], noisy: float) -> pl.DataFrame:
    rows = []
    for seed, per_round in accs.items():
        for r, acc in enumerate(per_round):
            rows.append({"seed": seed, "round": float(r), "acc": acc, "acc_mul": acc / 2,
                         "acc_plus_minus": acc, "noisy_frac": None if r == 0 else noisy,
                         "mul_share": None if r == 0 else 0.5,
                         "new_items": None if r == 0 else 4.0,
                         "unique_items": None if r == 0 else 4.0 * r})
    return pl.DataFrame(rows)


def test_summary_and_results_table_are_the_metrics_rendered():
    frames = {"sft_edco": _curve({0: [0.3, 0.5, 0.6], 1: [0.3, 0.5, 0.8]}, 0.10),
              "sft_random": _curve({0: [0.3, 0.4, 0.5], 1: [0.3, 0.4, 0.5]}, 0.05)}
    m = ec.summarize_arms(frames, "sft_random", "sft")
    assert m["sft/sft_edco/acc_mean"] == pytest.approx(0.7)
    assert m["sft/sft_edco/acc_std"] == pytest.approx(0.1)
    assert m["sft/sft_edco/delta_vs_sft_random"] == pytest.approx(0.2)
    assert m["sft/sft_edco/auc_mean"] == pytest.approx((0.55 + 0.65) / 2)   # rounds 1..R
    assert m["sft/sft_edco/r1/acc_mean"] == pytest.approx(0.5)
    assert m["sft/sft_edco/noisy_frac"] == pytest.approx(0.10)
    assert m["sft/initial_acc"] == pytest.approx(0.3)
    metrics = {**m, "sft/rounds": 2.0, "sft/top_n": 4.0, "pool/noisy_frac": 0.05,
               "estimator/L4/spearman": 0.812, "estimator/L4/token_reduction": 0.8,
               "estimator/L4/mean_tokens": 4.0, "estimator/full_mean_tokens": 20.0}
    table = ec.results_table({"compare": dict(sorted(metrics.items()))})
    edco_row = next(line for line in table.splitlines() if line.startswith("| sft_edco |"))
    assert "| 0.700 ± 0.100 | +20.0 |" in edco_row and "| 10.0% |" in edco_row
    assert "| sft_edco | 0.500 / 10.0% / 4 | 0.700 / 10.0% / 4 |" in table
    assert "| 4 | +0.812 | n/a | 4.0 | 80.0% |" in table   # cost in tokens decoded
    assert "ms" not in table and "time reduction" not in table   # wall times: MLflow only
    assert table.index("| sft_edco |") < table.index("| sft_random |")  # compare's order
    assert "Claims" not in table                   # none in the metrics: none rendered
    assert ec.results_table({}) == "_No results yet: run the pipeline._\n"


# --- claims ------------------------------------------------------------------------------------

FINALS = {"sft_random": [0.4, 0.5, 0.6], "sft_edco": [0.48, 0.6, 0.72], "sft_ppl": [0.5, 0.4, 0.6],
          "rl_random": [0.30, 0.32, 0.31], "rl_edco": [0.31, 0.31, 0.31]}
FRAMES = {arm: _curve({s: [0.3, 0.35, acc] for s, acc in enumerate(accs)}, 0.05)
          for arm, accs in FINALS.items()}


def test_claims_reproduced_inconclusive_and_smaller_than_the_paper():
    finals = {arm: ec.final_by_seed(f) for arm, f in FRAMES.items()}
    assert finals["sft_edco"] == {0: 0.48, 1: 0.6, 2: 0.72}
    sft = ec.accuracy_claims(finals, [("sft_edco", "sft_random"), ("sft_edco", "sft_ppl"),
                                      ("sft_ppl", "sft_random")], "sft")
    # EDCO vs Random: d = [0.08, 0.10, 0.12], mean 0.1, sd 0.02: above 0
    p = "claim/sft/acc/sft_edco_vs_sft_random"
    half = T975_2 * 0.02 / math.sqrt(3)
    assert sft[f"{p}/diff"] == pytest.approx(0.1)
    assert sft[f"{p}/ci_low"] == pytest.approx(0.1 - half, abs=1e-6)
    assert sft[f"{p}/ci_high"] == pytest.approx(0.1 + half, abs=1e-6)
    assert sft[f"{p}/mde"] == pytest.approx((T975_2 + T80_2) * 0.02 / math.sqrt(3), abs=1e-6)
    assert sft[f"{p}/verdict"] == 1.0 and sft[f"{p}/pairs"] == 3.0
    assert f"{p}/paper_effect" not in sft                      # no paper number for SFT
    # PPL vs Random: d = [0.1, -0.1, 0.0]: the CI holds 0 and no paper effect to exclude
    assert sft["claim/sft/acc/sft_ppl_vs_sft_random/verdict"] == 0.0
    assert sft["claim/sft/acc/sft_edco_vs_sft_ppl/diff"] == pytest.approx(0.1)
    # RL: d = [0.01, -0.01, 0.0], mean 0, sd 0.01: holds 0 (inconclusive), and excludes the
    # paper's +0.065: said beside the verdict, not as a contradiction (stages/core/stats.py)
    rl = ec.accuracy_claims(finals, [("rl_edco", "rl_random")], "rl",
                            {("rl_edco", "rl_random"): 0.065})
    p = "claim/rl/acc/rl_edco_vs_rl_random"
    assert rl[f"{p}/ci_high"] == pytest.approx(T975_2 * 0.01 / math.sqrt(3), abs=1e-6)
    assert rl[f"{p}/verdict"] == 0.0 and rl[f"{p}/paper_effect"] == 0.065
    from stages.core import stats
    c = stats.read_claim(rl, p)
    assert c.excludes_paper_effect and "(outside the CI)" in c.sentence()


def test_results_table_renders_each_claim_sentence():
    finals = {arm: ec.final_by_seed(f) for arm, f in FRAMES.items()}
    m = {**ec.summarize_arms({a: FRAMES[a] for a in ("sft_edco", "sft_random")}, "sft_random",
                             "sft"),
         **ec.accuracy_claims(finals, [("rl_edco", "rl_random")], "rl",
                              {("rl_edco", "rl_random"): 0.065}),
         **ec.accuracy_claims(finals, [("sft_edco", "sft_random")], "sft"),
         "sft/rounds": 2.0, "sft/top_n": 4.0, "pool/noisy_frac": 0.05}
    table = ec.results_table({"compare": dict(sorted(m.items()))})
    assert ("| SFT: sft_edco above sft_random | **reproduced**: +0.100 [+0.050, +0.150] over 3 "
            "pairs; MDE 0.062 |") in table
    assert ("| RL: rl_edco above rl_random | **inconclusive**: +0.000 [-0.025, +0.025] over 3 "
            "pairs; MDE 0.031; paper: +0.065 (outside the CI) |") in table
    assert table.index("| SFT: sft_edco") < table.index("| RL: rl_edco")


def test_config_checks_the_claim_arms():
    arms = ["sft_edco", "sft_random", "sft_ppl"]
    ec.Config(sft_arms=arms, rl_arms=["rl_edco", "rl_random"])
    ec.Config(sft_arms=["sft_edco", "sft_random"], sft_ppl=None)
    with pytest.raises(ValidationError, match="sft_ppl 'sft_ppl' must be one of"):
        ec.Config(sft_arms=["sft_edco", "sft_random"])
    with pytest.raises(ValidationError, match="sft_method 'sft_random'"):
        ec.Config(sft_arms=arms, sft_method="sft_random")
    with pytest.raises(ValidationError, match="rl_method 'rl_edco'"):
        ec.Config(sft_arms=arms, rl_arms=["rl_x", "rl_random"])
