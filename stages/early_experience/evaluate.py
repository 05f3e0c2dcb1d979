"""Stages `evaluate` (mini-WebShop) and `babyai_evaluate` (BabyAI): every trained policy plays
the in-domain test goals and the OOD goals (the shop: unseen categories, `ood`, and unseen
(colour, category) combinations, `ood_combo`; BabyAI: a key as the target, `ood`),
greedy, through the harness's rollout runner and the LLM backend: the
`local` backend loads each `train` folder with the real Hugging Face code; at the `gpu` profile
`policy.kind: openai` plays the served model named `policy.model` with `{setting}` and `{seed}`
filled in (one served model per trained policy).

Every arm plays the SAME goals (episode `<split>/<goal>`), so success is paired per episode
across arms as well as per seed; `compare` pairs per seed (the house rule: the seed is the unit
that varies the training). Budget, every arm: `max_steps` turns of at most `max_new_tokens`
tokens of the policy's own tokenizer (room for the reflection an SR policy writes before its
action).

`<paths.ee_runs>`: rollouts/ (stages.agents.trajectories, episode ids
`<setting>/s<seed>/<split>/<goal>`) and success.parquet (setting, seed, split, goal, success).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.agents.react import PromptFormat
from stages.agents.rollout import Budget, ModelAgent, run_episodes
from stages.agents.trajectories import summarise, to_frames, write_rollouts
from stages.core import io
from stages.core.checks import ColumnSpec, FrameSpec
from stages.core.config import section_for
from stages.early_experience import babyai, shop
from stages.early_experience.train import Config as TrainConfig, settings
from stages.models.backend import BackendConfig, make_backend

SUCCESS_SCHEMA = {"setting": pl.String, "seed": pl.Int64, "split": pl.String,
                  "goal": pl.Int64, "success": pl.Boolean}


def success_spec() -> FrameSpec:
    cols = {k: ColumnSpec(dtype=v) for k, v in SUCCESS_SCHEMA.items()}
    cols["split"] = ColumnSpec(dtype=pl.String, values=shop.EVAL_SPLITS)
    return FrameSpec(cols, min_rows=1)


def eval_splits(world: str) -> tuple[str, ...]:
    """The splits every policy of a world plays."""
    return shop.EVAL_SPLITS if world == "shop" else ("test", "ood")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(8, ge=4, le=100, description="turns per episode (as in `shop`)")
    max_new_tokens: int = Field(64, ge=8, le=4096, description="cap per reply, every arm")
    max_failures: int = Field(3, ge=1, le=100, description="end an episode after this many "
                              "failed turns in a row (DDR's 3 nudges; a policy that lost the "
                              "format stops costing generation)")
    max_results: int = Field(4, ge=2, le=20, description="as in `shop`")
    prompt: PromptFormat
    policy: BackendConfig = Field(description="`local`: the `train` folders; `openai`: "
                                  "a served model per policy, `model` with {setting}/{seed}")
    batch_size: int = Field(256, ge=1, le=65_536, description="episodes stepped together")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads (workers = 1)")
    workers: int = Field(1, ge=1, le=64, description="policies played at once, one process "
                         "(1 thread) each; greedy rollouts do not depend on it")
    world: Literal["shop", "babyai"] = Field("shop", description="the environment")
    source: str = Field("ee_shop", description="path key: the world stage's folder")
    policies: str = Field("ee_policies", description="path key: the trained policies")
    train_section: str = Field("train", description="the params section of the train stage "
                               "whose settings and seeds are played")
    out: str = Field("ee_runs", description="path key: rollouts and success table")


def split_envs(cfg: Config, source: Any, split: str) -> list[Any]:
    """Fresh environments of one split's goals / missions (from the world stage's folder
    `source`), in goal order."""
    if cfg.world == "babyai":
        return babyai.read_episodes(source)[split]
    catalogue, goals = shop.read_shop(source)
    return shop.envs_for(catalogue, goals[split], split, cfg.max_results)


def check_splits(cfg: Config, source: Any) -> None:
    """Every split the policies play has goals (missions), or a ValueError naming the split:
    an empty one would leave its success rate undefined (0 / 0)."""
    for split in eval_splits(cfg.world):
        if not split_envs(cfg, Path(source), split):
            what = "missions" if cfg.world == "babyai" else "goals"
            raise ValueError(f"{cfg.world} evaluate: {source} has no `{split}` {what} (an "
                             f"output of an older `{cfg.source}` stage? rerun it)")


def _agent(cfg: Config, root: Any, policies: Any, setting: str, seed: int) -> ModelAgent:
    bc = cfg.policy
    if bc.kind == "local":
        path = Path(policies) / setting / f"s{seed}"
        return ModelAgent(make_backend(bc.model_copy(update={"model": str(path)}),
                                       root=root), name=setting)
    name = bc.model.format(setting=setting, seed=seed)
    return ModelAgent(make_backend(bc.model_copy(update={"model": name}), root=root),
                      name=setting)


def play(job: dict[str, Any]) -> dict[str, Any]:
    """One policy (setting, seed) on the test and OOD goals: its rollout frames, success rows
    and metrics. A plain function of plain data: `run` maps it over the policies in worker
    processes (`stages.core.pool`); greedy rollouts depend on the policy and the goals only."""
    from stages.models import base

    cfg, name, seed = Config.model_validate(job["cfg"]), job["setting"], job["seed"]
    base.set_threads(job["threads"])
    agent = _agent(cfg, job["root"], job["policies"], name, seed)
    budget = Budget(max_steps=cfg.max_steps, max_new_tokens=cfg.max_new_tokens,
                    max_failures=cfg.max_failures)
    envs, ids = [], []
    for split in eval_splits(cfg.world):
        fresh = split_envs(cfg, Path(job["source"]), split)
        envs += fresh
        ids += [f"{name}/s{seed}/{split}/{g}" for g in range(len(fresh))]
    eps = run_episodes(envs, agent, budget, cfg.prompt, episode_ids=ids,
                       batch_size=cfg.batch_size, seed=seed)
    episodes, steps = to_frames(eps, name)
    metrics: dict[str, float] = {}
    rows = []
    for split in eval_splits(cfg.world):
        mine = [e for e in eps if f"/{split}/" in e.episode_id]
        rows += [{"setting": name, "seed": seed, "split": split,
                  "goal": int(e.episode_id.rsplit("/", 1)[1]), "success": e.success}
                 for e in mine]
        metrics[f"success_{split}"] = sum(e.success for e in mine) / len(mine)
    s = summarise(episodes)
    metrics.update({k: s[k] for k in ("parse_failure_rate", "invalid_action_rate",
                                      "mean_steps", "mean_gen_tokens")})
    return {"episodes": episodes, "steps": steps, "rows": rows, "metrics": metrics}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.pool import map_jobs

    source = ctx.path(cfg.source)
    check_splits(cfg, source)             # the goals read and checked before any model loads
    # the settings and seeds `train` trained (its section, the active profile applied)
    tcfg = TrainConfig.model_validate(section_for(ctx.params, cfg.train_section, ctx.profile,
                                                  "params.yaml"))
    out: dict[str, float] = {}
    all_eps, all_steps, rows = [], [], []
    played = [(name, arm, seed) for name, arm, _, _ in settings(tcfg) for seed in tcfg.seeds]
    jobs = [{"cfg": cfg.model_dump(), "setting": name, "seed": seed, "root": str(ctx.root),
             "source": str(source), "policies": str(ctx.path(cfg.policies)),
             "threads": cfg.num_threads if cfg.workers == 1 else 1}
            for name, _, seed in played]
    for (name, arm, seed), res in zip(played, map_jobs(play, jobs, cfg.workers), strict=True):
        all_eps.append(res["episodes"])
        all_steps.append(res["steps"])
        rows += res["rows"]
        metrics = res["metrics"]
        for k, v in metrics.items():
            out[f"{name}/s{seed}/{k}"] = v
        if name == arm:     # the main setting: one MLflow run per (arm, seed)
            params = {"arm": arm, "seed": seed, "updates": tcfg.steps, "k": tcfg.k,
                      "reflections": "templated" if arm == "sr" else "none"}
            with ctx.method_run(ctx.stage, arm, seed, params=params) as run_:
                run_.log_metrics(metrics)
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        # one chunk each: the parquet bytes follow polars' chunks (stages/core/io.py write_parquet)
        write_rollouts(tmp / "rollouts", pl.concat(all_eps, rechunk=True),
                       pl.concat(all_steps, rechunk=True))
        pl.DataFrame(rows, schema=SUCCESS_SCHEMA).write_parquet(tmp / "success.parquet")
    for name, _, _, _ in settings(tcfg):
        for key in (*(f"success_{s}" for s in eval_splits(cfg.world)), "parse_failure_rate"):
            vals = [out[f"{name}/s{s}/{key}"] for s in tcfg.seeds]
            out[f"{name}/{key}"] = sum(vals) / len(vals)
    return out


def headline(details: dict[str, float]) -> dict[str, float]:
    """DVC metrics: each main arm's mean success, in-domain and on the `ood` split (8 columns:
    with both worlds' other stages, `dvc metrics show` stays one line under 250 characters;
    the shop's `ood_combo` success is in details/evaluate.json, MLflow and the README)."""
    return {f"{a}_{s}": details[f"{a}/success_{s}"] for a in ("il", "iwm", "sr", "dpo")
            for s in ("test", "ood") if f"{a}/success_{s}" in details}
