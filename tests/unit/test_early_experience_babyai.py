"""BabyAI behind the text wrapper (stages/early_experience/babyai.py): the view's description
on hand-made views, the bot as the expert, splits by the mission's target, one-step branches,
templated reflections and the BabyAI claims of `compare`."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from stages.agents.protocol import parse_call
from stages.agents.react import PromptFormat
from stages.agents.rollout import Budget, random_agent, run_episodes
from stages.early_experience import babyai
from stages.early_experience.experience import explore_state, step_copy

pytest.importorskip("minigrid")

# minigrid's encoding: object 1 empty, 2 wall, 5 key, 6 ball, 7 box; colour 0 red, 1 green,
# 5 grey
EMPTY, WALL, KEY, BALL, BOX = 1, 2, 5, 6, 7
RED, GREEN, GREY = 0, 1, 5


def view(cells: dict[tuple[int, int], tuple[int, int]]) -> np.ndarray:
    """A 7x7 egocentric view, all empty but `cells` {(x, y): (object, colour)}."""
    img = np.zeros((7, 7, 3), dtype=np.uint8)
    img[..., 0] = EMPTY
    for (x, y), (obj, col) in cells.items():
        img[x, y] = (obj, col, 0)
    return img


def test_describe_hand_made_views():
    # agent at (3, 6) facing up: (4, 4) is 2 ahead 1 right; (2, 5) 1 ahead 1 left; (5, 6) 0
    # ahead 2 right; nearest first (cells walked, then ahead)
    img = view({(4, 4): (BALL, RED), (2, 5): (KEY, GREY), (5, 6): (BOX, GREEN),
                (3, 1): (WALL, GREY)})
    assert babyai.describe(img) == ("green box 0 ahead 2 right; grey key 1 ahead 1 left; "
                                    "red ball 2 ahead 1 right; wall 5 ahead")
    # a ball straight ahead hides the wall behind it from the "ahead" note
    assert babyai.describe(view({(3, 5): (BALL, RED), (3, 2): (WALL, GREY)})) == \
        "red ball 1 ahead"
    assert babyai.describe(view({})) == "nothing in view"
    assert babyai.target_offset(img, "grey", "key") == (1, -1)
    assert babyai.target_offset(img, None, "ball") == (2, 1)
    assert babyai.target_offset(img, "red", "key") is None


def test_describe_agrees_with_a_real_minigrid_view():
    """The view convention checked on minigrid itself, not on views built by hand: a ball
    planted two cells ahead and one to the right of the agent, in the agent's own frame."""
    from minigrid.core.world_object import Ball

    env = babyai.make_level(babyai.LEVEL, 5)
    env.grid.set(*(env.agent_pos + 2 * env.dir_vec + env.right_vec), Ball("red"))
    assert "red ball 2 ahead 1 right" in babyai.describe(env.gen_obs()["image"])
    env.grid.set(*(env.agent_pos + env.dir_vec - env.right_vec), Ball("green"))
    assert "green ball 1 ahead 1 left" in babyai.describe(env.gen_obs()["image"])


def test_where_the_target_is_after_a_branch():
    assert babyai.where(None, "ball") == "ball out of view"
    assert babyai.where((1, 0), "ball") == "ball in reach"
    assert babyai.where((2, -1), "box") == "box 2 ahead 1 left"
    assert babyai.where((3, 0), "key") == "key 3 ahead"


@pytest.fixture(scope="module")
def seeds() -> dict[str, list[tuple[int, str]]]:
    return {"train": babyai.draw_seeds(babyai.LEVEL, babyai.IN_DOMAIN, 12, 0),
            "ood": babyai.draw_seeds(babyai.LEVEL, babyai.OOD, 6, 2_000_000)}


