"""The GRPO engine on a tiny model: verifier rewards, the `policy_loss` hook, extra rewards and
evaluations, replay, seeds in worker processes."""

from __future__ import annotations

import json

import pytest
import torch

from stages.models import base
from stages.models.tokenizer import build_tokenizer
from stages.tasks import arith
from stages.train import grpo
from stages.train.grpo import GRPOParams, train_grpo, verifier_reward
from stages.train.grpo_trainer import GRPOTrainer, concat_rollouts


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


def _trainer(policy, params, cls: type = GRPOTrainer):
    """A trainer of class `cls` on the tiny policy, outside `train_grpo` (for one-batch tests)."""
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
    extra = {"params": params} if issubclass(cls, GRPOTrainer) else {}
    trainer = cls(model=model, processing_class=tokenizer,
                  reward_funcs=[verifier_reward("arith")], args=args, train_dataset=ds, **extra)
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


def test_the_baseline_policy_loss_is_trls_own_loss(policy):
    """The engine's `policy_loss` is TRL's clipped GRPO loss, value and gradient, unchanged; the
    clip binds here (ratios up to e^0.5), and the diagnostics see it."""
    import trl

    params = GRPOParams(clip_epsilon=0.2)
    ours, stock = _trainer(policy, params), _trainer(policy, params, trl.GRPOTrainer)
    inputs = _inputs(ours, shift=1.0)
    losses, grads = [], []
    for t, loss_fn in ((ours, ours.policy_loss), (stock, stock._compute_loss)):
        t.model.zero_grad()
        loss = loss_fn(t.model, inputs)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in t.model.parameters()
                                if p.grad is not None]))
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    assert ours._metrics["train"]["ratio/clip_fraction"][-1] > 0.0


def test_train_grpo_changes_the_policy_and_counts_rollouts(policy, tmp_path):
    params = GRPOParams(rounds=3, prompts_per_round=2, num_generations=4, minibatches=1,
                        num_iterations=2, max_completion_length=16, lr=1e-3, eval_every=2,
                        eval_rows=8, num_threads=1)
    logged: list[dict] = []
    out = tmp_path / "policy"
    result = train_grpo(params, policy, "arith", _rows(32, 3), _rows(8, 4), seed=0,
                        out_dir=out, log=lambda m, step: logged.append(m))
    before, after = _weights(policy), _weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved
    assert result["metrics"]["rollouts"] == 3 * 2 * 4 == result["curve"][-1]["rollouts"]
    assert [p["round"] for p in result["curve"]] == [0.0, 2.0, 3.0]
    assert result["metrics"]["steps"] == 3 * 1 * 2
    assert result["metrics"]["final_acc"] == result["curve"][-1]["eval_acc"]
    state = json.loads((out / "policy_state.json").read_text())
    assert state == {"policy_loss": "clip", "rollouts": 24, "tokens_generated":
                     result["metrics"]["tokens_generated"], "steps": 6}
    keys = set().union(*logged)
    assert {"train/reward", "train/ratio/var", "train/ratio/clip_fraction",
            "train/rollouts", "train/tokens_generated", "eval_acc"} <= keys


class ZeroLossTrainer(GRPOTrainer):
    """TRL's clipped loss times 0: no gradient. If the trainer calls this hook for its loss,
    training leaves every weight where it was (Adam moves nothing on zero gradients)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def policy_loss(self, model, inputs):
        self.calls += 1
        return 0.0 * super().policy_loss(model, inputs)

    def policy_state(self):
        return {"calls": self.calls}

    def policy_metrics(self):
        return {"policy_loss_calls": float(self.calls)}


def test_a_subclass_overriding_policy_loss_is_what_the_trainer_calls(policy, tmp_path):
    params = GRPOParams(rounds=2, prompts_per_round=2, num_generations=4, minibatches=1,
                        num_iterations=2, max_completion_length=16, lr=1e-2, eval_every=None,
                        eval_rows=4, num_threads=1)
    out = tmp_path / "policy"
    result = train_grpo(params, policy, "arith", _rows(32, 3), _rows(4, 4), seed=0,
                        out_dir=out, trainer_cls=ZeroLossTrainer)
    before, after = _weights(policy), _weights(out)
    assert all(torch.equal(before[k], after[k]) for k in before)  # its loss, not TRL's, trained
    assert result["metrics"]["policy_loss_calls"] == 2 * 2 == result["metrics"]["steps"]
    assert json.loads((out / "policy_state.json").read_text())["calls"] == 4
    assert [p["round"] for p in result["curve"]] == [0.0, 2.0]   # eval_every None: ends only


class ShortReward:
    """A `PolicyReward`: bound to the run's policy once it is loaded; rewards short answers."""

    def __init__(self):
        self.bound = []

    def bind(self, model, tokenizer):
        self.bound.append(model)

        def short(prompts, completions, **_):
            return [-len(c) / 100 for c in completions]

        return short


def test_extra_rewards_and_the_evaluation_hook(policy, tmp_path):
    params = GRPOParams(rounds=1, prompts_per_round=2, num_generations=4, minibatches=1,
                        num_iterations=1, max_completion_length=16, lr=1e-3, eval_rows=3,
                        num_threads=1)
    reward = ShortReward()
    assert isinstance(reward, grpo.PolicyReward)

    def evaluate(model, tokenizer, rows):
        return {"rows": float(len(rows)), "training": float(model.training)}

    logged: list[dict] = []
    result = train_grpo(params, policy, "arith", _rows(16, 3), _rows(8, 4), seed=0,
                        out_dir=tmp_path / "p", log=lambda m, step: logged.append(m),
                        rewards=[reward], evaluate=evaluate)
    assert len(reward.bound) == 1 and isinstance(reward.bound[0], torch.nn.Module)
    assert [p["eval_rows"] for p in result["curve"]] == [3.0, 3.0]        # eval_rows cut
    assert [p["eval_training"] for p in result["curve"]] == [0.0, 0.0]    # in eval mode
    assert result["metrics"]["initial_rows"] == result["metrics"]["final_rows"] == 3.0
    keys = set().union(*logged)
    assert {"train/rewards/correct/mean", "train/rewards/short/mean"} <= keys


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
        cfg = grpo.GRPOArm(rounds=2, prompts_per_round=2, num_generations=4, minibatches=1,
                           num_iterations=1, max_completion_length=16, lr=1e-3, eval_every=1,
                           eval_rows=8, num_threads=1, seeds=[0, 1], workers=workers)
        per_seed = grpo.train_arm(cfg, ctx)
        metrics = grpo.arm_metrics(per_seed, ("final_acc", "initial_acc"))
        curves[workers] = pl.read_parquet(root / "runs/arm/curve.parquet").sort(["seed", "step"])
        assert metrics["seeds"] == 2.0 and metrics["rollouts"] == 2 * 2 * 4
        budget = json.loads((root / "runs/arm/budget.json").read_text())
        assert budget == {"method": "arm", "policy_loss": "clip", "replay_batches": 0,
                          **cfg.budget}
    assert curves[1].drop("seconds", strict=False).equals(curves[2].drop("seconds", strict=False))
    for seed in (0, 1):
        a = _weights(tmp_path / "w1/runs/arm" / f"seed{seed}")
        b = _weights(tmp_path / "w2/runs/arm" / f"seed{seed}")
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_arm_config_refuses_repeated_seeds():
    with pytest.raises(ValueError, match="repeat"):
        grpo.GRPOArm(seeds=[0, 0])
