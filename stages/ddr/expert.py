"""Stage `expert`: the scripted breadth-first explorer on the train databases; its
trajectories (stages.agents.trajectories, checked parquet) are what the learned explorer
imitates. The expert is a script, labelled as such: it is never an arm under test.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.agents.react import PromptFormat
from stages.agents.rollout import Budget, run_episodes
from stages.agents.trajectories import summarise, to_frames, write_rollouts
from stages.core.checks import read_parquet_checked
from stages.ddr.databases import checklist_spec, db_path
from stages.ddr.env import SQLiteEnv
from stages.ddr.explorers import make_explorer


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    explorer: str = Field("breadth", description="the scripted expert (breadth-first, spec §4)")
    max_turns: int = Field(ge=1, le=100, description="turn cap of an expert episode")
    prompt: PromptFormat = Field(default_factory=PromptFormat, description="the prompt the "
                                 "learned explorer will see (same anchor as `explore`)")


def episodes_of(root: Any, checklist: pl.DataFrame, split: str) -> tuple[list[SQLiteEnv],
                                                                         list[str]]:
    """One environment per (seed, entity) of a split, with episode ids `s<seed>e<entity>`."""
    keys = checklist.filter(pl.col("split") == split).select("seed", "entity").unique() \
        .sort("seed", "entity")
    envs, ids = [], []
    for seed, entity in keys.iter_rows():
        envs.append(SQLiteEnv(db_path(root, split, seed, entity), entity))
        ids.append(f"s{seed}e{entity}")
    return envs, ids


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    root = ctx.path("ddr_databases")
    checklist = read_parquet_checked(root / "checklist.parquet", checklist_spec())
    envs, ids = episodes_of(root, checklist, "train")
    eps = run_episodes(envs, make_explorer(cfg.explorer), Budget(max_steps=cfg.max_turns),
                       cfg.prompt, episode_ids=ids)
    for env in envs:
        env.close()
    episodes, steps = to_frames(eps, f"expert_{cfg.explorer}")
    write_rollouts(ctx.path("ddr_expert"), episodes, steps)
    out = summarise(episodes)
    return {"expert_episodes": out["episodes"], "expert_finished": out["success_rate"],
            "expert_mean_turns": out["mean_steps"], "expert_turns": float(steps.height)}


def headline(details: dict[str, float]) -> dict[str, float]:
    return {"finished": details["expert_finished"]}