def test_splits_by_target_and_the_bot_is_the_ceiling(seeds):
    assert all(m.split()[-1] in babyai.IN_DOMAIN for _, m in seeds["train"])
    assert all(m.split()[-1] == "key" for _, m in seeds["ood"])
    fmt = PromptFormat(sep=" | ", window=0)
    for split, got in seeds.items():
        envs = [babyai.BabyAIEnv(babyai.LEVEL, s) for s, _ in got]
        eps = run_episodes(envs, babyai.expert_agent(), Budget(max_steps=30), fmt)
        assert all(e.success for e in eps), split
        assert all(e.task.startswith("go to ") for e in eps)
        # the prompt the policy reads: the mission and one line of view, never the grid
        first = eps[0].steps[0].prompt
        assert first.startswith(f"Task: {eps[0].task} | Observation: ") and "[" not in first
    envs = [babyai.BabyAIEnv(babyai.LEVEL, s) for s, _ in seeds["train"]]
    rand = run_episodes(envs, random_agent(0), Budget(max_steps=16), fmt)
    assert sum(e.success for e in rand) < len(rand)          # the floor is below the ceiling


def test_same_seed_same_episode_and_branches_leave_the_state(seeds):
    seed = seeds["train"][0][0]
    a, b = babyai.BabyAIEnv(babyai.LEVEL, seed), babyai.BabyAIEnv(babyai.LEVEL, seed)
    assert a.reset() == b.reset()
    snap = a.observe()
    expert = babyai.expert_action(a)
    alt = "left" if expert != "left" else "right"
    step_copy(a, alt)
    assert a.observe() == snap
    # the bot of the original still plans from the original state: its action is replayable
    res = a.step(parse_call(expert, a.tools))
    b.step(parse_call(babyai.expert_action(b), b.tools))
    assert res.observation == b.observe()
    rows = explore_state(a, babyai.expert_action(a), 4, random.Random(0), babyai.reflection)
    assert [r["j"] for r in rows] == [0, 1, 2, 3, 4]
    assert len({r["call"] for r in rows}) == 5 and rows[0]["reflection"] == ""
    assert all(r["reflection"] for r in rows[1:])
    twin = copy.deepcopy(a)          # a copy's bot plays what the original's would
    assert babyai.expert_action(twin) == babyai.expert_action(a)


def test_templated_reflection_reads_the_two_outcomes():
    class E:   # a branch's env: where the target is and whether it won
        def __init__(self, off, won=False):
            self.off, self.won = off, won

        def target_offset(self):
            return self.off

        def success(self):
            return self.won

    class Root:
        def mission_target(self):
            return "red", "ball"

    class B:
        def __init__(self, call, env):
            self.call, self.env = call, env

    forward = B("forward", E((1, 0)))
    assert babyai.reflection(Root(), forward, B("left", E(None))) == \
        "left: ball out of view; forward: ball in reach"
    assert babyai.reflection(Root(), forward, B("right", E((1, 0), won=True))) == \
        "right also reaches the ball"
    assert babyai.reflection(Root(), B("right", E((2, 1))), B("pickup", E((2, 1)))) == \
        "pickup: ball 2 ahead 1 right, no closer; right: on the way"


def test_episodes_round_trip_and_bad_level_rejected(tmp_path: Path, seeds):
    from stages.core.checks import DataValidationError
    from stages.early_experience.build_babyai import Config

    rows = [{"split": "train", "episode": i, "level": babyai.LEVEL, "seed": s, "mission": m,
             "target": m.split()[-1]} for i, (s, m) in enumerate(seeds["train"])]
    schema = {k: getattr(pl, v) for k, v in babyai.EPISODE_SCHEMA.items()}
    pl.DataFrame(rows, schema=schema).write_parquet(tmp_path / "episodes.parquet")
    envs = babyai.read_episodes(tmp_path)
    assert [e.seed for e in envs["train"]] == [s for s, _ in seeds["train"]]
    from stages.early_experience.evaluate import Config as EvalConfig, check_splits

    ecfg = EvalConfig(prompt={"sep": " | ", "window": 0}, world="babyai", source="ee_babyai",
                      policy={"kind": "local", "model": "ee_babyai_policies"})
    with pytest.raises(ValueError, match="no `test` missions"):   # a table of train only
        check_splits(ecfg, tmp_path)
    rows[0]["target"] = "lamp"
    pl.DataFrame(rows, schema=schema).write_parquet(tmp_path / "episodes.parquet")
    with pytest.raises(DataValidationError, match="target"):
        babyai.read_episodes(tmp_path)
    rows[0]["target"] = rows[1]["target"] = "ball"
    rows[0]["mission"] = rows[1]["mission"] = "go to the red ball"
    rows[1]["level"] = "BabyAI-NoSuchLevel-v0"      # a tampered table: named before any play
    pl.DataFrame(rows, schema=schema).write_parquet(tmp_path / "episodes.parquet")
    with pytest.raises(ValueError, match="episodes.parquet: level 'BabyAI-NoSuchLevel-v0' is "
                                         "not a registered BabyAI GoTo level"):
        babyai.read_episodes(tmp_path)
    fmt = {"sep": " | ", "window": 0}
    for level in ("BabyAI-NoSuchLevel-v0", "BabyAI-OpenDoor-v0"):   # unknown; not a GoTo
        with pytest.raises(ValueError, match="not a registered BabyAI GoTo level"):
            Config(level=level, n_train=2, n_test=2, n_ood=2, prompt=fmt)
    with pytest.raises(ValueError, match="overlap"):
        Config(n_train=2000, n_test=2, n_ood=2, test_start=1000, prompt=fmt)


