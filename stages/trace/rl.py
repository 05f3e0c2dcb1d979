"""RL arms of the TRACE pipeline: GRPO with reward 1[correct] (+ lambda * TRACE).

Paper [secondary]: GRPO on Qwen2.5-7B / GSM8K, accuracy-only reward 76.2 vs accuracy + TRACE
81.4. Reward form [reconstructed, spec §2]: r = 1[correct] + lambda * TRACE(CoT), lambda = 0.5;
`trace_weight: 0` is the accuracy-only arm, so both arms run this same module with identical
budgets. `gate_on_correct: true` pays the TRACE term only on correct responses (spec §6 reward-
hacking guard; off by default, as in the reconstructed form).

Engine: the shared GRPO trainer of stages/train/grpo.py (TRL's GRPOTrainer subclass, the exact
arith verifier reward, its evaluation helpers), unchanged. Its `bonus` choices are a closed
list, so the TRACE term is added here as one more TRL reward function; `train_arm` repeats the
~40 lines of setup of `grpo.train_grpo` with that extra reward (grpo.py is a dependency of the
committed dvc.lock files of other pipelines, so it is not edited). After training: greedy
accuracy and mean TRACE of the greedy CoTs on the held-out prompts, per seed.

    python -m stages trace rl_acc      # lambda = 0
    python -m stages trace rl_trace    # lambda = 0.5
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import polars as pl
from pydantic import Field, model_validator

from stages.core import io
from stages.train import grpo
from stages.trace import trace


class Config(grpo.GRPOParams):
    family: str = Field("arith", description="task family whose verifier gives the reward")
    method: str | None = Field(None, description="method name (default: the stage name)")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    model: str = Field("policies", description="paths key of the policy folder")
    start: str = Field("d50_s200", description="condition (sub-folder) RL starts from")
    prompts: str = Field("corpus", description="paths key of train.parquet / test.parquet")
    tagger: str = Field("tagger", description="paths key of the tagger folder")
    out: str = Field("runs", description="paths key of the folder holding <out>/<stage>/")
    tables: trace.Tables = Field(default_factory=trace.Tables)
    trace_weight: float = Field(0.5, ge=0, le=10, description="lambda [reconstructed: 0.5]; "
                                                              "0 = accuracy-only reward")
    gate_on_correct: bool = Field(False, description="TRACE term only on correct responses")
    register_as: str | None = Field(None, description="registered model name (first seed)")
    workers: int = Field(1, ge=1, le=64, description="seeds trained at once (processes)")

    @model_validator(mode="after")
    def _unique_seeds(self) -> "Config":
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        if self.bonus != "none":
            raise ValueError("bonus must stay 'none' here: the TRACE term is trace_weight")
        return self


def trace_reward(tagger_dir: Path, tables: trace.Tables, weight: float, gate: bool
                 ) -> Callable[..., list[float]]:
    """A TRL reward function: weight * TRACE(CoT) (times 1[correct] when gated)."""
    from stages.tasks import arith

    tagger = trace.ClassifierTagger.load(tagger_dir)

    def trace_bonus(prompts: list[str], completions: list[str], answer: list[int],
                    **_: Any) -> list[float]:
        seqs = trace.tag_cots(tagger, [trace.cot_block(c) for c in completions])
        out = []
        for seq, c, a in zip(seqs, completions, answer):
            t = trace.trace_score(seq, tables)["trace"]
            if gate and not arith.verify_answer({"answer": a}, c):
                t = 0.0
            out.append(weight * t)
        return out

    return trace_bonus


def evaluate(model: Any, tokenizer: Any, rows: list[dict[str, Any]], tagger_dir: Path,
             tables: trace.Tables, max_new_tokens: int, batch_size: int) -> dict[str, float]:
    """Greedy accuracy, mean TRACE, mean length and empty-set rate on `rows`."""
    from stages.models.generate import generate
    from stages.tasks import arith

    outs = [o[0] for o in generate(model, tokenizer, [r["prompt"] for r in rows],
                                   max_new_tokens=max_new_tokens, batch_size=batch_size)]
    tagger = trace.ClassifierTagger.load(tagger_dir)
    seqs = trace.tag_cots(tagger, [trace.cot_block(c) for c in outs])
    scores = [trace.trace_score(s, tables)["trace"] for s in seqs]
    n_sent = sum(len(s) for s in seqs)
    return {"acc": sum(arith.verify_answer(r, o) for r, o in zip(rows, outs)) / len(rows),
            "trace": sum(scores) / len(scores), "len": sum(map(len, outs)) / len(outs),
            "empty_set_rate": sum(1 for s in seqs for l in s if not l) / max(1, n_sent)}


def train_arm(params: grpo.GRPOParams, start: Path, tagger_dir: Path, tables: trace.Tables,
              weight: float, gate: bool, train_rows: list[dict[str, Any]],
              eval_rows: list[dict[str, Any]], seed: int, out_dir: Path) -> dict[str, Any]:
    """GRPO from `start` with reward 1[correct] (+ weight * TRACE); the policy to `out_dir`."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import set_seed
    from trl import GRPOConfig

    from stages.models.generate import load_model

    if params.num_threads:
        torch.set_num_threads(params.num_threads)
    set_seed(seed)
    model, tokenizer = load_model(start)
    eval_rows = eval_rows[: params.eval_rows] if params.eval_rows else eval_rows
    before = evaluate(model, tokenizer, eval_rows, tagger_dir, tables,
                      params.max_completion_length, params.eval_batch_size)
    model.train()
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": int(r["answer"])}
                                 for r in train_rows])
    per_step = params.prompts_per_round * params.num_generations // params.minibatches
    rewards = [grpo.verifier_reward("arith")]
    if weight > 0:
        rewards.append(trace_reward(tagger_dir, tables, weight, gate))
    with tempfile.TemporaryDirectory(prefix="paperline-trace-rl-") as scratch:
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
        trainer = grpo._trainer_class()(model=model, processing_class=tokenizer,
                                        reward_funcs=rewards, args=config,
                                        train_dataset=dataset, params=params)
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    history = [h for h in trainer.state.log_history if "reward" in h]
    model.eval()
    after = evaluate(model, tokenizer, eval_rows, tagger_dir, tables,
                     params.max_completion_length, params.eval_batch_size)
    with io.atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
    return {"metrics": {**{f"initial_{k}": v for k, v in before.items()},
                        **{f"final_{k}": v for k, v in after.items()},
                        "train_seconds": seconds, "steps": float(trainer.state.global_step),
                        "rollouts": float(trainer.rollouts)},
            "history": [{"step": h.get("step", i), "reward": h["reward"]}
                        for i, h in enumerate(history)]}


