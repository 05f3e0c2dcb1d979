"""The RL comparison arithmetic on hand-computed curves."""

from __future__ import annotations

import pytest

from stages.r2vpo.compare import (
    Config,
    auc,
    check_budgets,
    mean_std,
    results_table,
    rollouts_to_reach,
    summarize,
)


def test_mean_std_is_population_std():
    assert mean_std([1.0, 3.0]) == (2.0, 1.0)
    with pytest.raises(ValueError):
        mean_std([])


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
    check_budgets({"a": same, "b": dict(same)})
    with pytest.raises(ValueError, match="'b' ran with rounds = 4"):
        check_budgets({"a": same, "b": {**same, "rounds": 4}})


def test_config_checks_the_baseline_and_duplicates():
    with pytest.raises(ValueError, match="baseline"):
        Config(arms=["a", "b"], baseline="c")
    with pytest.raises(ValueError, match="twice"):
        Config(arms=["a", "a"], baseline="a")
