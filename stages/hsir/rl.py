"""The RL arms of HSIR (Zhong et al., ICML 2026, arXiv 2605.24998): H-GRPO against GRPO and GRPO
with a length penalty, all on the engine's GRPO trainer (`stages.train.grpo`, TRL's clipped loss)
with one shared budget; they differ only in a reward term added to the verifier's 0/1:

    grpo          bonus: none     R_i = 1[correct_i]
    h_grpo        bonus: indiv    R_i = 1[correct_i] + w z_G(InDiv_i) 1[correct_i]      (H-GRPO)
    grpo_length   bonus: length   R_i = 1[correct_i] - w z_G(len_i) 1[correct_i]        (baseline)

z_G is the z-score within the G completions of one prompt (`stages.hsir.hsir.hgrpo_rewards`,
[reconstructed form], w = 0.2); InDiv is read from the *current* policy's hidden states and
attention, so the bonus is a `PolicyReward` bound to the policy being trained. Outputs
(`<out>/<stage>/`): the policy of every seed, `curve.parquet` (held-out greedy accuracy against
rollouts) and `budget.json`, read by `stages.hsir.compare`.

    python -m stages hsir h_grpo          # one arm; sizes from the active profile
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from stages.hsir import hsir
from stages.train import grpo


class Config(grpo.GRPOArm):
    """An RL arm: the engine's GRPO arm settings + the reward bonus."""

    model: str = Field("seed_model", description="paths key of the starting policy folder")
    prompts: str = Field("hsir_prompts", description="paths key of the RL prompt folder "
                                                     "(train.parquet, test.parquet)")
    bonus: Literal["none", "indiv", "length"] = Field(
        "none", description="extra reward on correct responses: indiv = H-GRPO's w * z_G(InDiv); "
                            "length = -w * z_G(length), the length-penalty baseline")
    bonus_weight: float = Field(0.2, ge=0, le=10, description="w of the bonus (H-GRPO: 0.2)")
    indiv_method: Literal["eigenscore", "spectral_entropy"] = Field(
        "eigenscore", description="InDiv formula [reconstructed] (bonus: indiv)")
    indiv_layer: int | Literal["middle"] = Field(-1, description="hidden layer InDiv reads")


@dataclass(frozen=True)
class GroupBonus:
    """The bonus part of the reward, added by TRL to the verifier's 0/1 (rewards are summed).

    TRL passes the completions of a generation batch in groups of G consecutive responses to one
    prompt, which is what the within-group z-score needs.
      indiv   H-GRPO: w * z_G(InDiv) on correct responses, InDiv from the policy being trained.
      length  the length-penalty baseline: -w * z_G(completion chars) on correct responses.
    """

    kind: Literal["indiv", "length"]
    weight: float
    group_size: int
    family: str = "arith"
    method: str = "eigenscore"
    layer: int | str = -1

    def bind(self, model: Any, tokenizer: Any) -> grpo.RewardFunc:
        from stages.tasks import get_family

        fam = get_family(self.family)

        def bonus(prompts: list[str], completions: list[str], answer: list[int],
                  **_: Any) -> list[float]:
            correct = [fam.verify_answer({"answer": a}, c) for c, a in zip(completions, answer)]
            if self.kind == "indiv":
                import torch

                was_training = model.training
                model.eval()
                try:
                    with torch.no_grad():
                        score = hsir.indiv_scores(model, tokenizer, prompts, completions,
                                                  layer=self.layer, method=self.method)
                finally:
                    model.train(was_training)
            else:
                score = [-float(len(c)) for c in completions]
            total = hsir.hgrpo_rewards(correct, score, self.group_size, w=self.weight)
            return [t - float(c) for t, c in zip(total, correct)]  # the bonus only

        bonus.__name__ = f"{self.kind}_bonus"
        return bonus


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    rewards = [] if cfg.bonus == "none" else [
        GroupBonus(cfg.bonus, cfg.bonus_weight, cfg.num_generations, cfg.family,
                   cfg.indiv_method, cfg.indiv_layer)]
    per_seed = grpo.train_arm(cfg, ctx, rewards=rewards)
    return grpo.arm_metrics(per_seed, ("final_acc", "initial_acc", "final_len",
                                       "seconds_per_step"))


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the arm's final accuracy (`acc_mean`, `acc_std` over seeds: the names the
    self-training arms use, so `dvc metrics show` puts every arm in the same columns) and
    length; the rest in details/<arm>.json."""
    return {new: metrics[old] for new, old in (("acc_mean", "final_acc_mean"),
                                               ("acc_std", "final_acc_std"),
                                               ("final_len_mean", "final_len_mean"))
            if old in metrics}
