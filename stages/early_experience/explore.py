"""Stages `experience` (mini-WebShop) and `babyai_experience` (BabyAI): early experience from
the expert's states (stages.early_experience.experience): at every state of every
demonstration, K alternative actions executed for one step, their outcomes and the templated
reflections.

`<paths.ee_experience>` (parquet), one row per (demonstration, step, branch j): j = 0 is the
expert's own transition, j = 1..K the alternatives in draw order, so the K sweep and the
data-efficiency curve of `train` read the first k branches of the first episodes. The prompt is
the one stored with the demonstration's step (what the policy sees at s_i).
"""

from __future__ import annotations

import random
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.agents.protocol import Env, parse_call
from stages.agents.trajectories import read_rollouts
from stages.core import io
from stages.early_experience import babyai, shop
from stages.early_experience.experience import SCHEMA, explore_state, reflection

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    k: int = Field(ge=1, le=64, description="alternatives per expert state (the largest K "
                   "any `train` setting reads; spec: K = 4, sweep 1-8)")
    seed: int = Field(0, ge=0, description="draw of the alternatives")
    max_results: int = Field(4, ge=2, le=20, description="as in `shop`")
    world: Literal["shop", "babyai"] = Field("shop", description="the environment")
    source: str = Field("ee_shop", description="path key: the world stage's folder")
    out: str = Field("ee_experience", description="path key: the experience table")


def train_envs(cfg: Config, root: Any) -> list[Env]:
    """The environment of every train goal / mission, in episode order."""
    if cfg.world == "babyai":
        return list(babyai.read_episodes(root)["train"])
    catalogue, goals = shop.read_shop(root)
    return list(shop.envs_for(catalogue, goals["train"], "train", cfg.max_results))


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    root = ctx.path(cfg.source)
    envs = train_envs(cfg, root)
    reflect = babyai.reflection if cfg.world == "babyai" else reflection
    episodes, steps = read_rollouts(root / "expert")
    rng = random.Random(f"experience/{cfg.seed}")
    rows = []
    for r_ep in episodes.filter(pl.col("success")).sort("episode_id").iter_rows(named=True):
        e = int(r_ep["episode_id"].split("/")[1])
        env = envs[e]
        env.reset()
        for st in steps.filter(pl.col("episode_id") == r_ep["episode_id"]).sort("step") \
                .iter_rows(named=True):
            call = st["turn"].removeprefix("Action: ")
            for b in explore_state(env, call, cfg.k, rng, reflect):
                rows.append({"episode": e, "step": st["step"], "prompt": st["prompt"],
                             "expert_call": call, **b})
            env.step(parse_call(call, env.tools))
    df = pl.DataFrame(rows, schema=SCHEMA)
    io.write_parquet(ctx.path(cfg.out), df)
    alts = df.filter(pl.col("j") > 0)
    return {"states": float(df.filter(pl.col("j") == 0).height), "alternatives": float(alts.height),
            "alternatives_per_state": alts.height / max(1, df.filter(pl.col("j") == 0).height),
            "reflections_templated": float(alts.height)}


def headline(details: dict[str, float]) -> dict[str, float]:
    return {"states": details["states"], "alternatives": details["alternatives"]}
