"""Early Experience (stages/early_experience): the mini-WebShop's pages and refusals, the
expert, one-step branching, the templated reflections and the IWM / SR / DPO examples on
hand-written values, the DPO loss, equal update counts and the compare rule (seconds, no
model)."""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

import pytest

from stages.agents.protocol import InvalidAction, parse_call
from stages.agents.react import PromptFormat
from stages.agents.rollout import Budget, random_agent, run_episodes
from stages.early_experience import shop
from stages.early_experience.experience import (alternatives, dpo_pairs, explore_state,
                                                iwm_examples, reflection, sr_examples,
                                                step_copy)
from stages.early_experience.train import Config as TrainConfig, dpo_loss, settings, \
    split_updates

FMT = PromptFormat(sep=" | ", window=0)
CAT = [shop.Item(0, "bag", "grey", 40, ("S",)), shop.Item(1, "bag", "grey", 35, ("M", "L")),
       shop.Item(2, "bag", "grey", 60, ("S",)), shop.Item(3, "bag", "grey", 40, ("S", "XL")),
       shop.Item(4, "hat", "red", 10, ("M",)), shop.Item(5, "scarf", "red", 5, ("L",))]
GOAL = shop.Goal("bag", "grey", "S", 40)


def _do(env: shop.ShopEnv, call: str):
    return env.step(parse_call(call, env.tools))


def test_pages_expert_and_success():
    env = shop.ShopEnv(CAT, GOAL, max_results=3)
    task, obs = env.reset()
    assert (task, obs) == ("grey bag, size S, max $40", "search page")
    assert shop.expert_action(env) == "search[grey bag]"
    assert _do(env, "search[grey bag]").observation == \
        "grey bag: 1 $40 S; 2 $35 M/L; 3 $60 S"                 # max_results = 3
    assert shop.expert_action(env) == "click[1]"                  # the first that fits
    assert _do(env, "click[2]").observation == "item grey bag $35 M/L, size -"
    assert shop.expert_action(env) == "back"                      # no S: the expert leaves
    _do(env, "back")
    _do(env, "click[1]")
    assert shop.expert_action(env) == "select[S]"
    _do(env, "select[S]")
    assert shop.expert_action(env) == "buy"
    r = _do(env, "buy")
    assert r.done and r.reward == 1.0 and env.success()


@pytest.mark.parametrize("calls, reason", [
    ([], "click[1]"), (["search[grey bag]"], "click[9]"),
    (["search[grey bag]", "click[1]"], "select[XL]"), ([], "buy"), ([], "back"),
    (["search[grey bag]"], "search[red hat]")])
def test_refused_calls_are_named_and_leave_the_state(calls, reason):
    env = shop.ShopEnv(CAT, GOAL)
    env.reset()
    for c in calls:
        _do(env, c)
    before = (env.page, env.item, env.size, env.observe())
    with pytest.raises(InvalidAction) as err:
        _do(env, reason)
    assert err.value.reason in ("wrong_page", "not_listed", "no_such_size")
    assert (env.page, env.item, env.size, env.observe()) == before


def test_wrong_purchase_fails_and_search_needs_colour_and_category():
    env = shop.ShopEnv(CAT, GOAL)
    env.reset()
    assert _do(env, "search[bag]").observation == "no results for bag"
    _do(env, "back")
    _do(env, "search[grey bag]")
    _do(env, "click[1]")
    assert _do(env, "buy").reward == 0.0 and not env.success()     # no size selected


