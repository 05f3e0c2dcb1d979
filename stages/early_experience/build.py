"""Stage `shop`: the catalogue, the goals of every split, the scripted expert's demonstrations
and the reference arms that bound the learned ones.

    <paths.ee_shop>/items.parquet     the catalogue (stages.early_experience.shop)
    <paths.ee_shop>/goals.parquet     split (train | test | ood | ood_combo), goal_id,
                                      constraints
    <paths.ee_shop>/expert/           the expert's rollouts on the train goals (checked parquet,
                                      stages.agents.trajectories): the demonstrations D_expert

The expert and a uniform-random agent also play the test and both OOD splits: expert success is
the ceiling a policy imitating it can reach, random the floor (spec section 4). Test goals equal
to a train goal are redrawn (in-domain means the same (colour, category) pairs, not the same
goals); the `held_out_pairs` appear in no train or test goal, only in `ood_combo`.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.agents.react import PromptFormat
from stages.agents.rollout import Budget, random_agent, run_episodes
from stages.agents.trajectories import summarise, to_frames, write_rollouts
from stages.core import io
from stages.early_experience import shop


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    catalogue_seed: int = Field(0, ge=0)
    per_pair: int = Field(4, ge=2, le=50, description="items per (category, colour)")
    max_results: int = Field(4, ge=2, le=20, description="items a results page lists")
    n_train: int = Field(ge=1, le=100_000, description="demonstration goals (spec: 300)")
    n_test: int = Field(ge=2, le=100_000, description="in-domain test goals (spec: 500)")
    n_ood: int = Field(ge=2, le=100_000, description="OOD test goals (unseen categories)")
    n_ood_combo: int = Field(ge=2, le=100_000, description="OOD test goals over the held-out "
                             "(colour, category) pairs (unseen combinations)")
    held_out_pairs: list[str] = Field(default_factory=lambda: list(shop.HELD_OUT), min_length=1,
                                      description="'colour category' pairs no train or test "
                                      "goal has [ours]")
    max_steps: int = Field(8, ge=4, le=100, description="turns per episode, every agent")
    prompt: PromptFormat

    @field_validator("held_out_pairs")
    @classmethod
    def _pairs(cls, v: list[str]) -> list[str]:
        shop.parse_pairs(v)             # named errors, before anything is drawn
        return v


def draw_goals(cfg: Config, catalogue: list[shop.Item]) -> dict[str, list[shop.Goal]]:
    held_out = shop.parse_pairs(cfg.held_out_pairs)
    seen_pairs = shop.in_domain_pairs(held_out)
    train = shop.make_goals(catalogue, shop.IN_DOMAIN, cfg.n_train, 1, cfg.max_results,
                            pairs=seen_pairs)
    seen = set(train)
    pool = shop.make_goals(catalogue, shop.IN_DOMAIN, 4 * cfg.n_test, 2, cfg.max_results,
                           pairs=seen_pairs)
    test = [g for g in pool if g not in seen][:cfg.n_test]
    if len(test) < cfg.n_test:
        raise ValueError(f"shop: only {len(test)} test goals differ from the train goals "
                         f"(n_test = {cfg.n_test}): raise per_pair")
    ood = shop.make_goals(catalogue, shop.OOD, cfg.n_ood, 3, cfg.max_results)
    combo = shop.make_goals(catalogue, shop.IN_DOMAIN, cfg.n_ood_combo, 4, cfg.max_results,
                            pairs=held_out)
    return {"train": train, "test": test, "ood": ood, "ood_combo": combo}


def demos_and_bounds(folder: Any, envs: Callable[[str], list[Any]], expert: Callable[[], Any],
                     budget: Budget, prompt: PromptFormat,
                     splits: tuple[str, ...] = ("test", "ood")) -> dict[str, float]:
    """The expert's rollouts on the train goals (written to `folder/expert`, D_expert) and the
    expert (ceiling) and a uniform-random agent (floor) on the evaluation `splits`;
    `envs(split)` gives fresh environments of a split, `expert()` a fresh expert agent. Shared
    by the mini-WebShop's `shop` stage and BabyAI's `babyai` stage."""
    train = envs("train")
    eps = run_episodes(train, expert(), budget, prompt,
                       episode_ids=[f"train/{i}" for i in range(len(train))])
    episodes, steps = to_frames(eps, "expert")
    write_rollouts(folder / "expert", episodes, steps)
    out = {"demos": float(episodes.height), "demo_turns": float(steps.height),
           "demo_success": summarise(episodes)["success_rate"]}
    for split in splits:
        for name, agent in (("expert", expert()), ("random", random_agent(0))):
            fresh = envs(split)
            eps = run_episodes(fresh, agent, budget, prompt,
                               episode_ids=[f"{split}/{i}" for i in range(len(fresh))])
            out[f"{name}/{split}/success"] = sum(e.success for e in eps) / len(eps)
    return out


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    catalogue = shop.make_catalogue(cfg.catalogue_seed, cfg.per_pair)
    goals = draw_goals(cfg, catalogue)
    out: dict[str, float] = {"items": float(len(catalogue))}
    with io.atomic_path(ctx.path("ee_shop"), is_dir=True) as tmp:
        shop.write_shop(tmp, catalogue, goals)
        out.update(demos_and_bounds(
            tmp, lambda split: shop.envs_for(catalogue, goals[split], split, cfg.max_results),
            shop.expert_agent, Budget(max_steps=cfg.max_steps), cfg.prompt, shop.EVAL_SPLITS))
    return out


def headline(details: dict[str, float]) -> dict[str, float]:
    return {"expert_test": details["expert/test/success"],
            "random_test": details["random/test/success"]}
