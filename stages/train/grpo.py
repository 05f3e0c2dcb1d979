"""Shared GRPO trainer: TRL's `GRPOTrainer` with verifier rewards, a pluggable policy loss,
rollout replay and the diagnostics the policy-optimisation papers compare on.

GRPO (Shao et al. 2024, DeepSeekMath) samples G completions per prompt from the behaviour policy
mu = pi_old, scores them (here: the task family's exact verifier, reward 1 if the final answer is
right, else 0), and uses the group-normalised advantage

    A_i = (R_i - mean_G R) / (std_G R + 1e-4)        shared by every token of completion i

in the clipped surrogate  -mean_t min(r_t A, clip(r_t, 1-eps, 1+eps) A),  r_t = pi/mu.

This module subclasses TRL (never forks it), so the same code runs under accelerate / DeepSpeed /
vLLM on GPU workers. What it adds:

- `policy_loss: clip` is TRL's own loss, untouched (the baseline); `policy_loss: r2vpo` replaces it
  by the ratio-variance Lagrangian of `stages.r2vpo.r2vpo` with its dual multiplier.
- `replay_batches: K` reuses the completions of the previous K generation rounds, each with the
  log-probs of the policy that sampled it (mu), next to the fresh ones: stale data that clipping
  ignores and R²VPO down-weights. Rollouts *consumed* (fresh completions) are counted either way.
- every optimizer step logs reward, accuracy, KL (if beta > 0), entropy, ratio mean / variance,
  the share of tokens the clip cuts (or would cut), lambda, rollouts and tokens generated.

Optimizer steps per generation round = `minibatches * num_iterations` (TRL's
`steps_per_generation` and `num_iterations`); every arm of a comparison shares these budgets.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io


class R2VPOParams(BaseModel):
    """Ratio-variance constraint (../shared/papers/r2vpo.md §2; all [reconstructed] defaults)."""

    model_config = ConfigDict(extra="forbid")

    epsilon: float = Field(0.01, gt=0, le=10, description="target Var(r): PPO clip 0.2 keeps "
                                                           "Var(r) ~ 0.005-0.02")
    lambda_init: float = Field(0.1, ge=0, le=1e4, description="lambda_0")
    lambda_lr: float = Field(0.1, ge=0, le=100, description="eta_lambda, dual step size")
    dual_rule: Literal["additive", "multiplicative", "fixed"] = Field(
        "additive", description="lambda update; 'fixed' keeps lambda_init (ablation)")
    center: Literal["mean", "one"] = Field("mean", description="Var around r_bar or around 1")
    v_ema: float = Field(0.9, ge=0, lt=1, description="EMA of V_hat before the dual step")


class GRPOParams(BaseModel):
    """One GRPO run: budgets, sampling and the policy loss. Shared by every RL stage."""

    model_config = ConfigDict(extra="forbid")

    policy_loss: Literal["clip", "r2vpo"] = Field("clip", description="clip: TRL's GRPO loss; "
                                                  "r2vpo: ratio-variance Lagrangian")
    rounds: int = Field(50, ge=1, le=1_000_000, description="generation rounds (rollout budget "
                                                          "= rounds * prompts_per_round * G)")
    prompts_per_round: int = Field(8, ge=1, le=100_000, description="prompts sampled per round")
    num_generations: int = Field(8, ge=2, le=1024, description="G, completions per prompt")
    minibatches: int = Field(2, ge=1, le=1024, description="optimizer steps per pass over a "
                                                          "round's data (TRL steps_per_generation)")
    num_iterations: int = Field(4, ge=1, le=64, description="E, passes over each round's data")
    replay_batches: int = Field(0, ge=0, le=64, description="earlier rounds reused (0 = none)")
    max_completion_length: int = Field(64, ge=1, le=32768, description="generation budget, tokens")
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature of rollouts")
    lr: float = Field(5e-5, gt=0, le=1, description="Adam learning rate (TRL default 1e-6 is "
                                                    "far too small for a tiny model)")
    beta: float = Field(0.0, ge=0, le=10, description="KL(pi || reference) coefficient; 0 = "
                                                      "no reference model")
    clip_epsilon: float = Field(0.2, gt=0, le=10, description="clip range of the clip loss; "
                                                              "also the range clip_fraction uses")
    loss_type: Literal["bnpo"] = Field("bnpo", description="token mean over the micro-batch, "
                                                           "for both losses (fixed across arms)")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    r2vpo: R2VPOParams = Field(default_factory=R2VPOParams)
    bonus: Literal["none", "indiv", "length"] = Field(
        "none", description="extra reward on correct responses: indiv = H-GRPO's w * z_G(InDiv) "
                            "(stages.hsir.hsir); length = -w * z_G(length), the length-penalty "
                            "baseline")
    bonus_weight: float = Field(0.2, ge=0, le=10, description="w of the bonus (H-GRPO: 0.2)")
    indiv_method: Literal["eigenscore", "spectral_entropy"] = Field(
        "eigenscore", description="InDiv formula [reconstructed] (bonus: indiv)")
    indiv_layer: int | Literal["middle"] = Field(-1, description="hidden layer InDiv reads")
    eval_every: int = Field(10, ge=1, description="rounds between held-out greedy evaluations")
    eval_rows: int | None = Field(200, ge=1, description="held-out prompts evaluated (None: all)")
    eval_batch_size: int = Field(256, ge=1, le=8192, description="sequences decoded together")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: all cores)")

    @model_validator(mode="after")
    def _check(self) -> "GRPOParams":
        rows = self.prompts_per_round * self.num_generations
        if rows % self.minibatches:
            raise ValueError(f"prompts_per_round * num_generations = {rows} completions per round "
                             f"must split evenly into minibatches ({self.minibatches})")
        if self.replay_batches and self.num_iterations * self.minibatches < 2:
            raise ValueError("replay_batches > 0 needs num_iterations * minibatches >= 2, or TRL "
                             "keeps no behaviour log-probs to reweight stale rollouts with")
        return self

    @property
    def steps_per_round(self) -> int:
        return self.minibatches * self.num_iterations

    @property
    def budget(self) -> dict[str, int]:
        """What must be equal across the arms of a fair comparison."""
        return {"rounds": self.rounds, "prompts_per_round": self.prompts_per_round,
                "num_generations": self.num_generations, "minibatches": self.minibatches,
                "num_iterations": self.num_iterations,
                "max_completion_length": self.max_completion_length}


# --- rewards --------------------------------------------------------------------------------

def verifier_reward(family: str) -> Callable[..., list[float]]:
    """A TRL reward function: 1.0 when the family's exact verifier accepts the final answer."""
    from stages.tasks import get_family

    fam = get_family(family)

    def correct(prompts: list[str], completions: list[str], answer: list[int],
                **_: Any) -> list[float]:
        return [1.0 if fam.verify_answer({"answer": a}, c) else 0.0
                for c, a in zip(completions, answer)]

    correct.__name__ = "correct"  # TRL logs it as rewards/correct/mean = training accuracy
    return correct


