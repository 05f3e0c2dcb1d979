"""Stage `babyai`: the BabyAI missions of every split, the bot's demonstrations and the reference
arms that bound the learned ones (stages.early_experience.babyai).

    <paths.ee_babyai>/episodes.parquet   split (train | test | ood), episode, level, seed,
                                         mission, target type
    <paths.ee_babyai>/expert/            BabyAIBot's rollouts on the train missions (checked
                                         parquet, stages.agents.trajectories): D_expert

Level seeds: train from `train_start`, test from `test_start`, OOD from `ood_start`, each the
first seeds whose mission names a target of its split (ball or box in-domain, key OOD), so no
test or OOD layout is a train layout. The bot and a uniform-random agent also play test and OOD:
the ceiling and the floor.
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.agents.react import PromptFormat
from stages.agents.rollout import Budget
from stages.core import io
from stages.early_experience import babyai
from stages.early_experience.build import demos_and_bounds


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: str = Field(babyai.LEVEL, description="a minigrid BabyAI level id")
    n_train: int = Field(ge=1, le=100_000, description="demonstration missions")
    n_test: int = Field(ge=2, le=100_000, description="in-domain test missions")
    n_ood: int = Field(ge=2, le=100_000, description="OOD test missions (a key as the target)")
    train_start: int = Field(0, ge=0, description="first level seed of the train missions")
    test_start: int = Field(1_000_000, ge=0)
    ood_start: int = Field(2_000_000, ge=0)
    max_steps: int = Field(16, ge=4, le=1000, description="turns per episode, every agent")
    prompt: PromptFormat

    @model_validator(mode="after")
    def _check(self) -> "Config":
        babyai.check_level(self.level, "babyai.level")
        starts = sorted([(self.train_start, self.n_train), (self.test_start, self.n_test),
                         (self.ood_start, self.n_ood)])
        for (a, n), (b, _) in zip(starts, starts[1:]):
            if a + 100 * n >= b:      # draw_seeds may read up to seed a + 100 n
                raise ValueError(f"babyai: seed ranges from {a} and {b} may overlap; space "
                                 "train_start, test_start and ood_start further apart")
        return self


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    draws = {"train": babyai.draw_seeds(cfg.level, babyai.IN_DOMAIN, cfg.n_train,
                                        cfg.train_start),
             "test": babyai.draw_seeds(cfg.level, babyai.IN_DOMAIN, cfg.n_test, cfg.test_start),
             "ood": babyai.draw_seeds(cfg.level, babyai.OOD, cfg.n_ood, cfg.ood_start)}
    rows = [{"split": split, "episode": i, "level": cfg.level, "seed": seed, "mission": m,
             "target": m.split()[-1]}
            for split, got in draws.items() for i, (seed, m) in enumerate(got)]
    with io.atomic_path(ctx.path("ee_babyai"), is_dir=True) as tmp:
        io.write_parquet(tmp / "episodes.parquet", pl.DataFrame(
            rows, schema={k: getattr(pl, v) for k, v in babyai.EPISODE_SCHEMA.items()}))
        return demos_and_bounds(tmp, lambda split: babyai.read_episodes(tmp)[split],
                                babyai.expert_agent, Budget(max_steps=cfg.max_steps),
                                cfg.prompt)


def headline(details: dict[str, float]) -> dict[str, float]:
    return {"expert_test": details["expert/test/success"],
            "random_test": details["random/test/success"]}
