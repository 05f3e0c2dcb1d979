"""GRPO engine: TRL's `GRPOTrainer` with verifier rewards, open for extension the TRL way.

GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300 §4.1) samples G completions per prompt
from the behaviour policy mu = pi_old, scores them (here: the task family's exact verifier, reward
1 if the final answer is right, else 0, plus any extra reward terms), and uses the
group-normalised advantage

    A_i = (R_i - mean_G R) / (std_G R + 1e-4)        shared by every token of completion i

in the clipped surrogate  -mean_t min(r_t A, clip(r_t, 1-eps, 1+eps) A),  r_t = pi/mu.

A paper builds on this engine in three ways, never by copying it:

- **rewards**: `train_grpo(..., rewards=[...])` adds reward terms next to the verifier's; TRL sums
  them. A term is a TRL reward function, or a `PolicyReward` whose `bind(model, tokenizer)` is
  called once the policy is loaded (a term that reads the policy's hidden states, or loads a
  tagger once per run). H-GRPO's InDiv bonus and TRACE's argument-quality reward are such terms.
- **loss**: `train_grpo(..., trainer_cls=...)` takes a subclass of
  `stages.train.grpo_trainer.GRPOTrainer` overriding `policy_loss(model, inputs)`; the base class
  is TRL's clipped loss, untouched (R²VPO's ratio-variance Lagrangian is such a subclass).
- **evaluation**: `train_grpo(..., evaluate=...)` replaces the held-out greedy accuracy of the
  curve by the paper's own measure.

Also here: `replay_batches: K` reuses the completions of the previous K generation rounds (each
with the log-probs of the policy that sampled it) next to the fresh ones; every optimizer step logs
reward, accuracy, KL (if beta > 0), entropy, the ratio's mean / variance, the share of tokens the
clip cuts, rollouts and tokens generated. Optimizer steps per generation round = `minibatches *
num_iterations` (TRL's `steps_per_generation` and `num_iterations`); every arm of a comparison
shares these budgets. `train_seeds` runs one arm's seeds (in worker processes if asked) and
`train_arm` is the body of a plain RL-arm stage (prompts in; policies, curve and budget out).

TRL, torch and transformers are imported only when training starts (the trainer class lives in
`stages.train.grpo_trainer`): stage Configs built on `GRPOParams` validate without them.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Literal, Protocol, Sequence, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.core.stats import mean_std


class GRPOParams(BaseModel):
    """One GRPO run: budgets, sampling, the loss's settings and the evaluation curve."""

    model_config = ConfigDict(extra="forbid")

    policy_loss: Literal["clip"] = Field("clip", description="clip: TRL's clipped GRPO surrogate "
                                         "(a stage with its own trainer subclass widens this)")
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
                                                           "for every loss (fixed across arms)")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    eval_every: int | None = Field(10, ge=1, description="rounds between held-out evaluations "
                                                         "(None: only before and after training)")
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


class GRPOArm(GRPOParams):
    """An RL arm: GRPO settings + where to start, what to train on, which seeds.

    A paper's RL stage Config subclasses this (its params section is the stage name). Arms of one
    comparison must share `GRPOParams.budget` (the pipeline's compare stage refuses otherwise).
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
    def _unique_seeds(self) -> "GRPOArm":
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        return self


# --- rewards and evaluation -------------------------------------------------------------------

RewardFunc = Callable[..., list[float]]
"""A TRL reward function: `(prompts, completions, <dataset columns, e.g. answer>, **kwargs)` ->
one float per completion. TRL sums the outputs of every reward function of a run."""

Evaluation = Callable[[Any, Any, list[dict[str, Any]]], dict[str, float]]
"""`(model, tokenizer, held-out rows) -> {name: value}`: one point of the evaluation curve, with
the model in eval mode. Default: `{"acc": greedy accuracy, "len": mean completion chars}`."""


@runtime_checkable
class PolicyReward(Protocol):
    """A reward term that needs the run's policy (e.g. its hidden states) or something loaded once
    per run: `train_grpo` calls `bind(model, tokenizer)` after loading the policy and hands TRL
    the reward function it returns. With `workers > 1` a term must pickle (a module-level
    dataclass does), since each seed's process binds its own."""

    def bind(self, model: Any, tokenizer: Any) -> RewardFunc: ...


def verifier_reward(family: str) -> RewardFunc:
    """A TRL reward function: 1.0 when the family's exact verifier accepts the final answer."""
    from stages.tasks import get_family

    fam = get_family(family)

    def correct(prompts: list[str], completions: list[str], answer: list[int],
                **_: Any) -> list[float]:
        return [1.0 if fam.verify_answer({"answer": a}, c) else 0.0
                for c, a in zip(completions, answer)]

    correct.__name__ = "correct"  # TRL logs it as rewards/correct/mean = training accuracy
    return correct


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