def bonus_reward(kind: str, weight: float, group_size: int, family: str, model: Any,
                 tokenizer: Any, method: str = "eigenscore", layer: Any = -1
                 ) -> Callable[..., list[float]]:
    """The bonus part of the reward, added by TRL to the verifier's 0/1 (rewards are summed).

    TRL passes the completions of a generation batch in groups of G consecutive responses to one
    prompt, which is what the within-group z-score needs.
      indiv   H-GRPO (hsir spec §2 [reconstructed form]): w * z_G(InDiv) on correct responses,
              InDiv from the *current* policy's hidden states and attention.
      length  the length-penalty baseline: -w * z_G(completion length) on correct responses.
    """
    from stages.tasks import get_family
    from stages.hsir import hsir

    fam = get_family(family)

    def bonus(prompts: list[str], completions: list[str], answer: list[int],
              **_: Any) -> list[float]:
        correct = [fam.verify_answer({"answer": a}, c) for c, a in zip(completions, answer)]
        if kind == "indiv":
            import torch

            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    score = hsir.indiv_scores(model, tokenizer, prompts, completions,
                                              layer=layer, method=method)
            finally:
                model.train(was_training)
        else:
            score = [-float(len(c)) for c in completions]
        total = hsir.hgrpo_rewards(correct, score, group_size, w=weight)
        return [t - float(c) for t, c in zip(total, correct)]  # the bonus only

    bonus.__name__ = f"{kind}_bonus"
    return bonus


# --- replay ---------------------------------------------------------------------------------

