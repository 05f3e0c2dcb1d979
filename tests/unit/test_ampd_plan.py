"""AMPD replica-plan ILP (HiGHS): a hand-solved instance, agreement with brute-force enumeration
on random small instances (both objectives), infeasibility, and strategies from α-β constants."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from stages.ampd.plan import (PlanConfig, Strategy, brute_force_plan, evaluate_plan,
                              normalised_latencies, solve_plan, tp_strategies)

# ρ = 0.5: τ_pre = 1.5 S. SLO_TTFT = 2, SLO_ITL = 0.05.
#            g  μ_pre  S    μ_dec itl     r_pre   r_dec   capacity per GPU (pre μρ / dec μ)
TP1 = Strategy(name="tp1", gpus=1, prefill_tokens_per_s=1000, prefill_latency_s=0.5,
               decode_tokens_per_s=200, itl_s=0.04)           # 0.375   0.8     500 / 200
TP2 = Strategy(name="tp2", gpus=2, prefill_tokens_per_s=1800, prefill_latency_s=0.3,
               decode_tokens_per_s=360, itl_s=0.025)          # 0.225   0.5     450 / 180
SLOW = Strategy(name="slow", gpus=1, prefill_tokens_per_s=100, prefill_latency_s=2.0,
                decode_tokens_per_s=50, itl_s=0.075)          # 1.5     1.5     (never worth it)
HAND = dict(gpu_budget=6, session_rate=1.0, prefill_tokens_per_session=1500,
            decode_tokens_per_session=400, slo_ttft_s=2.0, slo_itl_s=0.05, max_utilisation=0.5,
            decode_headroom=0.0)


def test_min_max_latency_hand_solved():
    """Demand: 1500 prefill and 400 decode tokens/s. Z = 0.5 needs decode on tp2 only (2
    replicas = 4 GPUs), leaving 2 GPUs that give at most 1000 < 1500 prefill: infeasible. Z = 0.8
    (tp1 decode) is feasible; its fewest-GPU plan is 3 tp1 prefill (exactly 1500) + 2 tp1 decode
    (exactly 400) = 5 GPUs. `slow` has the worst latency but is unused, so it must not raise Z
    (the big-M rows switch its latency off)."""
    cfg = PlanConfig(objective="min_max_latency", **HAND)
    r_pre, r_dec = normalised_latencies([TP1, TP2, SLOW], cfg)
    assert r_pre.tolist() == pytest.approx([0.375, 0.225, 1.5])
    assert r_dec.tolist() == pytest.approx([0.8, 0.5, 1.5])
    plan = solve_plan([TP1, TP2, SLOW], cfg)
    assert plan.feasible and plan.objective == pytest.approx(0.8)
    assert (plan.prefill, plan.decode, plan.gpus) == ({"tp1": 3}, {"tp1": 2}, 5)
    assert plan.goodput == pytest.approx(1.0)
    assert brute_force_plan([TP1, TP2, SLOW], cfg) == plan


def test_max_goodput_hand_solved_with_an_slo_breaking_strategy_excluded():
    """SLO_ITL = 0.035 puts tp1 decode over its SLO (0.04 / 0.035 > 1): decode only on tp2.
    One tp2 decoder (2 GPUs) serves 360/400 = 0.9 sessions/s; two (4 GPUs) leave 2 GPUs of
    prefill (≤ 1000/1500 = 0.67). So T* = 0.9, with 3 GPUs of prefill (≥ 1350 tokens/s): 5 GPUs."""
    cfg = PlanConfig(objective="max_goodput", **{**HAND, "slo_itl_s": 0.035})
    plan = solve_plan([TP1, TP2, SLOW], cfg)
    assert plan.feasible and plan.objective == pytest.approx(0.9) and plan.gpus == 5
    assert plan.decode == {"tp2": 1} and "slow" not in plan.prefill
    assert plan.max_norm_latency <= 1.0
    oracle = brute_force_plan([TP1, TP2, SLOW], cfg)
    assert (oracle.objective, oracle.gpus) == pytest.approx((plan.objective, plan.gpus))


def test_a_budget_that_cannot_meet_demand_is_infeasible():
    cfg = PlanConfig(objective="min_max_latency", **{**HAND, "gpu_budget": 3})
    assert not solve_plan([TP1, TP2], cfg).feasible
    assert not brute_force_plan([TP1, TP2], cfg).feasible


def _random_instance(rng: np.random.Generator, objective: str) -> tuple[list[Strategy], PlanConfig]:
    strategies = [Strategy(name=f"tp{k}", gpus=k,
                           prefill_tokens_per_s=float(rng.uniform(500, 2000) * k ** 0.8),
                           prefill_latency_s=float(rng.uniform(0.1, 1.0) / k ** 0.7),
                           decode_tokens_per_s=float(rng.uniform(100, 600) * k ** 0.8),
                           itl_s=float(rng.uniform(0.01, 0.08) / k ** 0.6)) for k in (1, 2, 4)]
    cfg = PlanConfig(gpu_budget=int(rng.integers(3, 7)), objective=objective,
                     session_rate=float(rng.uniform(0.2, 2.0)),
                     prefill_tokens_per_session=float(rng.uniform(1000, 4000)),
                     decode_tokens_per_session=float(rng.uniform(200, 1200)),
                     slo_ttft_s=float(rng.uniform(0.5, 3.0)), slo_itl_s=float(rng.uniform(0.02, 0.06)),
                     max_utilisation=float(rng.uniform(0.5, 0.9)),
                     decode_headroom=float(rng.uniform(0.0, 0.3)))
    return strategies, cfg


@pytest.mark.parametrize("objective", ["min_max_latency", "max_goodput"])
def test_ilp_optimum_equals_brute_force_on_random_small_instances(objective):
    rng = np.random.default_rng(7 if objective == "min_max_latency" else 8)
    nontrivial = 0
    for _ in range(12):
        strategies, cfg = _random_instance(rng, objective)
        ilp, oracle = solve_plan(strategies, cfg), brute_force_plan(strategies, cfg)
        assert ilp.feasible == oracle.feasible, (cfg, ilp, oracle)
        if not ilp.feasible:
            continue
        assert ilp.objective == pytest.approx(oracle.objective, rel=1e-6, abs=1e-9), (cfg, ilp, oracle)
        assert ilp.gpus == oracle.gpus, (cfg, ilp, oracle)
        assert ilp.gpus <= cfg.gpu_budget
        # the ILP's plan really has the objective it reports
        x, y = ilp.counts(strategies)
        assert evaluate_plan(strategies, x, y, cfg).objective == pytest.approx(ilp.objective)
        nontrivial += ilp.objective > 0
    assert nontrivial >= 4   # the instances exercise real trade-offs, not only empty plans


def test_bad_plan_settings_are_rejected_before_solving():
    with pytest.raises(ValidationError, match="max_utilisation"):
        PlanConfig(**{**HAND, "max_utilisation": 1.0})
    with pytest.raises(ValidationError, match="objective"):
        PlanConfig(**HAND, objective="min_cost")
    with pytest.raises(ValueError, match="repeat"):
        solve_plan([TP1, TP1], PlanConfig(**HAND))
    with pytest.raises(ValidationError, match="gpus"):
        Strategy(name="tp0", gpus=0, prefill_tokens_per_s=1, prefill_latency_s=1,
                 decode_tokens_per_s=1, itl_s=1)


def test_tp_strategies_from_latency_constants():
    """prefill(L) = 0.01 + 1e-4 L; decode(B, C) = 0.008 + 1e-4 B + 1e-6 C (one GPU).
    TP1, L = 1000: prefill 0.11 s. Decode, mean context 1000: step(B) = 0.008 + 1.1e-3 B ≤ 0.8 ·
    0.05 = 0.04 -> B = 29 (0.0399 s); KV 29 000 tokens fit in 100 000. TP2 (efficiency 0.85):
    terms / 1.7 -> prefill 0.01 + 0.1/1.7."""
    tp1, tp2 = tp_strategies(prefill_s0=0.01, prefill_s_per_token=1e-4, decode_s0=0.008,
                             decode_s_per_seq=1e-4, decode_s_per_ctx_token=1e-6,
                             mean_prompt_tokens=1000, mean_context_tokens=1000,
                             kv_tokens_per_gpu=100_000, slo_itl_s=0.05, tp_degrees=(1, 2))
    assert tp1.prefill_latency_s == pytest.approx(0.11)
    assert tp1.prefill_tokens_per_s == pytest.approx(1000 / 0.11)
    assert tp1.itl_s == pytest.approx(0.008 + 29 * 1.1e-3)
    assert tp1.decode_tokens_per_s == pytest.approx(29 / tp1.itl_s)
    assert tp2.gpus == 2 and tp2.prefill_latency_s == pytest.approx(0.01 + 0.1 / 1.7)
    assert tp2.itl_s <= 0.04 and tp2.decode_tokens_per_s > tp1.decode_tokens_per_s
