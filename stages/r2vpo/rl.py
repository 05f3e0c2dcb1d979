"""The LLM arms of the R²VPO pipeline (Luo et al., ICML 2026, arXiv 2605.26784; spec Task A):
clipped GRPO with and without stale replay against R²VPO and its ablations, all on the engine's
GRPO trainer (`stages.train.grpo`) with the exact verifier reward and one shared budget.

    grpo                 policy_loss: clip,  replay_batches: 0     TRL's clipped GRPO loss
    grpo_replay          policy_loss: clip,  replay_batches: K     clipping discards stale data
    r2vpo                policy_loss: r2vpo, replay_batches: K     variance constraint + dual
    r2vpo_fixed_lambda   policy_loss: r2vpo, lambda fixed          ablation: no dual ascent
    r2vpo_no_replay      policy_loss: r2vpo, replay_batches: 0     ablation: fresh data only

`policy_loss` picks the trainer class: `clip` the engine's `GRPOTrainer`, `r2vpo`
`stages.r2vpo.trainer.R2VPOTrainer`, whose only change is the loss. Outputs (`<out>/<stage>/`):
the policy of every seed, `curve.parquet` (held-out greedy accuracy against rollouts consumed)
and `budget.json`, read by `stages.r2vpo.compare`.

    python -m stages r2vpo r2vpo          # one arm; sizes from the active profile
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from stages.r2vpo.r2vpo import R2VPOParams
from stages.train import grpo


class Config(grpo.GRPOArm):
    """An LLM arm: the engine's GRPO arm settings + the loss and R²VPO's constraint."""

    policy_loss: Literal["clip", "r2vpo"] = Field(
        "clip", description="clip: TRL's GRPO loss; r2vpo: ratio-variance Lagrangian")
    r2vpo: R2VPOParams = Field(default_factory=R2VPOParams,
                               description="constraint and multiplier (policy_loss: r2vpo)")


def trainer_class(policy_loss: str) -> type:
    """The trainer of a `policy_loss` (imports TRL)."""
    if policy_loss == "r2vpo":
        from stages.r2vpo.trainer import R2VPOTrainer

        return R2VPOTrainer
    from stages.train.grpo_trainer import GRPOTrainer

    return GRPOTrainer


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    per_seed = grpo.train_arm(cfg, ctx, trainer_cls=trainer_class(cfg.policy_loss))
    # A clip arm has no multiplier: it reports lambda_0 of its (unused) r2vpo section, so every
    # arm has the same metric keys.
    for m in per_seed:
        m.setdefault("lambda_final", cfg.r2vpo.lambda_init)
    return grpo.arm_metrics(per_seed, ("final_acc", "initial_acc", "final_len",
                                       "seconds_per_step", "lambda_final"))


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the arm's final held-out accuracy (`acc_mean`, `acc_std` over seeds:
    `final_acc_*` in details/<arm>.json, with the start, length, lambda and rollouts)."""
    return {new: metrics[old] for new, old in (("acc_mean", "final_acc_mean"),
                                               ("acc_std", "final_acc_std")) if old in metrics}
