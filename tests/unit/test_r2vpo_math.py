"""The pure R²VPO functions of stages/r2vpo/r2vpo.py (and the engine's ratio helpers of
stages/train/ratio.py) on hand-computed values (spec §2)."""

from __future__ import annotations

import math

import pytest
import torch

from stages.r2vpo.r2vpo import (
    DualState,
    R2VPOParams,
    clipped_surrogate_loss,
    r2vpo_loss,
    ratio_variance,
)
from stages.train.ratio import LOG_RATIO_CLAMP, clip_fraction, policy_ratio

R = [0.9, 1.0, 1.3]
A = [1.0, -1.0, 2.0]


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_ratio_variance_around_the_mean_and_around_one():
    # all three: r_bar = 3.2 / 3; V = mean (r - r_bar)^2
    r_bar = 3.2 / 3
    by_hand = ((0.9 - r_bar) ** 2 + (1.0 - r_bar) ** 2 + (1.3 - r_bar) ** 2) / 3
    assert ratio_variance(t(R), center="mean").item() == pytest.approx(by_hand)
    assert by_hand == pytest.approx(0.0288889, abs=1e-7)
    assert ratio_variance(t(R), center="one").item() == pytest.approx((0.01 + 0.0 + 0.09) / 3)


def test_ratio_variance_ignores_masked_entries():
    mask = torch.tensor([1, 0, 1])
    # valid {0.9, 1.3}: r_bar = 1.1, V = (0.2^2 + 0.2^2) / 2 = 0.04; around 1: (0.01 + 0.09) / 2
    assert ratio_variance(t(R), mask, center="mean").item() == pytest.approx(0.04)
    assert ratio_variance(t(R), mask, center="one").item() == pytest.approx(0.05)
    with pytest.raises(ValueError, match="center"):
        ratio_variance(t(R), center="median")


def test_r2vpo_loss_value_by_hand():
    lam, eps = 0.5, 0.01
    loss, variance = r2vpo_loss(t(R), t(A), lam=lam, epsilon=eps, center="mean")
    surrogate = (0.9 * 1 + 1.0 * -1 + 1.3 * 2) / 3          # 2.5 / 3
    v = 0.0288888889
    assert variance.item() == pytest.approx(v)
    assert loss.item() == pytest.approx(-(surrogate - lam * (v - eps)))
    assert loss.item() == pytest.approx(-0.8238889, abs=1e-7)


def test_r2vpo_loss_with_lambda_zero_is_the_plain_importance_weighted_surrogate():
    loss, _ = r2vpo_loss(t(R), t(A), lam=0.0, epsilon=0.01)
    assert loss.item() == pytest.approx(-2.5 / 3)


