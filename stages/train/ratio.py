"""The importance ratio of policy-gradient training and its diagnostics, for every trainer.

PPO (Schulman et al. 2017, arXiv 1707.06347) and GRPO (Shao et al. 2024, arXiv 2402.03300) weight
each token's (or action's) advantage by the ratio of the policy being trained to the behaviour
policy that sampled it,

    r = pi_theta(a|s) / mu(a|s) = exp(log pi_theta - log mu),

and clip it to [1 - eps, 1 + eps] in the advantage's direction (PPO eq. 7). How far the ratios
drift from 1 (their mean and variance) and how often the clip cuts are what policy-optimisation
papers compare trainers on, so every trainer logs them with these functions.

Plain tensor methods only, so importing this module does not import torch (a stage's Config may
depend on it without slowing down config validation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LOG_RATIO_CLAMP = 20.0  # numerical guard only (exp(20) ~ 5e8); how often it bites is logged


def policy_ratio(logp: torch.Tensor, logp_behaviour: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, clamped) with r = exp(clamp(log pi - log mu, +-20)); `clamped` marks where the guard bit."""
    log_ratio = logp - logp_behaviour
    clamped = log_ratio.abs() > LOG_RATIO_CLAMP
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp(), clamped


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of `x` over the entries where `mask` is 1 (all entries when None); 0 when none is."""
    if mask is None:
        return x.mean()
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def clip_fraction(ratio: torch.Tensor, advantages: torch.Tensor, clip: float,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """Share of entries whose gradient the clip zeroes (or would zero, for an unclipped loss):
    r beyond [1 - clip, 1 + clip] in the advantage's direction (PPO eq. 7's min picks the clipped
    term exactly there)."""
    cut = ((ratio > 1.0 + clip) & (advantages > 0)) | ((ratio < 1.0 - clip) & (advantages < 0))
    return masked_mean(cut.to(ratio.dtype), mask)
