"""R²VPO: Ratio-Variance regularized Policy Optimization (Luo et al., ICML 2026, arXiv 2605.26784).

PPO/GRPO clip the policy ratio r = pi_theta(a|s) / mu(a|s); the clip zeroes the gradient of a
high-advantage action as soon as its ratio leaves [1-eps, 1+eps] and makes stale data useless.
R²VPO instead constrains the *variance* of the ratio, a smooth local trust region:

    E_mu[r] = 1  =>  Var_mu(r) = E_mu[(r-1)^2] = chi^2(pi || mu),   KL ~ chi^2 / 2

    max_theta  E_mu[r A]   s.t.  V(theta) = Var_mu(r) <= eps                           (constraint)
    L(theta, lambda) = mean_i(r_i A_i) - lambda (V_hat - eps)                          (Lagrangian)
    grad L = mean_i r_i grad log pi(a_i|s_i) [A_i - 2 lambda (r_i - r_bar)]            (no clip)
    lambda <- max(0, lambda + eta_lambda (V_hat - eps))                                (dual ascent)

A sample whose ratio ran ahead (r_i > r_bar, A_i > 0) gets a smoothly shrinking push, never a hard
zero; stale replayed samples have ratios far from 1, inflate V_hat, raise lambda and are thereby
down-weighted instead of discarded.

The paper's equations were not public when this was written: the loss, the dual update and all
defaults are a reconstruction from its abstract ([reconstructed]); each choice is a parameter of
`R2VPOParams` (centring on r_bar or on 1, additive or multiplicative dual step, EMA of V_hat,
fixed lambda) so it can be ablated. The settings, the multiplier and these pure tensor functions
are shared by the LLM trainer (`stages.r2vpo.trainer`, a TRL GRPO subclass) and the
continuous-control PPO subclass (`stages.r2vpo.ppo`). The ratio itself and the clip diagnostic are
the engine's (`stages.train.ratio`): every trainer logs them.

Tensor methods only (no `import torch` here), so a stage Config holding `R2VPOParams` validates
without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.train.ratio import masked_mean

if TYPE_CHECKING:
    import torch


class R2VPOParams(BaseModel):
    """The ratio-variance constraint and its multiplier (all defaults [reconstructed]: the
    paper's "suggested defaults" are not public; PPO's clip 0.2 keeps Var(r) ~ 0.005-0.02)."""

    model_config = ConfigDict(extra="forbid")

    epsilon: float = Field(0.01, gt=0, le=10, description="target Var(r): PPO clip 0.2 keeps "
                                                           "Var(r) ~ 0.005-0.02")
    lambda_init: float = Field(0.1, ge=0, le=1e4, description="lambda_0")
    lambda_lr: float = Field(0.1, ge=0, le=100, description="eta_lambda, dual step size")
    dual_rule: Literal["additive", "multiplicative", "fixed"] = Field(
        "additive", description="lambda update; 'fixed' keeps lambda_init (ablation)")
    center: Literal["mean", "one"] = Field("mean", description="Var around r_bar or around 1")
    v_ema: float = Field(0.9, ge=0, lt=1, description="EMA of V_hat before the dual step")


def ratio_variance(ratio: torch.Tensor, mask: torch.Tensor | None = None,
                   center: Literal["mean", "one"] = "mean") -> torch.Tensor:
    """V_hat over the valid entries: mean (r - r_bar)^2 (center="mean") or mean (r - 1)^2 ("one").

    Differentiable in `ratio`. Token-level for LLMs: every valid completion token is one entry,
    so long responses weigh more (kept fixed across arms; see the spec's pitfalls).
    """
    if center == "mean":
        centre = masked_mean(ratio, mask)
    elif center == "one":
        centre = ratio.new_ones(())
    else:
        raise ValueError(f"center = {center!r}: expected 'mean' or 'one'")
    return masked_mean((ratio - centre) ** 2, mask)


def r2vpo_loss(ratio: torch.Tensor, advantages: torch.Tensor, lam: float,
               epsilon: float, mask: torch.Tensor | None = None,
               center: Literal["mean", "one"] = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, V_hat): the negated Lagrangian -[mean(r A) - lambda (V_hat - eps)], to minimise.

    `lam` is a plain float (detached): the primal step never moves the multiplier. `advantages`
    broadcasts against `ratio` ((B, 1) sequence advantages against (B, T) token ratios).
    With lam = 0 this is the unclipped importance-weighted policy-gradient surrogate, whose value
    and gradient equal the clipped PPO/GRPO surrogate whenever every ratio is inside the clip range.
    """
    variance = ratio_variance(ratio, mask, center)
    surrogate = masked_mean(ratio * advantages, mask)
    return -(surrogate - lam * (variance - epsilon)), variance


def clipped_surrogate_loss(ratio: torch.Tensor, advantages: torch.Tensor, clip: float,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """The PPO/GRPO baseline: -mean(min(r A, clip(r, 1-c, 1+c) A)), for tests and control."""
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip)
    return -masked_mean((ratio * advantages).minimum(clipped * advantages), mask)


@dataclass
class DualState:
    """The multiplier lambda and its update rule; checkpointed with the model (`to_dict`)."""

    lam: float = 0.1                 # lambda_0
    lr: float = 0.1                  # eta_lambda
    epsilon: float = 0.01            # target Var(r)
    rule: Literal["additive", "multiplicative", "fixed"] = "additive"
    ema: float = 0.9                 # EMA of V_hat before the dual step (0 = raw V_hat)
    v_ema: float | None = None       # smoothed V_hat; None before the first update
    lam_max: float = 1e4             # guard against a runaway multiplicative step

    @classmethod
    def from_params(cls, p: R2VPOParams) -> "DualState":
        """lambda = lambda_0, before any update, with the rule and step size of `p`."""
        return cls(lam=p.lambda_init, lr=p.lambda_lr, epsilon=p.epsilon, rule=p.dual_rule,
                   ema=p.v_ema)

    def update(self, variance: float) -> float:
        """One dual step from a measured (detached) V_hat; returns the new lambda.

        additive:        lambda <- max(0, lambda + eta (V - eps))
        multiplicative:  lambda <- lambda * exp(eta (V - eps))
        fixed:           lambda unchanged (the "fixed lambda" ablation; V is still smoothed)
        """
        if not math.isfinite(variance):
            raise ValueError(f"ratio variance {variance!r} is not finite: the policy diverged")
        self.v_ema = variance if self.v_ema is None else self.ema * self.v_ema + (1 - self.ema) * variance
        gap = self.v_ema - self.epsilon
        if self.rule == "additive":
            self.lam = max(0.0, self.lam + self.lr * gap)
        elif self.rule == "multiplicative":
            self.lam = self.lam * math.exp(self.lr * gap)
        elif self.rule != "fixed":
            raise ValueError(f"dual rule {self.rule!r}: expected additive, multiplicative or fixed")
        self.lam = min(self.lam, self.lam_max)
        return self.lam

    def to_dict(self) -> dict[str, float | str | None]:
        return {"lam": self.lam, "lr": self.lr, "epsilon": self.epsilon, "rule": self.rule,
                "ema": self.ema, "v_ema": self.v_ema}