# --- one run ----------------------------------------------------------------------------------

def train_grpo(params: GRPOParams, model_dir: Path, family: str,
               train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]], seed: int,
               out_dir: Path, log: Callable[[dict[str, float], int], None] | None = None, *,
               rewards: Sequence[RewardFunc | PolicyReward] = (),
               trainer_cls: type | None = None,
               evaluate: Evaluation | None = None) -> dict[str, Any]:
    """Run GRPO from the model at `model_dir`; save the policy to `out_dir` (a `save_pretrained`
    folder, written atomically, plus `policy_state.json`: rollouts, steps, the trainer's state).

    Reward = the family's verifier (0/1) + every term of `rewards`. `trainer_cls`: a subclass of
    `stages.train.grpo_trainer.GRPOTrainer` (default: that class, TRL's clipped loss); it is built
    with `params=params`, so a subclass may read its own settings from a `params` subclass.
    `evaluate`: the curve's measure (default: greedy accuracy and length on `eval_rows`).

    Returns {"curve": [{round, step, rollouts, eval_<name>...}], "metrics": {initial_<name>,
    final_<name>, rollouts, tokens_generated, steps, train_seconds, seconds_per_step, and the
    trainer's `policy_metrics()`}}. The curve is evaluated before training (round 0), every
    `eval_every` rounds and after the last step.
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

    def measure() -> dict[str, float]:
        if evaluate is None:
            acc, length = greedy_accuracy(model, tokenizer, eval_rows, family,
                                          params.max_completion_length, params.eval_batch_size)
            return {"acc": acc, "len": length}
        was_training = model.training
        model.eval()
        try:
            return evaluate(model, tokenizer, eval_rows)
        finally:
            model.train(was_training)

    def evaluate_now(round_: int, step: int) -> None:
        scores = {f"eval_{k}": float(v) for k, v in measure().items()}
        t = trainer_ref.get("trainer")
        point = {"round": float(round_), "step": float(step),
                 "rollouts": float(t.rollouts if t else 0), **scores}
        curve.append(point)
        if log:
            log({**scores, "rollouts": point["rollouts"]}, step)

    class Hooks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if (params.eval_every is not None
                    and state.global_step % (params.steps_per_round * params.eval_every) == 0):
                evaluate_now(state.global_step // params.steps_per_round, state.global_step)

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
        if trainer_cls is None:
            from stages.train.grpo_trainer import GRPOTrainer as trainer_cls
        funcs = [verifier_reward(family)] + [
            r.bind(model, tokenizer) if isinstance(r, PolicyReward) else r for r in rewards]
        trainer = trainer_cls(model=model, processing_class=tokenizer, reward_funcs=funcs,
                              args=config, train_dataset=dataset, callbacks=[Hooks()],
                              params=params)
        trainer_ref["trainer"] = trainer
        evaluate_now(0, 0)
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        if not curve or curve[-1]["step"] != trainer.state.global_step:
            evaluate_now(trainer.state.global_step // params.steps_per_round,
                         trainer.state.global_step)
    model.eval()
    steps = trainer.state.global_step
    io.save_model(model, tokenizer, out_dir)
    io.write_text(Path(out_dir) / "policy_state.json", json.dumps(
        {"policy_loss": params.policy_loss, **trainer.policy_state(),
         "rollouts": trainer.rollouts, "tokens_generated": trainer.tokens_generated,
         "steps": steps}, indent=2))
    names = [k for k in curve[0] if k.startswith("eval_")]
    return {"curve": curve, "metrics": {
        **{f"initial_{k[5:]}": curve[0][k] for k in names},
        **{f"final_{k[5:]}": curve[-1][k] for k in names},
        "rollouts": float(trainer.rollouts), "tokens_generated": float(trainer.tokens_generated),
        "steps": float(steps), "train_seconds": seconds,
        "seconds_per_step": seconds / max(1, steps), **trainer.policy_metrics()}}


# --- one arm: several seeds -------------------------------------------------------------------

def _train_seed(job: tuple[Any, ...]) -> tuple[dict[str, Any], list[tuple[dict, Any]]]:
    """One seed in a worker process: the result and the metrics it would have logged live."""
    import torch

    threads, args, kwargs = job
    if threads:
        torch.set_num_threads(threads)
    records: list[tuple[dict, Any]] = []
    result = train_grpo(*args, log=lambda metrics, step=None: records.append((metrics, step)),
                        **kwargs)
    return result, records


def train_seeds(params: GRPOParams, model_dir: Path, family: str,
                train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]],
                seeds: Sequence[int], out: Path, *, workers: int = 1,
                method_run: Callable[[int], ContextManager[Any]] | None = None,
                rewards: Sequence[RewardFunc | PolicyReward] = (),
                trainer_cls: type | None = None,
                evaluate: Evaluation | None = None) -> dict[int, dict[str, Any]]:
    """`train_grpo` for every seed, each from `model_dir` into `out/seed<k>`; {seed: result}.

    `method_run(seed)` (e.g. `lambda s: ctx.method_run("rl", method, s, params)`) gives the run
    each seed's curve and final metrics are logged to. With `workers > 1` the seeds train in
    spawned processes (no forked torch/MLflow threads; a tiny model keeps one core busy per
    process better than two threads keep two) and each seed's records reach its run afterwards,
    with the same steps: the results do not depend on `workers`, only wall time does.
    """
    import contextlib

    kwargs = {"rewards": list(rewards), "trainer_cls": trainer_cls, "evaluate": evaluate}
    done: dict[int, tuple[dict[str, Any], list[tuple[dict, Any]]]] = {}
    if workers > 1 and len(seeds) > 1:
        import os

        from stages.core.pool import map_jobs

        n = min(workers, len(seeds))
        threads = params.num_threads or max(1, (os.cpu_count() or 1) // n)
        jobs = [(threads, (params, model_dir, family, train_rows, eval_rows, seed,
                           out / f"seed{seed}"), kwargs) for seed in seeds]
        done = dict(zip(seeds, map_jobs(_train_seed, jobs, n)))
    results: dict[int, dict[str, Any]] = {}
    for seed in seeds:
        run_ctx = method_run(seed) if method_run is not None else contextlib.nullcontext(None)
        with run_ctx as mr:
            if seed in done:
                result, records = done[seed]
                for logged, step in records:
                    if mr is not None:
                        mr.log_metrics(logged, step)
            else:
                result = train_grpo(params, model_dir, family, train_rows, eval_rows, seed,
                                    out / f"seed{seed}",
                                    log=mr.log_metrics if mr is not None else None, **kwargs)
            if mr is not None:
                mr.log_metrics(result["metrics"])
        results[seed] = result
    return results


def train_arm(cfg: GRPOArm, ctx: Any, *, rewards: Sequence[RewardFunc | PolicyReward] = (),
              trainer_cls: type | None = None) -> list[dict[str, float]]:
    """The body of a plain RL-arm stage: GRPO on `<prompts>/train.parquet` for every seed, the
    curve on `<prompts>/test.parquet`; writes `<out>/<stage>/` (seed<k>/ policies,
    curve.parquet, budget.json) atomically, registers the first seed's policy as `register_as`
    (alias = method). Returns each seed's final metrics, in seed order."""
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
    settings = cfg.model_dump(mode="json")
    with io.atomic_path(out, is_dir=True) as tmp:
        results = train_seeds(cfg, start, cfg.family, train_rows, eval_rows, cfg.seeds, tmp,
                              workers=cfg.workers, rewards=rewards, trainer_cls=trainer_cls,
                              method_run=lambda seed: ctx.method_run("rl", method, seed,
                                                                     params=settings))
        rows = [{"method": method, "seed": seed, **p}
                for seed in cfg.seeds for p in results[seed]["curve"]]
        io.write_parquet(tmp / "curve.parquet", pl.DataFrame(rows))
        io.write_json(tmp / "budget.json", {"method": method, "policy_loss": cfg.policy_loss,
                                            "replay_batches": cfg.replay_batches,
                                            **cfg.budget})
    per_seed = [results[seed]["metrics"] for seed in cfg.seeds]
    if cfg.register_as and ctx.tracker is not None:
        first = out / f"seed{cfg.seeds[0]}"
        ctx.tracker.register_model(first, cfg.register_as, aliases=[method.replace("_", "-")],
                                   tags={"paperline.method": method,
                                         "paperline.seed": str(cfg.seeds[0])})
        ctx.tracker.annotate_model(first, {"final_acc": per_seed[0]["final_acc"]})
    return per_seed


def arm_metrics(per_seed: list[dict[str, float]], keys: Sequence[str]) -> dict[str, float]:
    """`<key>_mean` / `<key>_std` over seeds (population std) for each key, the rollouts of one
    seed (equal in every seed) and the number of seeds: an RL arm's DVC metrics."""
    metrics: dict[str, float] = {}
    for key in keys:
        metrics[f"{key}_mean"], metrics[f"{key}_std"] = mean_std([m[key] for m in per_seed])
    metrics["rollouts"] = per_seed[0]["rollouts"]
    metrics["seeds"] = float(len(per_seed))
    return metrics