def _train_seed(job: tuple[Any, ...]) -> dict[str, Any]:
    import torch

    threads, *args = job
    if threads:
        torch.set_num_threads(threads)
    return train_arm(*args)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.tasks import arith

    method = cfg.method or ctx.stage
    prompts = ctx.path(cfg.prompts)
    train_rows = read_parquet_checked(prompts / "train.parquet",
                                      arith.expectations(None, "train")).to_dicts()
    eval_rows = read_parquet_checked(prompts / "test.parquet",
                                     arith.expectations(None, "test")).to_dicts()
    start = ctx.path(cfg.model) / cfg.start
    if not (start / "config.json").is_file():
        names = json.loads((ctx.path(cfg.model) / "conditions.json").read_text())
        raise ValueError(f"{ctx.stage}.start = {cfg.start!r}: no such policy; conditions are "
                         f"{[c['condition'] for c in names]}")
    tagger_dir = ctx.path(cfg.tagger)
    settings = grpo.GRPOParams.model_validate(
        {k: v for k, v in cfg.model_dump().items() if k in grpo.GRPOParams.model_fields})
    out = ctx.path(cfg.out) / ctx.stage
    per_seed: dict[int, dict[str, Any]] = {}
    with io.atomic_path(out, is_dir=True) as tmp:
        jobs = {seed: (settings, start, tagger_dir, cfg.tables, cfg.trace_weight,
                       cfg.gate_on_correct, train_rows, eval_rows, seed, tmp / f"seed{seed}")
                for seed in cfg.seeds}
        if cfg.workers > 1 and len(cfg.seeds) > 1:
            import multiprocessing
            import os
            from concurrent.futures import ProcessPoolExecutor

            n = min(cfg.workers, len(cfg.seeds))
            threads = settings.num_threads or max(1, (os.cpu_count() or 1) // n)
            with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
                per_seed = dict(zip(cfg.seeds, pool.map(
                    _train_seed, [(threads, *jobs[s]) for s in cfg.seeds])))
        else:
            per_seed = {s: train_arm(*jobs[s]) for s in cfg.seeds}
        rows = []
        for seed in cfg.seeds:
            res = per_seed[seed]
            rows.append({"method": method, "seed": seed, **res["metrics"]})
            if ctx.tracker is not None:
                with ctx.tracker.method_run("rl", method, seed,
                                            params={**settings.model_dump(mode="json"),
                                                    "trace_weight": cfg.trace_weight}) as mr:
                    for h in res["history"]:
                        mr.log_metrics({"train/reward": h["reward"]}, int(h["step"]))
                    mr.log_metrics(res["metrics"])
        io.write_parquet(tmp / "finals.parquet", pl.DataFrame(rows))
        io.write_json(tmp / "budget.json", {"method": method, "trace_weight": cfg.trace_weight,
                                            "tables": cfg.tables.version, **settings.budget})
    if cfg.register_as and ctx.tracker is not None:
        first = out / f"seed{cfg.seeds[0]}"
        ctx.tracker.register_model(first, cfg.register_as, aliases=[method.replace("_", "-")],
                                   tags={"paperline.method": method,
                                         "paperline.seed": str(cfg.seeds[0])})
        ctx.tracker.annotate_model(first, {k: per_seed[cfg.seeds[0]]["metrics"][k]
                                           for k in ("final_acc", "final_trace")})
    metrics: dict[str, float] = {}
    for key in rows[0]:
        if key in ("method", "seed"):
            continue
        mean, std = grpo.mean_std([float(r[key]) for r in rows])
        metrics[f"{key}_mean"], metrics[f"{key}_std"] = mean, std
    metrics["seeds"] = float(len(cfg.seeds))
    metrics["trace_weight"] = cfg.trace_weight
    if any(math.isnan(v) for v in metrics.values()):
        raise ValueError(f"{ctx.stage}: NaN in metrics {metrics}")
    return metrics