def test_expert_ceiling_random_floor_and_ood_split():
    cat = shop.make_catalogue(0, 4)
    goals = shop.make_goals(cat, shop.IN_DOMAIN, 40, 1, 4)
    ood = shop.make_goals(cat, shop.OOD, 20, 3, 4)
    assert {g.category for g in ood} <= set(shop.OOD)
    assert not {g.category for g in goals} & set(shop.OOD)
    for g in goals:                    # a distractor on the page the expert's search lists
        assert not all(g.fits(it) for it in shop.search(cat, f"{g.color} {g.category}", 4))
    envs = shop.envs_for(cat, goals, "train", 4)
    eps = run_episodes(envs, shop.expert_agent(), Budget(max_steps=8), FMT)
    assert all(e.success for e in eps) and all(len(e.steps) == 4 for e in eps)
    eps = run_episodes(shop.envs_for(cat, goals, "test", 4), random_agent(0),
                       Budget(max_steps=8), FMT)
    assert sum(e.success for e in eps) <= 2
    # no OOD category word reaches in-domain training through an alternative search
    assert not any(c in a for a in envs[0].legal_actions() for c in shop.OOD)
    assert any("scarf" in a for a in shop.envs_for(cat, ood, "ood", 4)[0].legal_actions())


def test_held_out_pairs_split_unseen_combinations_of_seen_words():
    from stages.agents.react import PromptFormat as PF
    from stages.early_experience import build

    cfg = build.Config(n_train=120, n_test=30, n_ood=10, n_ood_combo=30, prompt=PF())
    goals = build.draw_goals(cfg, shop.make_catalogue(0, 4))
    held = set(shop.parse_pairs(shop.HELD_OUT))
    pairs = {s: {(g.color, g.category) for g in gs} for s, gs in goals.items()}
    assert pairs["ood_combo"] == held                  # 30 goals cover all six pairs
    assert not (pairs["train"] | pairs["test"]) & held
    # every word of a held-out pair is in the train goals, with another partner
    words = {w for c, k in pairs["train"] for w in (c, k)}
    assert {w for c, k in held for w in (c, k)} <= words
    # the held-out searches stay legal on a train state (early experience may try them)
    env = shop.envs_for(shop.make_catalogue(0, 4), goals["train"][:1], "train", 4)[0]
    assert "search[red shirt]" in env.legal_actions()
    assert len(shop.in_domain_pairs(list(held))) == 36 - 6
    for bad, word in ((["red shirt", "red shirt"], "repeat"), (["pink hat"], "pink hat"),
                      (["red scarf"], "in-domain"),
                      ([f"{c} mug" for c in shop.COLORS], "every colour of category 'mug'"),
                      ([f"red {k}" for k in shop.IN_DOMAIN], "every category of colour")):
        with pytest.raises(ValueError, match=word):
            shop.parse_pairs(bad)
    with pytest.raises(ValueError, match="held-out pair"):
        build.Config(n_train=2, n_test=2, n_ood=2, n_ood_combo=2, prompt=PF(),
                     held_out_pairs=["blue"])


def test_shop_round_trips_through_the_checked_reads(tmp_path: Path):
    cat = shop.make_catalogue(0, 2)
    goals = {"train": [GOAL], "test": [GOAL], "ood": [shop.Goal("scarf", "red", "L", 5)],
             "ood_combo": [shop.Goal("shirt", "red", "S", 20)]}
    shop.write_shop(tmp_path, cat, goals)
    assert shop.read_shop(tmp_path) == (cat, goals)
    from stages.early_experience.evaluate import Config as EvalConfig, check_splits

    ecfg = EvalConfig(prompt=FMT, policy={"kind": "local", "model": "ee_policies"})
    check_splits(ecfg, tmp_path)
    # a shop folder from before the `ood_combo` split: named, not a 0 / 0 after the rollouts
    shop.write_shop(tmp_path, cat, {**goals, "ood_combo": []})
    with pytest.raises(ValueError, match="no `ood_combo` goals"):
        check_splits(ecfg, tmp_path)


