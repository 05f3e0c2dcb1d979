"""The shared GRPO trainer on a tiny model: verifier rewards, the policy-loss plug-in, replay."""

from __future__ import annotations

import json
import random

import pytest
import torch

from stages.models import base
from stages.models.tokenizer import build_tokenizer
from stages.tasks import arith
from stages.train import grpo
from stages.train.grpo import GRPOParams, concat_rollouts, train_grpo, verifier_reward


def _rows(n: int, seed: int) -> list[dict]:
    cfg = arith.Config(min_operands=2, max_operands=2, max_value=9)
    return arith.generate(cfg, n, seed)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny Llama SFT'd briefly on 1-digit additions: right sometimes, wrong sometimes."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA "))
    cfg = base.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_positions=64, steps=80, batch_size=16, lr=5e-3, warmup=0.0,
                      log_every=40, group_by_length=False)
    model = base.build_model(cfg, tokenizer)
    rows = _rows(80, 1)
    enc = base.encode_sft_rows(tokenizer, [r["prompt"] for r in rows],
                               [r["target"] for r in rows], max_len=64)
    base.train(cfg, model, tokenizer, enc, seed=0)
    folder = tmp_path_factory.mktemp("policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_verifier_reward_uses_the_exact_verifier():
    reward = verifier_reward("arith")
    assert reward(prompts=["a", "b", "c"], completions=[" 1+2=3 #### 3", " #### 4", "3"],
                  answer=[3, 3, 3]) == [1.0, 0.0, 0.0]


def test_params_refuse_uneven_minibatches_and_replay_without_behaviour_logps():
    with pytest.raises(ValueError, match="minibatches"):
        GRPOParams(prompts_per_round=3, num_generations=3, minibatches=2)
    with pytest.raises(ValueError, match="replay"):
        GRPOParams(replay_batches=1, num_iterations=1, minibatches=1)


def test_concat_rollouts_pads_prompts_left_and_tokens_right():
    a = {"prompt_ids": torch.tensor([[5, 6]]), "prompt_mask": torch.tensor([[1, 1]]),
         "completion_ids": torch.tensor([[7]]), "completion_mask": torch.tensor([[1]]),
         "old_per_token_logps": torch.tensor([[-0.5]]), "advantages": torch.tensor([1.0]),
         "num_items_in_batch": torch.tensor(1)}
    b = {"prompt_ids": torch.tensor([[4, 5, 6]]), "prompt_mask": torch.tensor([[1, 1, 1]]),
         "completion_ids": torch.tensor([[8, 9]]), "completion_mask": torch.tensor([[1, 1]]),
         "old_per_token_logps": torch.tensor([[-1.0, -2.0]]), "advantages": torch.tensor([-1.0]),
         "num_items_in_batch": torch.tensor(2)}
    out = concat_rollouts([a, b])
    assert out["prompt_ids"].tolist() == [[0, 5, 6], [4, 5, 6]]
    assert out["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert out["completion_ids"].tolist() == [[7, 0], [8, 9]]
    assert out["completion_mask"].tolist() == [[1, 0], [1, 1]]
    assert out["old_per_token_logps"].tolist() == [[-0.5, 0.0], [-1.0, -2.0]]
    assert out["advantages"].tolist() == [1.0, -1.0]
    assert int(out["num_items_in_batch"]) == 3


def _trainer(policy, params: GRPOParams):
    from datasets import Dataset
    from trl import GRPOConfig

    from stages.models.generate import load_model

    model, tokenizer = load_model(policy)
    model.train()
    rows = _rows(8, 2)
    args = GRPOConfig(output_dir="/tmp/paperline-grpo-test", max_steps=1,
                      per_device_train_batch_size=4, num_generations=4, num_iterations=2,
                      max_completion_length=16, learning_rate=1e-4, loss_type="bnpo",
                      epsilon=params.clip_epsilon, report_to="none", use_cpu=True, bf16=False,
                      gradient_checkpointing=False, save_strategy="no", disable_tqdm=True)
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    trainer = grpo._trainer_class()(model=model, processing_class=tokenizer,
                                    reward_funcs=[verifier_reward("arith")], args=args,
                                    train_dataset=ds, params=params)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop otherwise
    return trainer


def _inputs(trainer, shift: float):
    """A hand-made batch: old log-probs = current ones + a small shift (ratios exp(-shift))."""
    tok = trainer.processing_class
    prompt = tok(["Q: 1+2=? A:", "Q: 3+4=? A:"])["input_ids"]
    comp = tok([" 1+2=3 #### 3", " 3+4=8 #### 8"], add_special_tokens=False)["input_ids"]
    prompt_ids = torch.tensor(prompt)
    completion_ids = torch.tensor(comp)
    mask = torch.ones_like(completion_ids)
    mask[1, -2:] = 0
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.ones(2, prompt_ids.shape[1] + completion_ids.shape[1], dtype=torch.long),
            completion_ids.shape[1])
    g = torch.Generator().manual_seed(0)
    old = logps + shift * (torch.rand(logps.shape, generator=g) - 0.5)
    return {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
            "completion_ids": completion_ids, "completion_mask": mask,
            "advantages": torch.tensor([1.0, -1.0]), "old_per_token_logps": old,
            "num_items_in_batch": mask.sum()}


def test_r2vpo_with_zero_multiplier_and_ratios_inside_the_clip_equals_trl_grpo_loss(policy):
    """With lambda = 0 and every ratio inside [1-eps, 1+eps] the clip never binds, so R²VPO's
    loss and gradient are TRL's (bnpo) GRPO surrogate exactly."""
    clip = _trainer(policy, GRPOParams(policy_loss="clip", clip_epsilon=0.2))
    r2 = _trainer(policy, GRPOParams(policy_loss="r2vpo", clip_epsilon=0.2,
                                     r2vpo={"lambda_init": 0.0, "dual_rule": "fixed"}))
    inputs = _inputs(clip, shift=0.1)  # |log r| <= 0.05: r in [0.95, 1.05]
    losses, grads = [], []
    for t in (clip, r2):
        t.model.zero_grad()
        loss = t._compute_loss(t.model, inputs)
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
    params = GRPOParams(policy_loss="r2vpo", r2vpo={"lambda_init": 0.5, "lambda_lr": 1.0,
                                                    "v_ema": 0.0, "epsilon": 0.01})
    t = _trainer(policy, params)
    inputs = _inputs(t, shift=2.0)
    loss = t._compute_loss(t.model, inputs).item()
    v = t._metrics["train"]["r2vpo/v_hat"][-1]
    assert v > 0.01
    assert t.dual.lam == pytest.approx(0.5 + 1.0 * (v - 0.01))  # additive dual ascent
    free = _trainer(policy, GRPOParams(policy_loss="r2vpo", r2vpo={"lambda_init": 0.0,
                                                                     "dual_rule": "fixed"}))
    loss0 = free._compute_loss(free.model, inputs).item()
    assert loss == pytest.approx(loss0 + 0.5 * (v - 0.01), rel=1e-4)


@pytest.mark.parametrize("policy_loss, replay", [("clip", 0), ("r2vpo", 1)])
def test_train_grpo_changes_the_policy_and_counts_rollouts(policy, tmp_path, policy_loss, replay):
    params = GRPOParams(policy_loss=policy_loss, replay_batches=replay, rounds=3,
                        prompts_per_round=2, num_generations=4, minibatches=1, num_iterations=2,
                        max_completion_length=16, lr=1e-3, eval_every=2, eval_rows=8,
                        num_threads=1)
    logged: list[dict] = []
    out = tmp_path / "policy"
    result = train_grpo(params, policy, "arith", _rows(32, 3), _rows(8, 4), seed=0,
                        out_dir=out, log=lambda m, step: logged.append(m))
    before, after = _weights(policy), _weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved
    assert result["metrics"]["rollouts"] == 3 * 2 * 4 == result["curve"][-1]["rollouts"]
    assert [p["round"] for p in result["curve"]] == [0.0, 2.0, 3.0]
    assert result["metrics"]["steps"] == 3 * 1 * 2
    state = json.loads((out / "policy_state.json").read_text())
    assert state["policy_loss"] == policy_loss
    keys = set().union(*logged)
    assert {"train/reward", "train/ratio/var", "train/ratio/clip_fraction",
            "train/rollouts", "train/tokens_generated", "eval_acc"} <= keys
    if policy_loss == "r2vpo":
        assert state["dual"]["lam"] != 0.1  # the multiplier moved
        assert "train/r2vpo/lambda" in keys and "train/replay_rows" in keys


def test_seeds_in_worker_processes_give_the_same_arm(policy, tmp_path):
    """`workers` changes wall time only: each seed's curve and policy equal the sequential run."""
    import polars as pl

    from stages.core.context import Context

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    pl.DataFrame(_rows(32, 3)).write_parquet(prompts / "train.parquet")
    test_rows = arith.generate(arith.Config(min_operands=2, max_operands=2, max_value=9), 8, 4,
                               split="test")
    pl.DataFrame(test_rows).write_parquet(prompts / "test.parquet")
    curves = {}
    for workers in (1, 2):
        root = tmp_path / f"w{workers}"
        ctx = Context(root=root, pipeline="r2vpo", stage="arm", pipeline_dir=root,
                      profile="smoke", seed=0, tracker=None,
                      paths={"metrics": root / "metrics", "rl_prompts": prompts,
                             "base_model": policy, "runs": root / "runs"})
        cfg = grpo.Config(rounds=2, prompts_per_round=2, num_generations=4, minibatches=1,
                          num_iterations=1, max_completion_length=16, lr=1e-3, eval_every=1,
                          eval_rows=8, num_threads=1, seeds=[0, 1], workers=workers)
        metrics = grpo.run(cfg, ctx)
        curves[workers] = pl.read_parquet(root / "runs/arm/curve.parquet").sort(["seed", "step"])
        assert metrics["seeds"] == 2.0
    assert curves[1].drop("seconds", strict=False).equals(curves[2].drop("seconds", strict=False))
    for seed in (0, 1):
        a = _weights(tmp_path / "w1/runs/arm" / f"seed{seed}")
        b = _weights(tmp_path / "w2/runs/arm" / f"seed{seed}")
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_length_bonus_by_hand():
    """-w * z_G(length) on correct responses only; wrong ones get no bonus."""
    bonus = grpo.bonus_reward("length", 0.2, 2, "arith", model=None, tokenizer=None)
    out = bonus(prompts=["p"] * 4, completions=[" #### 3", " 1+2=3 #### 3", " #### 3", " #### 4"],
                answer=[3, 3, 3, 3])
    assert out == pytest.approx([0.2, -0.2, 0.0, 0.0])  # group 2: one correct -> z over both


def test_indiv_bonus_runs_on_the_policy(policy):
    from stages.models.generate import load_model

    model, tokenizer = load_model(policy)
    bonus = grpo.bonus_reward("indiv", 0.2, 2, "arith", model, tokenizer)
    comps = [" 1+2=3 #### 3", " 1+2=3; check 1+2=3; check 1+2=3 #### 3"]
    out = bonus(prompts=["Q: 1+2=? A:"] * 2, completions=comps, answer=[3, 3])
    assert len(out) == 2 and out[0] == pytest.approx(-out[1]) and abs(out[0]) == pytest.approx(0.2)
