"""Stage `rollouts`: sampled step-by-step solutions from a policy, each step labelled by the exact
step verifier.

For every problem of `<problems>/{train,test}.parquet`, `n` solutions are sampled from the policy
(temperature and `n` from params) and split into steps (`family.parse_steps`). Every step carries
its TRUE correctness (`family.verify_steps`: still on the true path after this step), which the
process-reward pipelines use as gold labels, beside whatever noisier label they compute.

    <out>/train.parquet   rollouts on the training problems (the PRM data pool)
    <out>/test.parquet    rollouts on the held-out problems (the process benchmark, best-of-N)

One row per rollout; list columns hold the per-step values:

    rollout_id  problem_id  question  prompt  answer  difficulty  source
    completion  steps: list[str]  step_ends: list[int]  step_correct: list[bool]  answer_correct

`source` names the bucket a selection rule ranks within (BIS ranks per source file; here the
bucket is the problem's difficulty, whose error rates differ like the paper's sources do).
`completion[:step_ends[j]]` is the solution prefix through step j. Rollouts in which the
verifier finds no step are dropped and counted (`dropped_no_steps`).
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io

SCHEMA: dict[str, Any] = {
    "rollout_id": pl.String, "problem_id": pl.String, "question": pl.String,
    "prompt": pl.String, "answer": pl.Int64, "difficulty": pl.Int64, "source": pl.String,
    "completion": pl.String, "steps": pl.List(pl.String), "step_ends": pl.List(pl.Int64),
    "step_correct": pl.List(pl.Boolean), "answer_correct": pl.Boolean,
}


def expectations() -> Any:
    """What every reader of a rollouts file relies on: SCHEMA, no nulls (also inside the lists),
    unique rollout ids, at least one step per rollout (the stage drops step-less ones) and
    one step end and one label per step (checked in the stages that zip them)."""
    from stages.core.checks import ColumnSpec, spec_from_schema

    return spec_from_schema(
        SCHEMA, rollout_id={"unique": True},
        steps={"min_len": 1, "elements": ColumnSpec(dtype=pl.String)},
        step_ends={"min_len": 1, "elements": ColumnSpec(dtype=pl.Int64, min=0)},
        step_correct={"min_len": 1, "elements": ColumnSpec(dtype=pl.Boolean)})


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: str = Field("arith", description="task family (its verifiers label the steps)")
    model: str = Field("base_model", description="paths key of the policy folder")
    problems: str = Field("problems", description="paths key of the problem folder "
                                                  "(train.parquet, test.parquet)")
    out: str = Field("rollouts", description="paths key of the output folder")
    n_train: int = Field(4, ge=1, le=1024, description="solutions per training problem")
    n_test: int = Field(8, ge=1, le=1024, description="solutions per held-out problem "
                                                      "(N of best-of-N)")
    max_problems_train: int | None = Field(None, ge=1, description="use the first k training "
                                                                   "problems (None: all)")
    max_problems_test: int | None = Field(None, ge=1, description="use the first k held-out "
                                                                  "problems (None: all)")
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    max_new_tokens: int = Field(64, ge=1, le=32768, description="generation budget, tokens")
    batch_size: int = Field(256, ge=1, le=65536, description="sequences generated together")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: default)")

    @field_validator("family")
    @classmethod
    def _known(cls, value: str) -> str:
        from stages.tasks import get_family

        get_family(value)
        return value


def label_rollouts(family: Any, problems: list[dict[str, Any]],
                   completions: list[list[str]], split: str) -> tuple[list[dict[str, Any]], int]:
    """Rows of SCHEMA for the sampled `completions` (one list per problem); also the number of
    completions dropped because the verifier found no step in them."""
    rows, dropped = [], 0
    for problem, outs in zip(problems, completions, strict=True):
        for k, text in enumerate(outs):
            steps = family.parse_steps(text)
            if not steps:
                dropped += 1
                continue
            correct = family.verify_steps(problem, text)
            rows.append({
                "rollout_id": f"{problem['id']}-r{k:03d}", "problem_id": problem["id"],
                "question": problem["question"], "prompt": problem["prompt"],
                "answer": int(problem["answer"]), "difficulty": int(problem["difficulty"]),
                "source": f"d{int(problem['difficulty'])}", "completion": text,
                "steps": steps, "step_ends": family.step_ends(text), "step_correct": correct,
                "answer_correct": bool(family.verify_answer(problem, text)),
            })
    return rows, dropped


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.models.base import set_threads
    from stages.models.generate import generate, load_model
    from stages.tasks import get_family

    family = get_family(cfg.family)
    folder = ctx.path(cfg.problems)
    splits = {}
    for split, limit in (("train", cfg.max_problems_train), ("test", cfg.max_problems_test)):
        df = read_parquet_checked(folder / f"{split}.parquet", family.expectations(None, split))
        splits[split] = df.head(limit).to_dicts() if limit else df.to_dicts()
    if cfg.num_threads:
        set_threads(cfg.num_threads)
    model, tokenizer = load_model(ctx.path(cfg.model))
    metrics: dict[str, float] = {}
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        for split, n in (("train", cfg.n_train), ("test", cfg.n_test)):
            problems = splits[split]
            outs = generate(model, tokenizer, [p["prompt"] for p in problems],
                            max_new_tokens=cfg.max_new_tokens, do_sample=True,
                            temperature=cfg.temperature, top_p=cfg.top_p, num_samples=n,
                            batch_size=cfg.batch_size, seed=ctx.seed + (split == "test"))
            rows, dropped = label_rollouts(family, problems, outs, split)
            if not rows:
                raise ValueError(f"rollouts/{split}: no sampled solution contains a step "
                                 f"({len(problems)} problems x {n}); check the policy "
                                 f"{cfg.model!r} and max_new_tokens")
            df = pl.DataFrame(rows, schema=SCHEMA)
            io.write_parquet(tmp / f"{split}.parquet", df)
            steps = df["step_correct"].explode()
            mixed = df["step_correct"].list.eval(pl.element().cast(pl.Int64)).list.sum()
            metrics |= {
                f"{split}_rollouts": float(len(df)),
                f"{split}_steps": float(len(steps)),
                f"{split}_step_acc": float(steps.mean()),
                f"{split}_answer_acc": float(df["answer_correct"].mean()),
                f"{split}_mixed_share": float(((mixed > 0) & (mixed < df["steps"].list.len()))
                                              .mean()),
                f"{split}_dropped_no_steps": float(dropped),
            }
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the policy's answer and step accuracy on the test rollouts; counts and the
    train split in details/rollouts.json."""
    return {k: metrics[k] for k in ("test_answer_acc", "test_step_acc") if k in metrics}
