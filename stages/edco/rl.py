"""Curriculum RL arms of EDCO (spec §2 loop with GRPO), at equal GRPO iterations:

    theta = the base model
    for r in 1..R:
        P_r = the arm's N prompts      edco: top N of the pool by the current model's entropy
                                       random: N seeded random pool prompts (fresh each round)
        theta = GRPO(theta, P_r) for `grpo.rounds` iterations     (the shared TRL trainer,
                                       stages/train/grpo.py; equal in every arm)
        evaluate theta greedily on the clean held-out set

The reward is the exact verifier against the row's `answer`, so a label-noise row rewards a
wrong answer (as a noisy RL set would). Logged per round: held-out accuracy, the selection's
noisy share, `*` share and rows new to the curriculum, GRPO's mean training reward and the share
of prompt groups with zero reward variance (no gradient; spec §4 "track the fraction of prompts
with non-zero group reward variance").

Each curriculum round is one `train_grpo` call from the previous round's policy, so the
optimizer and TRL's sampler restart every round (the official loop restarts its trainer per
round too); every arm pays the same restarts.

    python -m stages edco rl_edco
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.edco import edco
from stages.train.grpo import GRPOParams


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strategy: Literal["edco", "random"] = Field("edco", description="how each round's N "
                                                "prompts are chosen")
    estimator: edco.EstimatorParams = Field(default_factory=edco.EstimatorParams)
    rounds: int = Field(3, ge=1, le=1000, description="R, curriculum rounds (the code: 5)")
    top_n: int = Field(32, ge=1, le=10_000_000, description="N, prompts per round (the code: "
                                                            "200)")
    grpo: GRPOParams = Field(default_factory=GRPOParams, description="GRPO per curriculum "
                             "round; grpo.rounds = iterations per round (the code: 100)")
    eval_rows: int | None = Field(None, ge=1, description="held-out rows evaluated (None: all)")
    max_new_tokens: int = Field(64, ge=1, le=32768, description="greedy evaluation budget")
    gen_batch_size: int = Field(256, ge=1, le=65536, description="sequences decoded together")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    family: Literal["arith"] = Field("arith", description="task family (verifier reward)")
    model: str = Field("base_model", description="paths key of the starting model folder")
    pool: str = Field("edco_pool", description="paths key of the pool folder")
    out: str = Field("runs", description="paths key of the folder holding <out>/<stage>/")
    method: str | None = Field(None, description="method name (default: the stage name)")
    register_as: str | None = Field(None, description="registered model name")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: all cores)")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.top_n < self.grpo.prompts_per_round:
            raise ValueError(f"top_n = {self.top_n} is smaller than grpo.prompts_per_round = "
                             f"{self.grpo.prompts_per_round}: one GRPO batch needs that many")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        return self

    @property
    def budget(self) -> dict[str, Any]:
        return {**self.grpo.budget, "iterations_per_round": self.grpo.rounds,
                "rounds": self.rounds, "top_n": self.top_n, "lr": self.grpo.lr}


def random_prompts(size: int, n: int, seed: int, round_: int) -> list[int]:
    """N distinct pool indices, a fresh seeded draw per round."""
    if n > size:
        raise ValueError(f"random_prompts: N = {n} but the pool has {size} rows")
    return random.Random(f"rl_random:{seed}:{round_}").sample(range(size), n)


def curriculum_rl(cfg: Config, start: Path, rows: list[dict[str, Any]],
                  test_rows: list[dict[str, Any]], seed: int, out_dir: Path,
                  log: Callable[[dict[str, float], int], None] | None = None,
                  name: str = "rl") -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    from stages.models.generate import load_model
    from stages.edco.sft import evaluate, selection_stats
    from stages.train.grpo import train_grpo

    if not rows:
        raise ValueError("curriculum_rl: the pool is empty")
    if cfg.top_n > len(rows):
        raise ValueError(f"top_n = {cfg.top_n} but the pool has only {len(rows)} rows")
    params = cfg.grpo.model_copy(update={"eval_every": None})  # evaluated here, per round
    steps = params.rounds * params.steps_per_round
    seen: set[int] = set()
    curve, picks = [], []
    current = Path(start)
    with tempfile.TemporaryDirectory(prefix="paperline-edco-rl-") as scratch:
        for r in range(1, cfg.rounds + 1):
            started = time.perf_counter()
            scores = None
            if cfg.strategy == "edco":
                model, tokenizer = load_model(current)
                scores = edco.prompt_entropy(model, tokenizer, [x["prompt"] for x in rows],
                                             cfg.estimator, seed=1000 * seed + r)
                picked = edco.select_top_n(scores, cfg.top_n)
                del model
            else:
                picked = random_prompts(len(rows), cfg.top_n, seed, r)
            select_seconds = time.perf_counter() - started
            stats = selection_stats(rows, picked, seen, scores)
            seen.update(picked)
            picks += [{"seed": seed, "round": r, "rank": k, "row": i, "id": rows[i]["id"],
                       "noisy": bool(rows[i]["noisy"]),
                       "score": math.nan if scores is None else float(scores[i])}
                      for k, i in enumerate(picked)]
            trace: dict[str, list[float]] = {"reward": [], "zero_std": []}

            def record(metrics: dict[str, float], step: int, r: int = r) -> None:
                for key, name_ in (("train/reward", "reward"),
                                   ("train/frac_reward_zero_std", "zero_std")):
                    if key in metrics:
                        trace[name_].append(metrics[key])
                if log:
                    log({k: v for k, v in metrics.items() if k.startswith("train/")},
                        (r - 1) * steps + step)

            nxt = Path(scratch) / f"round{r}"
            result = train_grpo(params, current, cfg.family, [rows[i] for i in picked], [],
                                1000 * seed + r, nxt, log=record)
            current = nxt
            model, tokenizer = load_model(current)
            point = {"round": float(r), "grpo_steps": float(r * steps),
                     "rollouts": float(r * result["metrics"]["rollouts"]), **stats,
                     "train_reward": _mean(trace["reward"]),
                     "frac_reward_zero_std": _mean(trace["zero_std"]),
                     **evaluate(model, tokenizer, test_rows, cfg.max_new_tokens,
                                cfg.gen_batch_size),
                     "unique_items": float(len(seen))}
            curve.append(point)
            # wall times go to MLflow only: the curve is a DVC output, same inputs -> same bytes
            times = {"select_seconds": select_seconds,
                     "round_seconds": time.perf_counter() - started}
            if log:
                log({k: v for k, v in (point | times).items() if math.isfinite(v)}, r * steps)
            print(f"{name} seed {seed} round {r}: acc {point['acc']:.3f}, reward "
                  f"{point['train_reward']:.3f}, zero-std groups "
                  f"{point['frac_reward_zero_std']:.2f}, noisy {stats['noisy_frac']:.3f}, "
                  f"round {times['round_seconds']:.1f}s", flush=True)
        io.save_model(model, tokenizer, out_dir)
    return curve, picks


def _mean(values: list[float]) -> float:
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.models.base import set_threads
    from stages.models.generate import load_model
    from stages.edco.sft import evaluate, finish, load_pool

    set_threads(cfg.num_threads)
    method = cfg.method or ctx.stage
    rows, test_rows = load_pool(ctx, cfg.pool, cfg.eval_rows)
    if cfg.top_n > len(rows):
        raise ValueError(f"{ctx.stage}.top_n = {cfg.top_n} but the pool has only {len(rows)} "
                         f"rows: expected N <= pool size")
    start = ctx.path(cfg.model)
    model, tokenizer = load_model(start)
    zero = evaluate(model, tokenizer, test_rows, cfg.max_new_tokens, cfg.gen_batch_size)
    del model
    out = ctx.path(cfg.out) / ctx.stage
    curve_rows, pick_rows = [], []
    with io.atomic_path(out, is_dir=True) as tmp:
        for seed in cfg.seeds:
            with ctx.method_run("rl", method, seed, params={
                    "strategy": cfg.strategy, **cfg.model_dump(mode="json")}) as mr:
                mr.log_metrics({k: v for k, v in zero.items() if math.isfinite(v)}, 0)
                curve, picks = curriculum_rl(cfg, start, rows, test_rows, seed,
                                             tmp / f"seed{seed}", log=mr.log_metrics,
                                             name=method)
                mr.log_metrics({"final_acc": curve[-1]["acc"]})
            curve_rows.append({"method": method, "seed": seed, "round": 0.0, "grpo_steps": 0.0,
                               "rollouts": 0.0, **zero})
            curve_rows += [{"method": method, "seed": seed, **p} for p in curve]
            pick_rows += picks
        frame = pl.DataFrame(curve_rows, infer_schema_length=None)
        io.write_parquet(tmp / "curve.parquet", frame)
        io.write_parquet(tmp / "selections.parquet", pl.DataFrame(pick_rows,
                                                                  infer_schema_length=None))
        io.write_json(tmp / "budget.json", {"method": method, "kind": "rl",
                                            "strategy": cfg.strategy, "pool_size": len(rows),
                                            **cfg.budget})
    metrics = finish(cfg, ctx, out, method, frame)
    trained = frame.filter(pl.col("round") > 0)
    metrics["frac_reward_zero_std"] = _mean(trained["frac_reward_zero_std"].to_list())
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the arm's final held-out accuracy (mean, std over seeds) and on rows with
    `*`; the curriculum statistics in details/<arm>.json."""
    return {k: metrics[k] for k in ("acc_mean", "acc_std", "acc_mul_mean") if k in metrics}
