"""Stage `pool`: a fine-tuning pool of a new domain, with a share of label-noise items flagged,
and a clean held-out test set of the same distribution; both disjoint from the shared splits.

    <out>/pool.parquet   the family's columns + `noisy` (bool) + `clean_answer` (the true answer)
    <out>/test.parquet   the family's columns + the same two (noisy is always False)

A noisy row keeps its question but its target's last step and final answer are wrong (the true
value plus a non-zero offset): `answer` is what the target says, `clean_answer` the truth. SFT
then learns a wrong label and RL rewards a wrong answer, as with label noise in a real domain
set. The flag lets a curriculum report how much noise it selects (EDCO spec §6, "noise magnet").

Why a new domain: the shared base model was trained on `+-` only; this pool draws operators from
`+-*` (params), so every `*` step is new to it (the tokenizer already has `*`).

    python -m stages edco pool
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.core.checks import DataValidationError, FrameSpec, read_parquet_checked, validate_frame
from stages.tasks import arith as arith_family
from stages.tasks import load_split

EXTRA_SCHEMA: dict[str, Any] = {"noisy": pl.Boolean, "clean_answer": pl.Int64}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arith: arith_family.Config = Field(
        default_factory=lambda: arith_family.Config(operators="+-*", max_value=12),
        description="difficulty knobs of the new domain (difficulty = number of operands)")
    n_pool: int = Field(900, ge=1, le=10_000_000, description="rows in the fine-tuning pool")
    n_test: int = Field(150, ge=1, le=1_000_000, description="clean held-out rows")
    noise_frac: float = Field(0.05, ge=0, lt=0.5, description="share of pool rows whose target "
                                                             "answer is wrong (spec: ~5%)")
    max_offset: int = Field(10, ge=1, le=1_000_000, description="a noisy answer is the true one "
                                                                "+- 1..max_offset")
    exclude_tasks: str | None = Field("tasks", description="paths key of the shared task folder "
                                      "whose questions are excluded (None: exclude nothing)")
    out: str = Field("edco_pool", description="paths key of the output folder")


def corrupt(row: dict[str, Any], offset: int) -> dict[str, Any]:
    """The row with its last step's result and final answer moved by `offset` (!= 0)."""
    if offset == 0:
        raise ValueError("corrupt: offset must be non-zero")
    operands, ops = arith_family.parse_question(row["question"])
    steps = arith_family.solution_steps(operands, ops)
    wrong = steps[-1].value + offset
    steps[-1] = steps[-1]._replace(value=wrong)
    target = " " + "; ".join(arith_family.format_step(s) for s in steps) + f" #### {wrong}"
    return {**row, "target": target, "answer": wrong}


def add_noise(rows: list[dict[str, Any]], frac: float, max_offset: int,
              seed: str) -> list[dict[str, Any]]:
    """Flag round(frac * len(rows)) seeded rows as noisy and corrupt them; every row gets
    `noisy` and `clean_answer`."""
    rng = random.Random(f"noise:{seed}")
    n_noisy = round(frac * len(rows))
    chosen = set(rng.sample(range(len(rows)), n_noisy))
    out = []
    for i, row in enumerate(rows):
        base = {**row, "noisy": False, "clean_answer": row["answer"]}
        if i in chosen:
            offset = rng.randint(1, max_offset) * rng.choice((-1, 1))
            base = {**corrupt(base, offset), "noisy": True}
        out.append(base)
    return out


def expectations(cfg: arith_family.Config | None, split: str, slack: int = 0) -> FrameSpec:
    """The family's checks of a split + the two extra columns; `slack` widens the answer range
    by the largest noise offset."""
    from dataclasses import replace

    from stages.core.checks import ColumnSpec

    spec = arith_family.expectations(cfg, split)
    columns = dict(spec.columns)
    answer = columns["answer"]
    if answer.min is not None:
        columns["answer"] = replace(answer, min=answer.min - slack, max=answer.max + slack)
    columns.update({name: ColumnSpec(dtype=dtype) for name, dtype in EXTRA_SCHEMA.items()})
    return FrameSpec(columns=columns, min_rows=spec.min_rows)


def read_pool(path: Path, split: str = "pool") -> pl.DataFrame:
    """A pool or test file, validated at the stage boundary (empty file, schema, nulls...)."""
    return read_parquet_checked(path, expectations(None, split))


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    fcfg = cfg.arith
    exclude: set[str] = set()
    if cfg.exclude_tasks:
        for split in ("train", "val", "test"):
            exclude.update(load_split(ctx.path(cfg.exclude_tasks), "arith", split)["question"])
    test = arith_family.generate(fcfg, cfg.n_test, f"edco:{ctx.seed}", split="test",
                                 exclude=exclude)
    exclude.update(r["question"] for r in test)
    pool = arith_family.generate(fcfg, cfg.n_pool, f"edco:{ctx.seed}", split="pool",
                                 exclude=exclude)
    frames = {"pool": add_noise(pool, cfg.noise_frac, cfg.max_offset, f"edco:{ctx.seed}"),
              "test": add_noise(test, 0.0, cfg.max_offset, f"edco:{ctx.seed}")}
    schema = {**arith_family.SCHEMA, **EXTRA_SCHEMA}
    metrics: dict[str, float] = {}
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        for split, rows in frames.items():
            df = pl.DataFrame(rows, schema=schema)
            name = f"{cfg.out}/{split}.parquet"
            validate_frame(df, expectations(fcfg, split, cfg.max_offset), name)
            bad = [r["id"] for r in rows if not arith_family.verify_answer(r, r["target"])]
            clean = [r["id"] for r in rows if not r["noisy"]
                     and not all(arith_family.verify_steps(r, r["target"]))]
            if bad or clean:
                raise DataValidationError(f"{name}: column 'target': rule 'verifies' failed for "
                                          f"{(bad + clean)[:3]}", source=name, column="target",
                                          rule="verifies")
            io.write_parquet(tmp / f"{split}.parquet", df)
            metrics[f"n_{split}"] = float(len(df))
            metrics[f"noisy_{split}"] = float(df["noisy"].sum())
            metrics[f"mul_share_{split}"] = float(df["question"].str.contains("*", literal=True)
                                                  .mean())
            metrics[f"mean_difficulty_{split}"] = float(df["difficulty"].mean())
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: rows per split (`n_<split>`); their composition in details/pool.json."""
    return {k: v for k, v in metrics.items() if k.startswith("n_")}
