"""The RL / self-improvement prompt stage: its own difficulty, disjoint from the shared splits."""

from __future__ import annotations

import polars as pl
import pytest

from stages.core import io
from stages.core.context import Context
from stages.tasks import arith, prompts


def _ctx(tmp_path) -> Context:
    return Context(root=tmp_path, pipeline="p", stage="prompts", pipeline_dir=tmp_path,
                   profile="smoke", seed=0, tracker=None,
                   paths={"metrics": tmp_path / "metrics", "tasks": tmp_path / "tasks",
                          "rl_prompts": tmp_path / "prompts"})


def test_prompts_follow_their_knobs_and_avoid_every_shared_question(tmp_path):
    small = arith.Config(min_operands=2, max_operands=2, max_value=9)
    shared = arith.generate_splits(small, {"test": 20, "val": 20, "train": 40}, seed=0)
    for split, rows in shared.items():
        io.write_parquet(tmp_path / "tasks" / "arith" / f"{split}.parquet",
                         pl.DataFrame(rows, schema=arith.SCHEMA))
    cfg = prompts.Config(arith={"min_operands": 2, "max_operands": 3, "max_value": 9},
                         n_train=30, n_test=10)
    metrics = prompts.run(cfg, _ctx(tmp_path))
    train = pl.read_parquet(tmp_path / "prompts" / "train.parquet")
    test = pl.read_parquet(tmp_path / "prompts" / "test.parquet")
    assert (len(train), len(test)) == (30, 10) and metrics["n_train"] == 30
    taken = {r["question"] for rows in shared.values() for r in rows}
    assert not taken & set(train["question"]) and not taken & set(test["question"])
    assert not set(train["question"]) & set(test["question"])
    assert set(train["difficulty"]) <= {2, 3}


def test_too_many_prompts_for_the_knobs_is_a_clear_error(tmp_path):
    cfg = prompts.Config(arith={"min_operands": 2, "max_operands": 2, "max_value": 2},
                         n_train=50, n_test=5, exclude_tasks=None)
    with pytest.raises(Exception, match="distinct"):
        prompts.run(cfg, _ctx(tmp_path))
    assert not (tmp_path / "prompts").exists()  # nothing half-written
