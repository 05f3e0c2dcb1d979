"""Stage `prompts`: a prompt set for RL or self-improvement, drawn from a task family with its own
difficulty knobs and disjoint from every question of the shared task splits.

    <out>/train.parquet   prompts the policy is trained on (rewards from the exact verifier)
    <out>/test.parquet    held-out prompts of the same distribution (accuracy curves)

Why a separate set: the shared base model already solves most of the shared splits' easy
problems; an RL or self-improvement comparison needs problems it solves *sometimes* (the reward
must vary within a group, else GRPO's advantage is zero). The knobs here pick that difficulty.
Columns and checks are the family's (same great-expectations suite as the shared splits).
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io
from stages.core.checks import DataValidationError, validate_frame
from stages.tasks import FAMILIES, arith as arith_family, get_family, load_split


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: str = Field("arith", description=f"task family; known: {', '.join(FAMILIES)}")
    arith: arith_family.Config = Field(default_factory=arith_family.Config,
                                       description="difficulty knobs of the prompt distribution")
    n_train: int = Field(2000, ge=1, le=10_000_000, description="training prompts")
    n_test: int = Field(200, ge=1, le=1_000_000, description="held-out prompts")
    exclude_tasks: str | None = Field("tasks", description="paths key of the shared task folder "
                                      "whose questions are excluded (None: exclude nothing)")
    out: str = Field("rl_prompts", description="paths key of the output folder")

    @field_validator("family")
    @classmethod
    def _known(cls, value: str) -> str:
        get_family(value)
        return value


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    family = get_family(cfg.family)
    fcfg = getattr(cfg, cfg.family)
    exclude: set[str] = set()
    if cfg.exclude_tasks:
        for split in ("train", "val", "test"):
            exclude.update(load_split(ctx.path(cfg.exclude_tasks), cfg.family, split)["question"])
    test = family.generate(fcfg, cfg.n_test, f"prompts:{ctx.seed}", split="test", exclude=exclude)
    exclude.update(r["question"] for r in test)
    train = family.generate(fcfg, cfg.n_train, f"prompts:{ctx.seed}", split="train",
                            exclude=exclude)
    out = ctx.path(cfg.out)
    metrics: dict[str, float] = {}
    with io.atomic_path(out, is_dir=True) as tmp:
        for split, rows in (("train", train), ("test", test)):
            df = pl.DataFrame(rows, schema=family.SCHEMA)
            validate_frame(df, family.expectations(fcfg, split), f"{cfg.out}/{split}.parquet")
            bad = [r["id"] for r in rows if not family.verify_answer(r, r["target"])]
            if bad:
                raise DataValidationError(f"{cfg.out}/{split}.parquet: column 'target': rule "
                                          f"'verifies' failed for {bad[:3]}", source=cfg.out,
                                          column="target", rule="verifies")
            io.write_parquet(tmp / f"{split}.parquet", df)
            metrics[f"n_{split}"] = float(len(df))
            metrics[f"mean_difficulty_{split}"] = float(df["difficulty"].mean())
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: prompts per split; their mean difficulty stays in details/<stage>.json."""
    return {k: metrics[k] for k in ("n_train", "n_test") if k in metrics}
