"""Stage `tasks`: generate every task family's train/val/test splits from the seed, check, write.

    <paths.tasks>/<family>/{train,val,test}.parquet      columns: the family's SCHEMA

Splits are disjoint on `question`. They are drawn test, then val, then train (each avoiding the
earlier ones), so growing `n_train` leaves the held-out splits unchanged. Each split passes its
great-expectations suite (`stages.core.checks`) and every target passes the family's own
verifiers before anything is written; the whole `<paths.tasks>` folder is then replaced in one
rename, so a killed stage leaves the previous data or none, never a half-written split.

Run:  python -m stages base tasks      (or `dvc repro tasks`; sizes per profile in params.yaml)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io
from stages.core.checks import DataValidationError, validate_frame
from stages.core.config import did_you_mean
from stages.tasks import FAMILIES, get_family
from stages.tasks import arith as arith_family  # not `arith`: that name is a Config field

SPLITS = ("test", "val", "train")  # generation order: held-out splits first


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    families: list[str] = Field(["arith"], min_length=1,
                                description=f"task families to generate; known: {', '.join(FAMILIES)}")
    arith: arith_family.Config = Field(default_factory=arith_family.Config,
                                       description="difficulty knobs of the arith family")
    n_train: int = Field(20_000, ge=1, le=50_000_000, description="rows in train, per family")
    n_val: int = Field(500, ge=1, le=1_000_000, description="rows in val, per family")
    n_test: int = Field(600, ge=1, le=1_000_000, description="rows in test, per family")

    @field_validator("families")
    @classmethod
    def _known_families(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in FAMILIES:
                raise ValueError(str(did_you_mean(name, FAMILIES, "task family")))
        if len(set(value)) != len(value):
            raise ValueError(f"families {value} list a family twice")
        return value


def family_frames(name: str, fcfg: Any, sizes: dict[str, int], seed: int) -> dict[str, pl.DataFrame]:
    family = get_family(name)
    splits = family.generate_splits(fcfg, sizes, seed)
    return {split: pl.DataFrame(rows, schema=family.SCHEMA) for split, rows in splits.items()}


def check_family(name: str, fcfg: Any, frames: dict[str, pl.DataFrame], out_dir: Path,
                 root: Path) -> float:
    """GE suite per split, disjointness across splits, and every target verifying itself.
    Returns the seconds spent in GE validation."""
    family = get_family(name)
    seconds = 0.0
    seen: dict[str, str] = {}
    for split, df in frames.items():
        label = _rel(out_dir / name / f"{split}.parquet", root)
        seconds += validate_frame(df, family.expectations(fcfg, split), label)["seconds"]
        overlap = [q for q in df["question"] if q in seen]
        if overlap:
            raise DataValidationError(
                f"{label}: column 'question': rule 'disjoint splits' failed: {len(overlap)} "
                f"questions also in {seen[overlap[0]]}, e.g. {overlap[:3]}",
                source=label, column="question", rule="disjoint splits")
        seen.update((q, split) for q in df["question"])
        for row in df.iter_rows(named=True):
            if not (family.verify_answer(row, row["target"])
                    and all(family.verify_steps(row, row["target"]))):
                raise DataValidationError(
                    f"{label}: column 'target': rule 'target verifies' failed for {row['id']}: "
                    f"{row['target']!r}", source=label, column="target", rule="target verifies")
    return seconds


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    started = time.perf_counter()
    out_dir = ctx.path("tasks")
    sizes = {split: getattr(cfg, f"n_{split}") for split in SPLITS}
    metrics: dict[str, float] = {}
    validation_seconds = 0.0
    with io.atomic_path(out_dir, is_dir=True) as tmp:
        for name in cfg.families:
            fcfg = getattr(cfg, name)
            t0 = time.perf_counter()
            frames = family_frames(name, fcfg, sizes, ctx.seed)
            metrics[f"{name}_generate_seconds"] = time.perf_counter() - t0
            validation_seconds += check_family(name, fcfg, frames, out_dir, ctx.root)
            for split, df in frames.items():
                io.write_parquet(tmp / name / f"{split}.parquet", df)
                metrics[f"{name}_{split}_rows"] = df.height
                for difficulty, count in df.group_by("difficulty").len().sort("difficulty").iter_rows():
                    metrics[f"{name}_{split}_rows_d{difficulty}"] = count
    metrics["validation_seconds"] = validation_seconds
    metrics["seconds"] = time.perf_counter() - started
    return metrics


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: rows per family and split (`<family>_<split>_rows`); the counts per
    difficulty stay in details/tasks.json."""
    return {k: v for k, v in metrics.items() if k.endswith("_rows")}
