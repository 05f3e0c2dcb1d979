"""The RL arms built on the GRPO engine, on its tiny test policy: R²VPO's trainer subclass
(stages/r2vpo/trainer.py) and stage (stages/r2vpo/rl.py), and HSIR's RL stage with its reward
bonus (stages/hsir/rl.py)."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch

from stages.core.context import Context
from stages.hsir import rl as hsir_rl
from stages.r2vpo import rl as r2vpo_rl
from stages.r2vpo.trainer import R2VPOTrainer
from stages.tasks import arith
from stages.train.grpo import train_grpo
from stages.train.grpo_trainer import GRPOTrainer
from tests.unit.test_grpo import _inputs, _rows, _trainer, _weights, policy  # noqa: F401

TINY = dict(rounds=2, prompts_per_round=2, num_generations=4, minibatches=1, num_iterations=2,
            max_completion_length=16, lr=1e-3, eval_every=1, eval_rows=8, num_threads=1,
            seeds=[0])


def test_r2vpo_with_zero_multiplier_and_ratios_inside_the_clip_equals_trl_grpo_loss(policy):
    """With lambda = 0 and every ratio inside [1-eps, 1+eps] the clip never binds, so R²VPO's
    loss and gradient are TRL's (bnpo) GRPO surrogate exactly."""
    clip = _trainer(policy, r2vpo_rl.Config(policy_loss="clip", clip_epsilon=0.2))
    r2 = _trainer(policy, r2vpo_rl.Config(policy_loss="r2vpo", clip_epsilon=0.2,
                                          r2vpo={"lambda_init": 0.0, "dual_rule": "fixed"}),
                  R2VPOTrainer)
    inputs = _inputs(clip, shift=0.1)  # |log r| <= 0.05: r in [0.95, 1.05]
    losses, grads = [], []
    for t in (clip, r2):
        t.model.zero_grad()
        loss = t._compute_loss(t.model, inputs)   # what TRL's training step calls
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in t.model.parameters()
                                if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-7)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    # ... and the clip diagnostics were logged for both, with nothing clipped.
    assert clip._metrics["train"]["ratio/clip_fraction"][-1] == 0.0
    assert r2._metrics["train"]["ratio/clip_fraction"][-1] == 0.0


def test_r2vpo_penalty_and_dual_step_on_stale_ratios(policy):
    """Far-from-1 ratios: the variance term adds lambda * (V - eps) and lambda rises."""
    params = r2vpo_rl.Config(policy_loss="r2vpo", r2vpo={"lambda_init": 0.5, "lambda_lr": 1.0,
                                                         "v_ema": 0.0, "epsilon": 0.01})
    t = _trainer(policy, params, R2VPOTrainer)
    inputs = _inputs(t, shift=2.0)
    loss = t.policy_loss(t.model, inputs).item()
    v = t._metrics["train"]["r2vpo/v_hat"][-1]
    assert v > 0.01
    assert t.dual.lam == pytest.approx(0.5 + 1.0 * (v - 0.01))  # additive dual ascent
    assert t.policy_metrics() == {"lambda_final": t.dual.lam}
    free = _trainer(policy, r2vpo_rl.Config(policy_loss="r2vpo",
                                            r2vpo={"lambda_init": 0.0, "dual_rule": "fixed"}),
                    R2VPOTrainer)
    loss0 = free.policy_loss(free.model, inputs).item()
    assert loss == pytest.approx(loss0 + 0.5 * (v - 0.01), rel=1e-4)


def test_r2vpo_trainer_with_replay_moves_the_policy_and_lambda(policy, tmp_path):
    params = r2vpo_rl.Config(policy_loss="r2vpo", replay_batches=1,
                             **{**TINY, "rounds": 3, "eval_every": 2})
    logged: list[dict] = []
    out = tmp_path / "policy"
    result = train_grpo(params, policy, "arith", _rows(32, 3), _rows(8, 4), seed=0,
                        out_dir=out, log=lambda m, step: logged.append(m),
                        trainer_cls=r2vpo_rl.trainer_class("r2vpo"))
    before, after = _weights(policy), _weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert result["metrics"]["rollouts"] == 3 * 2 * 4     # replayed rows are not new rollouts
    state = json.loads((out / "policy_state.json").read_text())
    assert list(state) == ["policy_loss", "dual", "rollouts", "tokens_generated", "steps"]
    assert state["policy_loss"] == "r2vpo" and state["dual"]["lam"] != 0.1  # lambda moved
    assert result["metrics"]["lambda_final"] == state["dual"]["lam"]
    keys = set().union(*logged)
    assert {"train/r2vpo/lambda", "train/replay_rows", "train/ratio/var"} <= keys


def test_policy_loss_picks_the_trainer_class():
    assert r2vpo_rl.trainer_class("r2vpo") is R2VPOTrainer
    assert r2vpo_rl.trainer_class("clip") is GRPOTrainer
    with pytest.raises(ValueError, match="policy_loss"):
        r2vpo_rl.Config(policy_loss="ppo")


def _ctx(root, policy):
    prompts = root / "prompts"
    prompts.mkdir(parents=True)
    pl.DataFrame(_rows(32, 3)).write_parquet(prompts / "train.parquet")
    test_rows = arith.generate(arith.Config(min_operands=2, max_operands=2, max_value=9), 8, 4,
                               split="test")
    pl.DataFrame(test_rows).write_parquet(prompts / "test.parquet")
    return Context(root=root, pipeline="x", stage="arm", pipeline_dir=root, profile="smoke",
                   seed=0, tracker=None,
                   paths={"metrics": root / "metrics", "rl_prompts": prompts,
                          "hsir_prompts": prompts, "base_model": policy, "seed_model": policy,
                          "runs": root / "runs"})


def test_r2vpo_clip_arm_stage_reports_its_unused_lambda_0(policy, tmp_path):
    cfg = r2vpo_rl.Config(policy_loss="clip", r2vpo={"lambda_init": 0.3}, **TINY)
    metrics = r2vpo_rl.run(cfg, _ctx(tmp_path, policy))
    assert (metrics["lambda_final_mean"], metrics["lambda_final_std"]) == (0.3, 0.0)
    assert metrics["seeds"] == 1.0 and metrics["rollouts"] == 2 * 2 * 4
    curve = pl.read_parquet(tmp_path / "runs/arm/curve.parquet")
    assert curve.columns == ["method", "seed", "round", "step", "rollouts", "eval_acc", "eval_len"]


def test_hsir_rl_stage_with_the_length_bonus(policy, tmp_path):
    cfg = hsir_rl.Config(bonus="length", **TINY)
    metrics = hsir_rl.run(cfg, _ctx(tmp_path, policy))
    assert {"final_acc_mean", "initial_acc_mean", "final_len_mean", "seconds_per_step_mean",
            "rollouts", "seeds"} <= set(metrics)
    assert "lambda_final_mean" not in metrics   # no multiplier in HSIR's arms
    budget = json.loads((tmp_path / "runs/arm/budget.json").read_text())
    assert budget["policy_loss"] == "clip" and budget["num_generations"] == 4