def test_one_step_branches_leave_the_expert_state_and_never_repeat_the_expert():
    env = shop.ShopEnv(CAT, GOAL, max_results=3)
    env.reset()
    _do(env, "search[grey bag]")
    snap = env.observe()
    b = step_copy(env, "click[3]")
    assert b.observation == "item grey bag $60 S, size -" and env.observe() == snap
    rng = random.Random(0)
    for k in (1, 2, 3, 9):
        alts = alternatives(env, "click[1]", k, rng)
        assert "click[1]" not in alts and len(alts) == min(k, 3) == len(set(alts))
    # (3 other legal calls: click[2], click[3], back)
    rows = explore_state(env, "click[1]", 3, random.Random(1))
    assert [r["j"] for r in rows] == [0, 1, 2, 3] and rows[0]["reflection"] == ""
    assert sorted(r["call"] for r in rows[1:]) == ["back", "click[2]", "click[3]"]
    assert copy.deepcopy(env).catalogue is env.catalogue      # shared, not copied


def test_templated_reflections_from_outcome_differences():
    env = shop.ShopEnv(CAT, GOAL)
    env.reset()
    good = step_copy(env, "search[grey bag]")
    assert reflection(env, good, step_copy(env, "search[red hat]")) == \
        "that lists red hat; need grey bag"
    _do(env, "search[grey bag]")
    good = step_copy(env, "click[1]")
    assert reflection(env, good, step_copy(env, "click[3]")) == "3 is $60 > $40; 1 is $40 with S"
    assert reflection(env, good, step_copy(env, "click[2]")) == "2 has no S; 1 is $40 with S"
    _do(env, "click[1]")
    good = step_copy(env, "select[S]")
    assert reflection(env, good, step_copy(env, "buy")) == "no size yet; need S"


def test_iwm_sr_and_dpo_examples():
    rows = [{"prompt": "Task: t | Observation: o | ", "expert_call": "click[1]", "j": j,
             "call": c, "next": n, "reflection": r}
            for j, c, n, r in ((0, "click[1]", "item A", ""), (1, "back", "search page", "R1"),
                               (2, "click[2]", "item B", "R2"))]
    p, t = iwm_examples(rows, FMT, k=1)
    assert p == ["Task: t | Observation: o | Action: click[1] | ",
                 "Task: t | Observation: o | Action: back | "]
    assert t == ["Observation: item A", "Observation: search page"]
    p, t = sr_examples(rows, FMT, k=2)
    assert p == [rows[0]["prompt"]] * 2
    assert t == ["Thought: R1 | Action: click[1]", "Thought: R2 | Action: click[1]"]
    p, c, r = dpo_pairs(rows, FMT, k=2)
    assert c == ["Action: click[1]"] * 2 and r == ["Action: back", "Action: click[2]"]


def test_dpo_loss_and_equal_update_counts():
    import torch

    z = torch.zeros(2)
    assert float(dpo_loss(z, z, z, z, 0.1)) == pytest.approx(math.log(2))
    # margin (2 - 0) - (0 - 0) = 2, beta 0.5: -log sigmoid(1)
    one = dpo_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([0.0]),
                   torch.tensor([0.0]), 0.5)
    assert float(one) == pytest.approx(-math.log(1 / (1 + math.exp(-1))))
    for steps in (2, 3, 300, 301):
        for share in (0.01, 0.5, 0.99):
            a, b = split_updates(steps, share)
            assert a + b == steps and a >= 1 and b >= 1