_PROMPT_KEYS = ("prompt_ids", "prompt_mask")                   # left-padded
_TOKEN_KEYS = ("completion_ids", "completion_mask", "old_per_token_logps",
               "ref_per_token_logps")                            # right-padded, per token


def concat_rollouts(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack generation batches of different widths: prompts left-padded, tokens right-padded.

    Padding is masked out (mask 0), so padded log-probs (0) never enter a loss.
    """
    import torch
    import torch.nn.functional as F

    out: dict[str, Any] = {}
    keys = [k for k in batches[0] if all(k in b for b in batches)]
    for key in keys:
        values = [b[key] for b in batches]
        if key == "num_items_in_batch":
            out[key] = sum(values)
        elif key in _PROMPT_KEYS:
            width = max(v.shape[1] for v in values)
            out[key] = torch.cat([F.pad(v, (width - v.shape[1], 0)) for v in values])
        elif key in _TOKEN_KEYS:
            width = max(v.shape[1] for v in values)
            out[key] = torch.cat([F.pad(v, (0, width - v.shape[1])) for v in values])
        elif torch.is_tensor(values[0]) and values[0].dim() >= 1:
            out[key] = torch.cat(values)
        else:
            out[key] = values[0]
    return out


# --- the trainer ----------------------------------------------------------------------------

def _trainer_class() -> type:
    from trl import GRPOTrainer

    from stages.r2vpo.r2vpo import (
        DualState,
        clip_fraction,
        masked_mean,
        policy_ratio,
        r2vpo_loss,
    )

    class VerifierGRPOTrainer(GRPOTrainer):
        """GRPOTrainer + policy-loss plug-in + replay + ratio diagnostics."""

        def __init__(self, *args: Any, params: GRPOParams, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.params = params
            r = params.r2vpo
            self.dual = DualState(lam=r.lambda_init, lr=r.lambda_lr, epsilon=r.epsilon,
                                  rule=r.dual_rule, ema=r.v_ema)
            self.replay: list[dict[str, Any]] = []
            self.rollouts = 0            # fresh completions generated (the sample budget)
            self.tokens_generated = 0
            self._captured_logps = None
            self._capture = False

        # Fresh rollouts, pushed to the replay buffer, plus the last K rounds (with their mu).
        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            fresh = super()._generate_and_score_completions(inputs)
            if not self.model.training:
                return fresh
            self.rollouts += int(fresh["completion_ids"].shape[0])
            self.tokens_generated += int(fresh["completion_mask"].sum().item())
            self._metrics["train"]["rollouts"].append(float(self.rollouts))
            self._metrics["train"]["tokens_generated"].append(float(self.tokens_generated))
            k = self.params.replay_batches
            if not k:
                return fresh
            stale = self.replay[-k:]
            self.replay = [*stale, {key: (v.detach() if hasattr(v, "detach") else v)
                                    for key, v in fresh.items()}][-k:]
            self._metrics["train"]["replay_rows"].append(
                float(sum(int(b["completion_ids"].shape[0]) for b in stale)))
            return concat_rollouts([fresh, *stale]) if stale else fresh

        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if self._capture:
                self._captured_logps = out[0]
            return out

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            if self.params.policy_loss == "clip":
                self._capture = True
                try:
                    loss = super()._compute_loss(model, inputs)   # TRL's clipped GRPO, as is
                finally:
                    self._capture = False
                logps = self._captured_logps.detach()
                old = inputs.get("old_per_token_logps")
                self._log_ratio_stats(logps, logps if old is None else old, inputs)
                return loss
            return self._r2vpo_loss(model, inputs)

        def _log_ratio_stats(self, logps: Any, old: Any, inputs: dict[str, Any]) -> Any:
            import torch

            mode = "train" if self.model.training else "eval"
            mask = inputs["completion_mask"]
            adv = inputs["advantages"]
            adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
            with torch.no_grad():
                ratio, clamped = policy_ratio(logps, old)
                mean = masked_mean(ratio, mask)
                var = masked_mean((ratio - mean) ** 2, mask)
                m = self._metrics[mode]
                m["ratio/mean"].append(mean.item())
                m["ratio/var"].append(var.item())
                m["ratio/clip_fraction"].append(
                    clip_fraction(ratio, adv, self.params.clip_epsilon, mask).item())
                m["ratio/log_clamped"].append(masked_mean(clamped.float(), mask).item())
            return ratio

        def _r2vpo_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            import torch

            p = self.params.r2vpo
            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, mask], dim=1)
            logps, entropies, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True)
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            adv = inputs["advantages"]
            adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
            ratio, _ = policy_ratio(logps, old)
            # Lagrangian with lambda detached (a plain float): the primal step never moves it.
            loss, variance = r2vpo_loss(ratio, adv, lam=self.dual.lam, epsilon=p.epsilon,
                                        mask=mask, center=p.center)
            mode = "train" if self.model.training else "eval"
            m = self._metrics[mode]
            if self.beta != 0.0:
                ref = inputs["ref_per_token_logps"]
                kl = torch.exp(ref - logps) - (ref - logps) - 1
                loss = loss + self.beta * masked_mean(kl, mask)
                m["kl"].append(masked_mean(kl.detach(), mask).item())
            m["entropy"].append(masked_mean(entropies.detach(), mask).item())
            m["policy_loss"].append(loss.detach().item())
            self._log_ratio_stats(logps.detach(), old, inputs)
            if mode == "train":
                # Dual ascent on the detached V_hat, once per micro-batch (spec §2 pseudo-code).
                m["r2vpo/v_hat"].append(variance.detach().item())
                self.dual.update(variance.detach().item())
                m["r2vpo/lambda"].append(self.dual.lam)
                return loss / self.current_gradient_accumulation_steps
            return loss

    return VerifierGRPOTrainer


# --- one run --------------------------------------------------------------------------------

def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, Any]], family: str,
                    max_new_tokens: int, batch_size: int) -> tuple[float, float]:
    """(accuracy, mean completion chars) of greedy decoding on `rows`, by the exact verifier."""
    from stages.models.generate import generate
    from stages.tasks import get_family

    fam = get_family(family)
    was_training = model.training
    model.eval()
    try:
        outs = generate(model, tokenizer, [r["prompt"] for r in rows],
                        max_new_tokens=max_new_tokens, batch_size=batch_size)
    finally:
        model.train(was_training)
    ok = [fam.verify_answer(r, o[0]) for r, o in zip(rows, outs)]
    return sum(ok) / max(1, len(ok)), sum(len(o[0]) for o in outs) / max(1, len(outs))


def tokens_per_solved(model: Any, tokenizer: Any, rows: list[dict[str, Any]], family: str,
                      max_new_tokens: int, batch_size: int) -> float:
    """Mean generated tokens over the greedy completions that are correct (HSIR's overhead)."""
    from stages.models.generate import generate
    from stages.tasks import get_family

    fam = get_family(family)
    outs = generate(model, tokenizer, [r["prompt"] for r in rows],
                    max_new_tokens=max_new_tokens, batch_size=batch_size)
    lengths = [len(tokenizer(o[0], add_special_tokens=False)["input_ids"])
               for r, o in zip(rows, outs) if fam.verify_answer(r, o[0])]
    return sum(lengths) / len(lengths) if lengths else 0.0


def train_grpo(params: GRPOParams, model_dir: Path, family: str,
               train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]], seed: int,
               out_dir: Path, log: Callable[[dict[str, float], int], None] | None = None
               ) -> dict[str, Any]:
    """Run GRPO from the model at `model_dir`; save the policy to `out_dir` (atomically).

    Returns {"curve": [{round, step, rollouts, eval_acc, eval_len}], "metrics": {...}}.
    The curve is evaluated before training (round 0) and every `eval_every` rounds.
    """
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback, set_seed
    from trl import GRPOConfig

    from stages.models.generate import load_model

    if not train_rows:
        raise ValueError("train_grpo: no training prompts")
    if params.num_threads:
        torch.set_num_threads(params.num_threads)
    set_seed(seed)
    model, tokenizer = load_model(model_dir)
    model.train()
    eval_rows = eval_rows[: params.eval_rows] if params.eval_rows else eval_rows
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": int(r["answer"])}
                                 for r in train_rows])
    per_step = params.prompts_per_round * params.num_generations // params.minibatches
    curve: list[dict[str, float]] = []
    trainer_ref: dict[str, Any] = {}

    def evaluate(round_: int, step: int) -> None:
        acc, length = greedy_accuracy(model, tokenizer, eval_rows, family,
                                      params.max_completion_length, params.eval_batch_size)
        t = trainer_ref.get("trainer")
        point = {"round": float(round_), "step": float(step),
                 "rollouts": float(t.rollouts if t else 0), "eval_acc": acc, "eval_len": length}
        curve.append(point)
        if log:
            log({"eval_acc": acc, "eval_len": length, "rollouts": point["rollouts"]}, step)

    class Hooks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % (params.steps_per_round * params.eval_every) == 0:
                evaluate(state.global_step // params.steps_per_round, state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if log and logs:
                log({f"train/{k}": float(v) for k, v in logs.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)
                     and math.isfinite(float(v))}, state.global_step)

    with tempfile.TemporaryDirectory(prefix="paperline-grpo-") as scratch:
        config = GRPOConfig(
            output_dir=scratch, max_steps=params.rounds * params.steps_per_round,
            per_device_train_batch_size=per_step, steps_per_generation=params.minibatches,
            num_generations=params.num_generations, num_iterations=params.num_iterations,
            max_completion_length=params.max_completion_length, temperature=params.temperature,
            top_k=0, top_p=1.0, learning_rate=params.lr, lr_scheduler_type="constant",
            beta=params.beta, epsilon=params.clip_epsilon, loss_type=params.loss_type,
            max_grad_norm=params.max_grad_norm, logging_steps=params.steps_per_round,
            save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
            bf16=False, gradient_checkpointing=False, seed=seed, data_seed=seed,
            dataloader_pin_memory=False, disable_tqdm=True, shuffle_dataset=True)
        cls = _trainer_class()
        rewards = [verifier_reward(family)]
        if params.bonus != "none":
            rewards.append(bonus_reward(params.bonus, params.bonus_weight,
                                        params.num_generations, family, model, tokenizer,
                                        params.indiv_method, params.indiv_layer))
        trainer = cls(model=model, processing_class=tokenizer, reward_funcs=rewards, args=config,
                      train_dataset=dataset, callbacks=[Hooks()], params=params)
        trainer_ref["trainer"] = trainer
        evaluate(0, 0)
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        if not curve or curve[-1]["step"] != trainer.state.global_step:
            evaluate(trainer.state.global_step // params.steps_per_round,
                     trainer.state.global_step)
    model.eval()
    with io.atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (Path(tmp) / "policy_state.json").write_text(json.dumps(
            {"policy_loss": params.policy_loss, "dual": trainer.dual.to_dict(),
             "rollouts": trainer.rollouts, "tokens_generated": trainer.tokens_generated,
             "steps": trainer.state.global_step}, indent=2))
    steps = trainer.state.global_step
    return {"curve": curve, "metrics": {
        "final_acc": curve[-1]["eval_acc"], "initial_acc": curve[0]["eval_acc"],
        "final_len": curve[-1]["eval_len"], "rollouts": float(trainer.rollouts),
        "tokens_generated": float(trainer.tokens_generated), "steps": float(steps),
        "train_seconds": seconds, "seconds_per_step": seconds / max(1, steps),
        "lambda_final": trainer.dual.lam}}


