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
