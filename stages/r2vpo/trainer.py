"""`R2VPOTrainer`: the engine's GRPO trainer with the clip replaced by R²VPO's ratio-variance
Lagrangian (Luo et al., ICML 2026, arXiv 2605.26784; the math: `stages.r2vpo.r2vpo`).

Per micro-batch, with token ratios r = pi_theta / mu against the behaviour log-probs TRL keeps
(or the replayed round's own), sequence advantages A and the valid-token mask:

    loss = -[mean(r A) - lambda (V_hat - eps)]  (+ beta KL to the reference when beta > 0)
    lambda <- dual step on the detached V_hat, once per training micro-batch

lambda enters the loss as a plain float, so the primal step never moves it. Only `policy_loss` is
overridden: generation, advantages, replay, the optimizer and the ratio diagnostics are the
engine's (`stages.train.grpo_trainer.GRPOTrainer`), exactly as the clipped baseline's.

Imported only when training starts (it imports TRL).
"""

from __future__ import annotations

from typing import Any

import torch

from stages.r2vpo.r2vpo import DualState, r2vpo_loss
from stages.train.grpo_trainer import GRPOTrainer
from stages.train.ratio import masked_mean, policy_ratio


class R2VPOTrainer(GRPOTrainer):
    """`params` must carry `r2vpo: R2VPOParams` (e.g. the `stages.r2vpo.rl` Config)."""

    def __init__(self, *args: Any, params: Any, **kwargs: Any):
        super().__init__(*args, params=params, **kwargs)
        self.dual = DualState.from_params(params.r2vpo)

    def policy_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        p = self.params.r2vpo
        mask = inputs["completion_mask"]
        logps, entropies = self.completion_logps(model, inputs)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        ratio, _ = policy_ratio(logps, old)
        # Lagrangian with lambda detached (a plain float): the primal step never moves it.
        loss, variance = r2vpo_loss(ratio, adv, lam=self.dual.lam, epsilon=p.epsilon,
                                    mask=mask, center=p.center)
        mode = self.mode
        m = self._metrics[mode]
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            loss = loss + self.beta * masked_mean(kl, mask)
            m["kl"].append(masked_mean(kl.detach(), mask).item())
        m["entropy"].append(masked_mean(entropies.detach(), mask).item())
        m["policy_loss"].append(loss.detach().item())
        self.log_ratio_stats(logps.detach(), old, inputs)
        if mode == "train":
            # Dual ascent on the detached V_hat, once per micro-batch (the paper's alternating
            # primal-dual scheme [reconstructed]).
            m["r2vpo/v_hat"].append(variance.detach().item())
            self.dual.update(variance.detach().item())
            m["r2vpo/lambda"].append(self.dual.lam)
            return loss / self.current_gradient_accumulation_steps
        return loss

    def policy_state(self) -> dict[str, Any]:
        return {"dual": self.dual.to_dict()}

    def policy_metrics(self) -> dict[str, float]:
        return {"lambda_final": self.dual.lam}