# --- the stage: one arm of a comparison, several seeds ----------------------------------------

class Config(GRPOParams):
    """An RL arm: GRPO settings + where to start, what to train on, which seeds.

    Every arm of a pipeline is a stage mapped to this module (stages/registry.py); its params
    section is its stage name. Arms of one comparison must share `GRPOParams.budget` (the
    pipeline's compare stage refuses to compare otherwise).
    """

    family: str = Field("arith", description="task family whose verifier gives the reward")
    method: str | None = Field(None, description="method name in MLflow/compare (default: the "
                                                 "stage name)")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="training seeds; each starts from the same model")
    model: str = Field("base_model", description="paths key of the starting policy folder")
    prompts: str = Field("rl_prompts", description="paths key of the RL prompt folder "
                                                   "(train.parquet, test.parquet)")
    out: str = Field("runs", description="paths key of the folder holding <out>/<stage>/")
    register_as: str | None = Field(None, description="registered model name, e.g. r2vpo-policy "
                                                      "(the first seed's policy; alias = method)")
    workers: int = Field(1, ge=1, le=64, description="seeds trained at once, each in its own "
                         "process (with num_threads 0 the cores are split between them); the "
                         "results do not depend on it, only wall time")

    @model_validator(mode="after")
    def _unique_seeds(self) -> "Config":
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        return self