def test_settings_and_bad_params_rejected_by_name():
    cfg = TrainConfig(arms=["il", "iwm", "sr"], seeds=[0, 1], steps=10, prompt=FMT,
                      fractions=[0.25], k_sweep=[1, 4])
    names = [s[0] for s in settings(cfg)]
    assert names == ["il", "iwm", "sr", "il@f0.25", "iwm@f0.25", "sr@f0.25", "iwm@k1", "sr@k1"]
    cfg = cfg.model_copy(update={"sweep_arms": ["il", "iwm"]})     # the curve of two arms
    assert [s[0] for s in settings(cfg)] == ["il", "iwm", "sr", "il@f0.25", "iwm@f0.25",
                                             "iwm@k1"]
    assert settings(cfg)[3:] == [("il@f0.25", "il", 0.25, 4), ("iwm@f0.25", "iwm", 0.25, 4),
                                 ("iwm@k1", "iwm", 1.0, 1)]
    for bad, word in (({"arms": ["iwm"]}, "il"), ({"arms": ["il", "wm"]}, "wm"),
                      ({"fractions": [1.0]}, "fractions"), ({"seeds": [0, 0]}, "repeated"),
                      ({"sweep_arms": ["il", "sr"]}, r"\['sr'\] not in train.arms"),
                      ({"sweep_arms": []}, "sweep_arms"),
                      ({"fractions": [0.25, 0.5, 0.25]}, "train.fractions .* repeated"),
                      ({"fractions": [0.5, 0.5000001]}, "repeated fraction"),
                      ({"k_sweep": [1, 2, 1]}, "train.k_sweep .*: repeated K"),
                      ({"k_sweep": [0, 2]}, r"\[0\] not in \[1, 64\]"),
                      ({"k_sweep": [2, 65]}, r"\[65\] not in \[1, 64\]"),
                      ({"arms": ["il", "iwm"], "fractions": [0.5], "sweep_arms": ["iwm"]},
                       "`il` must be swept too")):
        with pytest.raises(ValueError, match=word):
            TrainConfig(**{"arms": ["il"], "seeds": [0, 1], "steps": 10, "prompt": FMT, **bad})


def test_compare_claims_on_paired_seeds():
    from stages.early_experience import compare

    class Ctx:
        def stage_metrics(self, stage):
            if stage == "shop":
                return {"random/test/success": 0.0}
            m = {}
            for s, (il, iwm) in enumerate(((0.2, 0.4), (0.25, 0.45), (0.3, 0.52))):
                for split in ("test", "ood"):
                    m[f"il/s{s}/success_{split}"] = il
                    m[f"iwm/s{s}/success_{split}"] = iwm
                # unseen combinations: IWM below IL in every seed (-0.1, -0.12, -0.08)
                m[f"il/s{s}/success_ood_combo"] = 0.5
                m[f"iwm/s{s}/success_ood_combo"] = (0.4, 0.38, 0.42)[s]
            return m

    out = compare.run(compare.Config(), Ctx())
    # per-seed differences 0.2, 0.2, 0.22
    assert out["claim/iwm_vs_il/diff"] == pytest.approx(0.62 / 3)
    assert out["claim/iwm_vs_il/verdict"] == 1.0 and out["claim/iwm_vs_il/pairs"] == 3
    assert out["claim/iwm_vs_il_ood_combo/diff"] == pytest.approx(-0.1)
    assert out["claim/iwm_vs_il_ood_combo/verdict"] == -1.0
    assert "claim/sr_vs_il/verdict" not in out          # an arm not run: no claim
    assert out["claim/il_vs_random/verdict"] == 1.0
    assert compare.headline(out) == {"reproduced": 3.0, "inconclusive": 0.0,
                                     "contradicted": 1.0}


def test_compare_data_efficiency_and_k_claims_and_their_words():
    """The sweep settings' claims pair the right settings, and the README names them right."""
    from stages.early_experience import compare

    m = {}
    for s in range(3):
        m.update({f"il/s{s}/success_test": 0.5, f"iwm/s{s}/success_test": 0.6,
                  f"il@f0.125/s{s}/success_test": 0.1, f"iwm@f0.125/s{s}/success_test":
                  (0.3, 0.32, 0.28)[s], f"il@f0.5/s{s}/success_test": 0.4,
                  f"iwm@f0.5/s{s}/success_test": 0.5, f"iwm@k1/s{s}/success_test":
                  (0.55, 0.5, 0.45)[s], f"iwm@k2/s{s}/success_test": 0.58})
    out = compare.world_claims(m, {"random/test/success": 0.0}, "babyai_evaluate",
                               paper_effects=False, main_k=4)
    # 1/8 of the demonstrations vs IL on all: 0.3 - 0.5, 0.32 - 0.5, 0.28 - 0.5
    assert out["claim/iwm_f0.125_vs_il/diff"] == pytest.approx(-0.2)
    assert out["claim/iwm_f0.125_vs_il/verdict"] == -1.0
    assert out["claim/iwm_vs_il_f0.125/diff"] == pytest.approx(0.2)    # both on 1/8
    assert out["claim/iwm_vs_iwm_k1/diff"] == pytest.approx(0.1)       # K = main vs the least
    assert "claim/sr_f0.125_vs_il/verdict" not in out                 # sr not swept
    assert "claim/iwm_vs_iwm_k2/verdict" not in out
    # no main K known, or none swept below it: no K claim (a larger K is not "fewer")
    for k in (None, 1):
        assert not any("_k" in key for key in compare.world_claims(
            m, {"random/test/success": 0.0}, "e", paper_effects=False, main_k=k))
    assert compare.claim_label("iwm_f0.125_vs_il", 4) == \
        "IWM on 0.125 of the demonstrations > IL on all"
    assert compare.claim_label("iwm_vs_il_f0.125", 4) == \
        "[ours] IWM > IL, both on 0.125 of the demonstrations"
    assert compare.claim_label("iwm_vs_iwm_k1", 4) == "IWM at K = 4 > at K = 1"
    assert compare.claim_label("sr_vs_il", 4) == "SR > IL, in-domain"


