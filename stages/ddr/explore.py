"""Stage `explore`: every explorer on every eval database, at the largest turn budget.

Arms: `learned` (the tiny Llama of `train_explorer` through the LLM backend, or a served model
at the `gpu` profile) and the scripted reference arms `breadth`, `depth`, `random`,
`reactive` (stages.ddr.explorers). Every arm gets the same budget: `max_turns` turns, one tool
call each (DDR's loop, arXiv 2602.02039 section 3); the learned one also a per-call token cap.
No explorer conditions on the turns left, so the run at a smaller budget b is the first b
turns of this one, which is how `score` reads the budget sweep.

`paths.ddr_runs` holds rollouts/ (episodes.parquet, steps.parquet: stages.agents.trajectories,
every arm, episode ids `<arm>/s<seed>e<entity>`) and insights.parquet: per arm, seed, entity
and turn, the facts it stated (JSON, `stages.ddr.env.result_facts`; empty = NO INSIGHT) and
the tables it touched.
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.agents.react import PromptFormat
from stages.agents.rollout import Budget, ModelAgent, run_episodes
from stages.agents.trajectories import parse_failure_counts, summarise, to_frames, write_rollouts
from stages.core.checks import ColumnSpec, FrameSpec, read_parquet_checked
from stages.ddr.databases import checklist_spec
from stages.ddr.expert import episodes_of
from stages.ddr.explorers import SCRIPTED, make_explorer
from stages.models.backend import BackendConfig, make_backend

ARMS = ("learned", *SCRIPTED)
INSIGHT_SCHEMA = {"arm": pl.String, "seed": pl.Int64, "entity": pl.Int64, "turn": pl.Int64,
                  "tool": pl.String, "facts": pl.String, "domains": pl.String}


def insight_spec() -> FrameSpec:
    cols = {k: ColumnSpec(dtype=v) for k, v in INSIGHT_SCHEMA.items()}
    cols["arm"] = ColumnSpec(dtype=pl.String, values=ARMS)
    cols["turn"] = ColumnSpec(dtype=pl.Int64, min=0)
    return FrameSpec(cols, min_rows=1)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str] = Field(min_length=1, description=f"explorers, from {ARMS}")
    max_turns: int = Field(ge=1, le=100, description="turns per episode, every arm (DDR: 100)")
    max_new_tokens: int = Field(160, ge=8, le=8192, description="the learned explorer's cap "
                                "per call (its longest expert action is ~100 characters)")
    prompt: PromptFormat = Field(default_factory=PromptFormat)
    learned: BackendConfig = Field(description="the learned explorer: `local` = the folder of "
                                   "train_explorer (paths.ddr_explorer), or a served model")
    batch_size: int = Field(64, ge=1, le=4096, description="episodes stepped together")
    num_threads: int = Field(1, ge=0, le=256)

    @field_validator("arms")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if a not in ARMS]
        if bad or len(set(v)) != len(v):
            raise ValueError(f"explore.arms {v}: unknown {bad} or repeated; arms: {ARMS}")
        return v


def _learned_agent(cfg: Config, ctx: Any) -> ModelAgent:
    bc = cfg.learned
    if bc.kind == "local":
        bc = bc.model_copy(update={"model": str(ctx.path("ddr_explorer"))})
    return ModelAgent(make_backend(bc, root=ctx.root), name="learned")


def insight_rows(arm: str, seed: int, env: Any, ep: Any) -> list[dict[str, Any]]:
    """One row per turn. A reply that did not parse never reached the environment: its turn
    states nothing (NO INSIGHT); every other turn has the environment's record."""
    recorded = iter(zip(env.insights, env.domains))
    rows = []
    for t, step in enumerate(ep.steps):
        facts, doms = next(recorded) if step.tool else ([], [])
        rows.append({"arm": arm, "seed": seed, "entity": env.entity, "turn": t,
                     "tool": step.tool, "facts": json.dumps(facts), "domains": json.dumps(doms)})
    if next(recorded, None) is not None:
        raise RuntimeError(f"episode {ep.episode_id}: more environment records than turns")
    return rows


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core import io
    from stages.models import base

    base.set_threads(cfg.num_threads)
    root = ctx.path("ddr_databases")
    checklist = read_parquet_checked(root / "checklist.parquet", checklist_spec())
    ev = checklist.filter(pl.col("split") == "eval")
    aspects = {f"s{s}e{e}": g.sort("item_id", maintain_order=True)["aspect"].to_list()
               for (s, e), g in ev.group_by("seed", "entity", maintain_order=True)}
    budget = Budget(max_steps=cfg.max_turns, max_new_tokens=cfg.max_new_tokens)
    out: dict[str, float] = {}
    all_eps, all_steps, rows = [], [], []
    for arm in cfg.arms:
        agent = (_learned_agent(cfg, ctx) if arm == "learned"
                 else make_explorer(arm, seed=ctx.seed,
                               checklists={f"{arm}/{k}": v for k, v in aspects.items()}))
        # every seed's episodes stepped together: one batched model call per round
        envs, ids = episodes_of(root, ev, "eval")
        eps = run_episodes(envs, agent, budget, cfg.prompt, episode_ids=[f"{arm}/{i}" for i in ids],
                           batch_size=cfg.batch_size, seed=ctx.seed)
        for seed in sorted(ev["seed"].unique()):
            mine = [i for i, eid in enumerate(ids) if eid.startswith(f"s{seed}e")]
            for i in mine:
                envs[i].close()
                rows += insight_rows(arm, int(seed), envs[i], eps[i])
            episodes, steps = to_frames([eps[i] for i in mine], arm)
            all_eps.append(episodes)
            all_steps.append(steps)
            s = {**summarise(episodes), **parse_failure_counts(steps)}
            for key in ("mean_steps", "parse_failure_rate", "invalid_action_rate",
                        "success_rate", "mean_gen_tokens"):
                out[f"{arm}/s{seed}/{key}"] = s[key]
    # one checked folder for every arm: episode ids `<arm>/s<seed>e<entity>`
    with io.atomic_path(ctx.path("ddr_runs"), is_dir=True) as tmp:
        # one chunk each: the parquet bytes follow polars' chunks (stages/core/io.py write_parquet)
        write_rollouts(tmp / "rollouts", pl.concat(all_eps, rechunk=True),
                       pl.concat(all_steps, rechunk=True))
        pl.DataFrame(rows, schema=INSIGHT_SCHEMA).write_parquet(tmp / "insights.parquet")
    for arm in cfg.arms:
        for key in ("parse_failure_rate", "invalid_action_rate", "success_rate"):
            vals = [v for k, v in out.items() if k.startswith(f"{arm}/s") and k.endswith(key)]
            out[f"{arm}/{key}"] = sum(vals) / len(vals)
    return out


def headline(details: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how often the learned explorer's reply was no valid call, and how often it
    ended its exploration itself (FINISH)."""
    return {k: details[f"learned/{v}"] for k, v in
            (("parse_fail", "parse_failure_rate"), ("finished", "success_rate"))
            if f"learned/{v}" in details}