def test_compare_names_babyai_claims_without_the_papers_webshop_effects():
    from stages.early_experience import compare

    def arms(il, iwm):
        m = {}
        for s, (a, b) in enumerate(zip(il, iwm)):
            for split in ("test", "ood"):
                m[f"il/s{s}/success_{split}"] = a
                m[f"iwm/s{s}/success_{split}"] = b
        for split in ("test", "ood"):      # the means `evaluate` writes beside the seeds
            m[f"il/success_{split}"] = sum(il) / len(il)
            m[f"iwm/success_{split}"] = sum(iwm) / len(iwm)
        return m

    class Ctx:
        def stage_metrics(self, stage):
            return {"shop": {"random/test/success": 0.0}, "babyai": {"random/test/success": 0.1},
                    "evaluate": arms((0.2, 0.25, 0.3), (0.4, 0.45, 0.52)),
                    "babyai_evaluate": arms((0.6, 0.7, 0.65), (0.5, 0.58, 0.56)),
                    "train": {"il/k": 4.0}, "babyai_train": {"il/k": 4.0}}[stage]

    out = compare.run(compare.Config(worlds=["shop", "babyai"]), Ctx())
    assert out["claim/iwm_vs_il/verdict"] == 1.0 and out["claim/iwm_vs_il/paper_effect"] == 0.113
    # BabyAI: each seed 0.10, 0.12, 0.09 below IL -> contradicted; no paper number beside it
    assert out["claim/babyai_iwm_vs_il/diff"] == pytest.approx(-0.31 / 3)
    assert out["claim/babyai_iwm_vs_il/verdict"] == -1.0
    assert "claim/babyai_iwm_vs_il/paper_effect" not in out
    assert out["seeds"] == 3 and out["babyai_seeds"] == 3
    # the floor each world's IL is compared with is its own (0.1 for BabyAI)
    assert out["claim/babyai_il_vs_random/diff"] == pytest.approx(0.55)
    # the DVC headline counts the claims of both worlds (shop: IWM > IL in-domain and OOD,
    # IL > random; BabyAI: IWM < IL twice, IL > random); the README splits them
    assert compare.headline(out) == {"reproduced": 4.0, "inconclusive": 0.0,
                                     "contradicted": 2.0}
    # the README block: one table per world, each with its own arms, floor and claims
    table = compare.results_table({
        "compare": out, "shop": {"expert/test/success": 1.0, "random/test/success": 0.0},
        "babyai": {"expert/test/success": 1.0, "random/test/success": 0.1},
        "evaluate": Ctx().stage_metrics("evaluate"),
        "babyai_evaluate": Ctx().stage_metrics("babyai_evaluate")})
    shop_part, baby = table.split("### BabyAI")
    assert "| IL (imitation) | 0.250 ± 0.041 |" in shop_part       # population std
    assert "| IL (imitation) | 0.650 ± 0.041 |" in baby and "| BabyAI" in baby
    assert "| random (the floor) | 0.100 |" in baby
    assert "contradicted" in baby.split("IWM > IL, in-domain")[1].split("\n")[0]
    assert "paper" not in baby.split("IWM > IL, in-domain")[1].split("\n")[0]