def test_readme_tables_put_each_worlds_sweep_and_claims_under_it():
    """Two worlds, only BabyAI swept: the shop's section has no sweep table or sweep claim;
    BabyAI's has rows for the swept arms only, K columns 1, 2 and the main 4, its own claims."""
    from stages.early_experience import compare

    def evaluate(sweep: bool) -> dict[str, float]:
        m: dict[str, float] = {}
        for s in range(3):
            for arm, v in (("il", 0.5), ("iwm", 0.6), ("sr", 0.4), ("dpo", 0.3)):
                for split in ("test", "ood"):
                    m[f"{arm}/s{s}/success_{split}"] = v + 0.01 * s
            if sweep:
                for name, v in (("il@f0.25", 0.2), ("iwm@f0.25", 0.3), ("iwm@k1", 0.45),
                                ("iwm@k2", 0.5)):
                    m[f"{name}/s{s}/success_test"] = v + 0.02 * s
        for key in list(m):                  # the means `evaluate` writes beside the seeds
            setting, seed, metric = key.split("/")
            m[f"{setting}/{metric}"] = sum(m[f"{setting}/s{s}/{metric}"] for s in range(3)) / 3
        return m

    stages = {"evaluate": evaluate(False), "babyai_evaluate": evaluate(True),
              "shop": {"random/test/success": 0.0, "expert/test/success": 1.0},
              "babyai": {"random/test/success": 0.0, "expert/test/success": 1.0},
              "train": {"il/k": 4.0}, "babyai_train": {"il/k": 4.0}}

    class Ctx:
        def stage_metrics(self, stage):
            return stages[stage]

    metrics = {**stages, "compare": compare.run(compare.Config(worlds=["shop", "babyai"]),
                                                Ctx())}
    shop_part, babyai_part = compare.results_table(metrics).split("### BabyAI")
    assert "Data efficiency" not in shop_part and "K alternatives" not in shop_part
    assert "of the demonstrations" not in shop_part and "K = " not in shop_part
    assert "| IL (imitation) | 0.220 ± 0.016 | 0.510 ± 0.008 |" in babyai_part
    assert "| IWM -> IL | 0.320 ± 0.016 | 0.610 ± 0.008 |" in babyai_part
    assert "| SR + IL (templated) | 0.4" not in babyai_part.split("**Data efficiency**")[1]
    assert "| K=1 | K=2 | K=4 |" in babyai_part
    assert "| IWM -> IL | 0.470 ± 0.016 | 0.520 ± 0.016 | 0.610 ± 0.008 |" in babyai_part
    for words in ("IWM on 0.25 of the demonstrations > IL on all: **contradicted**",
                  "[ours] IWM > IL, both on 0.25 of the demonstrations: **reproduced**",
                  "IWM at K = 4 > at K = 1: **reproduced**"):
        assert words in babyai_part