def rollouts_to_reach(curve: list[dict[str, float]], level: float) -> float | None:
    """Rollouts consumed when held-out accuracy first reaches `level` (None: never)."""
    for point in curve:
        if point["eval_acc"] >= level:
            return point["rollouts"]
    return None


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std (ddof=0) over seeds."""
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / n)


def _train_seed(job: tuple[Any, ...]) -> tuple[dict[str, Any], list[tuple[dict, Any]]]:
    """One seed in a worker process: the result and the metrics it would have logged live."""
    import torch

    settings, threads, start, family, train_rows, eval_rows, seed, out_dir = job
    if threads:
        torch.set_num_threads(threads)
    records: list[tuple[dict, Any]] = []
    result = train_grpo(settings, start, family, train_rows, eval_rows, seed, out_dir,
                        log=lambda metrics, step=None: records.append((metrics, step)))
    return result, records


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked
    from stages.tasks import get_family

    method = cfg.method or ctx.stage
    prompts = ctx.path(cfg.prompts)
    expect = get_family(cfg.family).expectations
    train_rows = read_parquet_checked(prompts / "train.parquet", expect(None, "train")).to_dicts()
    eval_rows = read_parquet_checked(prompts / "test.parquet", expect(None, "test")).to_dicts()
    start = ctx.path(cfg.model)
    out = ctx.path(cfg.out) / ctx.stage
    rows, per_seed = [], []
    settings = GRPOParams.model_validate(
        {k: v for k, v in cfg.model_dump().items() if k in GRPOParams.model_fields})
    with io.atomic_path(out, is_dir=True) as tmp:
        done: dict[int, tuple[dict[str, Any], list[tuple[dict, Any]]]] = {}
        if cfg.workers > 1 and len(cfg.seeds) > 1:
            # Seeds in parallel processes (spawned: no forked torch/MLflow threads); a tiny
            # model keeps one core busy per process better than two threads keep two. Each
            # seed's curve reaches its MLflow child run afterwards, with the same steps.
            import multiprocessing
            import os
            from concurrent.futures import ProcessPoolExecutor

            n = min(cfg.workers, len(cfg.seeds))
            threads = settings.num_threads or max(1, (os.cpu_count() or 1) // n)
            jobs = [(settings, threads, start, cfg.family, train_rows, eval_rows, seed,
                     tmp / f"seed{seed}") for seed in cfg.seeds]
            with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
                done = dict(zip(cfg.seeds, pool.map(_train_seed, jobs)))
        for seed in cfg.seeds:
            tracker = ctx.tracker
            run_ctx = (tracker.method_run("rl", method, seed, params=settings.model_dump(mode="json"))
                       if tracker is not None else _null_run())
            with run_ctx as mr:
                if seed in done:
                    result, records = done[seed]
                    for logged, step in records:
                        mr.log_metrics(logged, step)
                else:
                    result = train_grpo(settings, start, cfg.family, train_rows, eval_rows,
                                        seed, tmp / f"seed{seed}", log=mr.log_metrics)
                mr.log_metrics(result["metrics"])
            per_seed.append(result["metrics"])
            rows += [{"method": method, "seed": seed, **p} for p in result["curve"]]
        io.write_parquet(tmp / "curve.parquet", pl.DataFrame(rows))
        io.write_json(tmp / "budget.json", {"method": method, "policy_loss": cfg.policy_loss,
                                            "replay_batches": cfg.replay_batches,
                                            **settings.budget})
    if cfg.register_as and ctx.tracker is not None:
        first = out / f"seed{cfg.seeds[0]}"
        ctx.tracker.register_model(first, cfg.register_as, aliases=[method.replace("_", "-")],
                                   tags={"paperline.method": method,
                                         "paperline.seed": str(cfg.seeds[0])})
        ctx.tracker.annotate_model(first, {"final_acc": per_seed[0]["final_acc"]})
    metrics: dict[str, float] = {}
    for key in ("final_acc", "initial_acc", "final_len", "seconds_per_step", "lambda_final"):
        mean, std = mean_std([m[key] for m in per_seed])
        metrics[f"{key}_mean"], metrics[f"{key}_std"] = mean, std
    metrics["rollouts"] = per_seed[0]["rollouts"]
    metrics["seeds"] = float(len(cfg.seeds))
    return metrics


class _NullRun:
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


class _null_run:
    def __enter__(self) -> _NullRun:
        return _NullRun()

    def __exit__(self, *exc: Any) -> None:
        return None
