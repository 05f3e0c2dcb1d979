"""Synthetic verifiable task families: generators with exact answer and step verifiers.

`FAMILIES` is a plain dict, name -> module. Every family module exposes:

    Config                                  pydantic difficulty knobs (extra="forbid")
    SCHEMA                                  column -> polars dtype of its split files
    generate(cfg, n, seed, *, split, exclude) -> list[dict]   rows of SCHEMA
    generate_splits(cfg, sizes, seed)       -> {split: rows}, disjoint on `question`
    extract_answer(completion)              -> int | None
    verify_answer(row, completion)          -> bool
    verify_steps(row, completion)           -> list[bool], one verdict per written step

To add a family: write `stages/tasks/<name>.py` with that API and add it here.
"""

from __future__ import annotations

from types import ModuleType

from stages.core.config import did_you_mean

from . import arith

FAMILIES: dict[str, ModuleType] = {"arith": arith}


def get_family(name: str) -> ModuleType:
    """The family module by name; an unknown name fails with a 'did you mean' suggestion."""
    if name not in FAMILIES:
        raise did_you_mean(name, FAMILIES, "task family")
    return FAMILIES[name]


def split_path(tasks_dir, family: str, split: str):
    """`<paths.tasks>/<family>/<split>.parquet`."""
    from pathlib import Path

    return Path(tasks_dir) / family / f"{split}.parquet"


def load_split(tasks_dir, family: str, split: str):
    """Read one split, validated at the stage boundary by the family's great-expectations suite.

    A missing, empty, truncated or schema-violating file raises `DataValidationError` naming the
    file, the column and the rule, before the calling stage computes anything.
    """
    from stages.core.checks import read_parquet_checked

    fam = get_family(family)
    return read_parquet_checked(split_path(tasks_dir, family, split), fam.expectations(None, split))