def test_r2vpo_loss_broadcasts_sequence_advantages_over_token_ratios_with_a_mask():
    ratio = t([[1.0, 1.2], [0.8, 5.0]])
    adv = t([[1.0], [-1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, variance = r2vpo_loss(ratio, adv, lam=0.0, epsilon=0.01, mask=mask)
    assert loss.item() == pytest.approx(-(1.0 + 1.2 - 0.8) / 3)   # 5.0 is padding
    assert variance.item() == pytest.approx(((1.0 - 1.0) ** 2 + 0.2 ** 2 + 0.2 ** 2) / 3)


@pytest.mark.parametrize("lam", [0.0, 0.5, 3.0])
def test_gradient_wrt_log_probs_is_the_effective_advantage(lam: float):
    # d loss / d logp_i = -(1/N) r_i [A_i - 2 lam (r_i - r_bar)]   (d r / d logp = r; the
    # centring term's own derivative sums to zero)
    logp = torch.log(t(R)).requires_grad_()
    ratio, _ = policy_ratio(logp, torch.zeros(3, dtype=torch.float64))
    loss, _ = r2vpo_loss(ratio, t(A), lam=lam, epsilon=0.01, center="mean")
    loss.backward()
    r_bar = sum(R) / 3
    expected = [-(1 / 3) * r * (a - 2 * lam * (r - r_bar)) for r, a in zip(R, A)]
    assert logp.grad.tolist() == pytest.approx(expected)


def test_gradient_centred_on_one():
    lam = 0.5
    logp = torch.log(t(R)).requires_grad_()
    loss, _ = r2vpo_loss(torch.exp(logp), t(A), lam=lam, epsilon=0.01, center="one")
    loss.backward()
    expected = [-(1 / 3) * r * (a - 2 * lam * (r - 1.0)) for r, a in zip(R, A)]
    assert logp.grad.tolist() == pytest.approx(expected)


def test_dual_additive_with_ema_by_hand():
    d = DualState(lam=0.1, lr=0.1, epsilon=0.01, rule="additive", ema=0.9)
    assert d.update(0.05) == pytest.approx(0.1 + 0.1 * (0.05 - 0.01))    # first: v_ema = V
    assert d.v_ema == pytest.approx(0.05)
    # v_ema = 0.9 * 0.05 + 0.1 * 0.0 = 0.045; lambda = 0.104 + 0.1 * 0.035
    assert d.update(0.0) == pytest.approx(0.104 + 0.0035)
    assert d.v_ema == pytest.approx(0.045)


def test_dual_additive_is_floored_at_zero():
    d = DualState(lam=0.001, lr=1.0, epsilon=0.01, rule="additive", ema=0.0)
    assert d.update(0.0) == 0.0                   # 0.001 - 0.01 < 0 -> 0
    assert d.update(0.0) == 0.0
    assert d.update(0.11) == pytest.approx(0.1)   # ema 0: the raw V_hat


def test_dual_multiplicative_and_fixed_by_hand():
    d = DualState(lam=0.1, lr=0.1, epsilon=0.01, rule="multiplicative", ema=0.9)
    assert d.update(0.05) == pytest.approx(0.1 * math.exp(0.1 * 0.04))
    assert d.update(0.0) == pytest.approx(0.1 * math.exp(0.004) * math.exp(0.1 * 0.035))
    f = DualState(lam=0.04, lr=0.1, epsilon=0.01, rule="fixed", ema=0.9)
    assert f.update(0.5) == 0.04 and f.update(0.0) == 0.04
    assert f.v_ema == pytest.approx(0.45)          # V is still smoothed (and logged)


def test_dual_guards():
    d = DualState(lam=9e3, lr=1.0, epsilon=0.0, rule="multiplicative", ema=0.0, lam_max=1e4)
    assert d.update(10.0) == 1e4                   # capped
    with pytest.raises(ValueError, match="not finite"):
        d.update(float("nan"))
    with pytest.raises(ValueError, match="dual rule"):
        DualState(rule="sgd").update(0.0)  # type: ignore[arg-type]
    assert DualState().to_dict()["rule"] == "additive"


def test_clipped_surrogate_by_hand():
    r = t([0.5, 1.0, 1.5])
    # A = +1: min(r, clip(r)) = [0.5, 1.0, 1.2]
    assert clipped_surrogate_loss(r, t([1.0, 1.0, 1.0]), 0.2).item() == pytest.approx(-2.7 / 3)
    # A = -1: min(-r, -clip(r)) = [-0.8, -1.0, -1.5]
    assert clipped_surrogate_loss(r, t([-1.0, -1.0, -1.0]), 0.2).item() == pytest.approx(3.3 / 3)
    mask = torch.tensor([1, 1, 0])
    assert clipped_surrogate_loss(r, t([1.0, 1.0, 1.0]), 0.2, mask).item() == pytest.approx(-0.75)


def test_clip_fraction_counts_only_the_cut_direction():
    r = t([0.5, 1.0, 1.5, 0.7, 1.3])
    a = t([1.0, 1.0, 1.0, -1.0, -1.0])
    # cut: 1.5 with A > 0 and 0.7 with A < 0; 0.5 (A > 0) and 1.3 (A < 0) keep their gradient
    assert clip_fraction(r, a, 0.2).item() == pytest.approx(2 / 5)
    assert clip_fraction(r, a, 0.2, torch.tensor([0, 1, 1, 0, 1])).item() == pytest.approx(1 / 3)


def test_policy_ratio_clamp_flag():
    logp = t([0.0, 25.0, -30.0, 5.0, 20.0])
    ratio, clamped = policy_ratio(logp, torch.zeros(5, dtype=torch.float64))
    assert clamped.tolist() == [False, True, True, False, False]
    assert ratio.tolist() == pytest.approx([1.0, math.exp(LOG_RATIO_CLAMP),
                                            math.exp(-LOG_RATIO_CLAMP), math.exp(5.0),
                                            math.exp(20.0)])


def test_dual_state_from_params_starts_at_lambda_0_with_their_rule():
    p = R2VPOParams(lambda_init=0.5, lambda_lr=2.0, epsilon=0.02, dual_rule="fixed", v_ema=0.0)
    d = DualState.from_params(p)
    assert (d.lam, d.lr, d.epsilon, d.rule, d.ema, d.v_ema) == (0.5, 2.0, 0.02, "fixed", 0.0, None)
    assert d.update(1.0) == 0.5 and d.v_ema == 1.0   # fixed: lambda stays, V is still smoothed
    with pytest.raises(ValueError, match="dual_rule"):
        R2VPOParams(dual_rule="clip")
