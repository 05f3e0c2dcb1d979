"""BIS on hand-computed cases: the score on a small table of MC scores, per-source selection and
its ablation rules, the edge cases (no positive step, rho outside (0, 1], empty pool), MC labels
and their noise, the PRM's separator labelling and metrics; then a PRM trained on a tiny real
model (training really changes the backbone) and scored end to end."""

from __future__ import annotations

import math

import polars as pl
import pytest
import torch
from pydantic import ValidationError

from stages.bis import compare as bc
from stages.core import stats
from stages.models import base
from stages.models.mc_annotate import label_noise, mc_score, step_prefixes
from stages.models.tokenizer import build_tokenizer
from stages.bis import bis
from stages.tasks import arith
from stages.train import prm

torch.set_num_threads(1)

# Five rollouts (MC scores per step), two sources. By hand:
#   rollout        p_pos  p(1-p)  R      BIS = (p(1-p) + .05) R   mean s
#   A 1 .5 0 0     1/2    1/4     3/4    .30 * .75   = .225        .375
#   B .25 x4       1      0       1/4    .05 * .25   = .0125       .25
#   C 0 0          0      0       1 (*)  .05 * 1     = .05         0
#   D 1 1 0        2/3    2/9     1      (2/9 + .05) = .27222      2/3
#   E .125 0       1/2    1/4     1/8    .30 * .125  = .0375       .0625
# (*) no positive step: R = 1, an all-negative rollout is a noise-free negative (spec §6).
TABLE = [[1.0, 0.5, 0.0, 0.0], [0.25] * 4, [0.0, 0.0], [1.0, 1.0, 0.0], [0.125, 0.0]]
SOURCES = ["a", "a", "a", "b", "b"]


def test_bis_on_a_hand_computed_table():
    got = [bis.bis_score(s) for s in TABLE]
    assert got == pytest.approx([0.225, 0.0125, 0.05, 2 / 9 + 0.05, 0.0375])
    assert [bis.positive_share(s) for s in TABLE] == pytest.approx([0.5, 1, 0, 2 / 3, 0.5])
    assert [bis.reliability(s) for s in TABLE] == pytest.approx([0.75, 0.25, 1.0, 1.0, 0.125])
    assert [bis.mixture(s) for s in TABLE] == pytest.approx([0.25, 0, 0, 2 / 9, 0.25])
    assert bis.bis_score([0.0, 1.0], alpha=0.0) == pytest.approx(0.25)  # even mix, reliable
    assert bis.low_mc_score(TABLE[0]) == pytest.approx(-0.375)


def test_select_ranks_within_each_source():
    # rho = .5: source a keeps max(1, int(1.5)) = 1 of 3, source b keeps 1 of 2.
    assert bis.select("bis", TABLE, SOURCES, 0.5) == [0, 3]       # A (.225), D (.272)
    assert bis.select("mixed", TABLE, SOURCES, 0.5) == [0, 4]     # A (1/4), E (1/4 > 2/9)
    assert bis.select("reliable", TABLE, SOURCES, 0.5) == [2, 3]  # C (1.0), D (1.0)
    assert bis.select("low_mc", TABLE, SOURCES, 0.5) == [2, 4]    # lowest mean MC first
    assert bis.select("full", TABLE, SOURCES, 1.0) == [0, 1, 2, 3, 4]
    # a global ranking would keep D and A; per source the small source still gets its share
    assert bis.select("bis", TABLE, ["a"] * 5, 0.4) == [0, 3]
    # alpha large: the mixture term stops mattering, reliability decides
    assert bis.select("bis", TABLE, SOURCES, 0.5, alpha=10.0) == [2, 3]


def test_random_arm_is_stratified_seeded_and_varies_with_seed():
    sources = ["a"] * 20 + ["b"] * 10
    picks = {s: bis.select("random", [[0.5]] * 30, sources, 0.3, seed=s) for s in range(4)}
    for kept in picks.values():
        assert sum(i < 20 for i in kept) == 6 and sum(i >= 20 for i in kept) == 3
    assert picks[0] == bis.select("random", [[0.5]] * 30, sources, 0.3, seed=0)
    assert len({tuple(k) for k in picks.values()}) > 1


def test_keep_count_and_invalid_inputs():
    assert bis.keep_count(100, 0.1) == 10
    assert bis.keep_count(10, 0.05) == 1           # max(1, int(0.5))
    assert bis.keep_count(7, 0.25) == 1 and bis.keep_count(7, 1.0) == 7
    for rho in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="rho"):
            bis.keep_count(10, rho)
        with pytest.raises(ValueError, match="rho"):
            bis.select("full", TABLE, SOURCES, rho)
    with pytest.raises(ValueError, match="empty"):
        bis.select("bis", [], [], 0.5)
    with pytest.raises(ValueError, match="empty"):
        bis.select("random", [], [], 0.5)
    with pytest.raises(ValueError, match="at least one step"):
        bis.bis_score([])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        bis.bis_score([0.5, 1.5])
    with pytest.raises(ValueError, match="unknown selection rule"):
        bis.select("entropy", TABLE, SOURCES, 0.5)
    with pytest.raises(ValidationError):
        bis.Arm(name="x", rule="bis", rho=0.0)
    with pytest.raises(ValidationError, match="rule 'full' keeps every rollout"):
        bis.Arm(name="x", rule="full", rho=0.5)
    assert bis.Arm(name="x", rule="full").rho == 1.0


def test_a_full_arm_with_a_share_is_refused_not_silently_kept_whole():
    # rule full keeps every rollout: rho = 0.1 would be ignored, so it is an error naming rho,
    # in the arm's Config and in the selection function itself
    with pytest.raises(ValidationError, match=r"rule 'full' keeps every rollout, so rho must be "
                                              r"1 \(or unset\), not 0.1"):
        bis.Arm(name="full", rule="full", rho=0.1)
    with pytest.raises(ValueError, match=r"rho = 0.1 with rule 'full'.*rho must be 1"):
        bis.select("full", TABLE, SOURCES, 0.1)
    assert bis.Arm(name="full", rule="full", rho=1.0).rho == 1.0
    assert bis.select("full", TABLE, SOURCES, 1.0) == [0, 1, 2, 3, 4]


def test_config_refuses_repeated_arm_names():
    with pytest.raises(ValidationError, match="repeat"):
        bis.Config(arms=[{"name": "x", "rule": "full"}, {"name": "x", "rule": "bis"}])


def test_mc_scores_labels_and_their_noise():
    assert mc_score(0, 16) == 0.0 and mc_score(4, 16) == 0.25
    with pytest.raises(ValueError):
        mc_score(17, 16)
    # truth:  R R W W ; MC: R W R W  -> agreement 1/2, false pos 1/2 (of wrong), false neg 1/2
    noise = label_noise([True, False, True, False], [True, True, False, False])
    assert noise == pytest.approx({"label_agreement": 0.5, "label_false_pos_rate": 0.5,
                                   "label_false_neg_rate": 0.5, "true_wrong_share": 0.5})
    text = " 23+45=68; 68-17=51 #### 51"
    assert arith.step_ends(text) == [9, 19]
    prefixes = step_prefixes([{"prompt": "Q: 23+45-17=? A:", "completion": text,
                               "step_ends": arith.step_ends(text)}])
    assert prefixes == [["Q: 23+45-17=? A: 23+45=68", "Q: 23+45-17=? A: 23+45=68; 68-17=51"]]


def test_step_f1_threshold_and_best_of_n_by_hand():
    # pred at .5: R R W R against R R W W. Right: tp 2 fp 1 -> 4/5. Wrong: tp 1 fn 1 -> 2/3.
    got = prm.step_f1([0.9, 0.8, 0.2, 0.6], [True, True, False, False], 0.5)
    assert got == pytest.approx({"f1": (0.8 + 2 / 3) / 2, "f1_right": 0.8, "f1_wrong": 2 / 3})
    # every threshold in (.6, .8] separates the classes; the lowest grid point wins
    assert prm.best_threshold([0.9, 0.8, 0.2, 0.6], [True, True, False, False]) == 0.61
    assert prm.solution_score([0.9, 0.3, 0.6], "min") == 0.3
    assert prm.solution_score([0.9, 0.3, 0.6], "prod") == pytest.approx(0.162)
    assert prm.solution_score([0.9, 0.3, 0.6], "last") == 0.6
    groups = {"p1": [(0.2, False), (0.9, True)], "p2": [(0.5, False), (0.5, True)]}
    assert prm.best_of_n(groups) == 0.5  # p2: a tie goes to the first solution
    with pytest.raises(ValueError):
        prm.step_f1([], [], 0.5)
    rows = [{"problem_id": p} for p in ["d", "b", "a", "c", "a"]]
    val, test = prm.benchmark_split(rows, 0.5)
    assert {r["problem_id"] for r in val} == {"a", "b"} and len(test) == 2


# --- a tiny real model: separator labels, training, scoring ----------------------------------------

@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    """A tiny untrained Llama causal LM folder with the arith tokenizer (`;` is one token)."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-*=;#?:QA "))
    cfg = base.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_positions=64)
    model = base.build_model(cfg, tokenizer)
    folder = tmp_path_factory.mktemp("backbone")
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def _rollouts(n: int, seed: int) -> list[dict]:
    """Solutions with a planted wrong step: step 2 of every odd rollout is off by one."""
    problems = arith.generate(arith.Config(min_operands=3, max_operands=3, max_value=9), n,
                              seed, split="unit")
    rows = []
    for i, p in enumerate(problems):
        steps = arith.parse_steps(p["target"])
        correct = [True] * len(steps)
        if i % 2:
            lhs, value = steps[1].rsplit("=", 1)
            steps[1] = f"{lhs}={int(value) + 1}"
            correct[1] = False
        rows.append({"rollout_id": f"r{i}", "problem_id": p["id"], "prompt": p["prompt"],
                     "steps": steps, "step_correct": correct, "mc_labels": correct,
                     "answer_correct": all(correct)})
    return rows


def test_prm_labels_sit_on_the_separators(backbone):
    model, tok = prm.load_prm(backbone, new_head=True)
    sep = prm.separator_id(tok, ";")
    enc = prm.encode_prm(tok, "Q: 1+2+3=? A:", ["1+2=3", "3+3=7"], [True, False], sep)
    assert len(enc["input_ids"]) == len(enc["labels"])
    assert [enc["input_ids"][i] for i in enc["step_pos"]] == [sep, sep]
    assert [enc["labels"][i] for i in enc["step_pos"]] == [1, 0]
    assert sum(lab != prm.IGNORE for lab in enc["labels"]) == 2
    assert model.config.num_labels == 2
    with pytest.raises(ValueError, match="not one token"):
        prm.separator_id(tok, "<prm>")
    with pytest.raises(ValueError, match="2 steps but 1 labels"):
        prm.encode_prm(tok, "Q:", ["1+2=3", "3+3=6"], [True], sep)


def test_training_changes_the_backbone_and_learns_the_planted_error(backbone, tmp_path):
    from safetensors.torch import load_file

    train, val = _rollouts(96, 1), _rollouts(24, 2)
    params = prm.PRMParams(batch_size=8, lr=3e-3, passes=4, eval_every=6)
    got = prm.train_prm(params, backbone, train, val, seed=0, out_dir=tmp_path / "prm")
    assert got["metrics"]["train_steps"] == 48 == params.steps_for(96)
    assert [p["step"] for p in got["curve"]] == [0, 6, 12, 18, 24, 30, 36, 42, 48]
    before = load_file(str(backbone / "model.safetensors"))
    after = load_file(str(tmp_path / "prm" / "model.safetensors"))
    shared = [k for k in after if k.startswith("model.") and f"{k}" in before]
    assert shared and any(not torch.equal(before[k], after[k]) for k in shared)
    # the planted error (a step whose result is off by one) is learnable: F1 well above chance
    assert got["curve"][-1]["val_f1"] > got["curve"][0]["val_f1"] + 0.1
    model, tok = prm.load_prm(tmp_path / "prm")
    scored = prm.evaluate_prm(model, tok, val, model.config.prm_separator_id)
    assert scored["f1"] == pytest.approx(got["curve"][-1]["val_f1"], abs=1e-6)
    assert 0.0 <= scored["best_of_n"] <= 1.0
    with pytest.raises(ValueError, match="empty"):
        prm.train_prm(params, backbone, [], val, seed=0)


# --- compare --------------------------------------------------------------------------------------

def test_compare_summary_claims_and_table():
    curve = [(0, 0.4), (10, 0.6), (20, 0.75), (30, 0.8)]
    assert bc.steps_to_reach(curve, 0.75) == 20 and bc.steps_to_reach(curve, 0.9) is None
    arms = [{"name": "full", "rule": "full", "rho": 1.0},
            {"name": "random_10", "rule": "random", "rho": 0.1},
            {"name": "bis_10", "rule": "bis", "rho": 0.1}]
    evaluation = pl.DataFrame({
        "arm": ["full", "full", "random_10", "random_10", "bis_10", "bis_10"],
        "seed": [0, 1] * 3, "f1": [0.8, 0.7, 0.5, 0.7, 0.76, 0.74],
        "f1_wrong": [0.6] * 6, "best_of_n": [0.5, 0.7, 0.4, 0.4, 0.6, 0.6]})
    claims = [bc.PaperClaim(method="bis_10", baseline="full", paper_effect=0.0034),
              bc.PaperClaim(method="bis_10", baseline="random_10", metric="best_of_n",
                            paper_effect=None)]
    curves = pl.DataFrame({
        "arm": ["full"] * 4 + ["random_10"] * 4 + ["bis_10"] * 4,
        "seed": [0, 0, 1, 1] * 3,
        "step": [0, 100, 0, 100, 0, 10, 0, 10, 0, 10, 0, 10],
        "val_f1": [0.3, 0.8, 0.3, 0.6, 0.3, 0.5, 0.3, 0.75, 0.3, 0.7, 0.3, 0.72]})
    m = bc.summarize(arms, evaluation, curves, "full", claims)
    assert m["full_val_f1"] == pytest.approx(0.7)                  # mean final val F1 of full
    assert m["bis_10/f1_mean"] == pytest.approx(0.75) and m["bis_10/f1_std"] == pytest.approx(0.01)
    assert m["bis_10/train_steps"] == 10 and m["full/train_steps"] == 100
    assert m["bis_10/reached_frac"] == 1.0 and m["bis_10/steps_to_full_mean"] == 10
    assert m["random_10/reached_frac"] == 0.5                      # seed 0 stops at 0.5
    assert m["bis_10/gain_vs_full"] == pytest.approx(0.0)
    assert m["bis_10/gain_vs_random"] == pytest.approx((0.75 - 0.6) / 0.6)
    assert not any(k.startswith("claim_") for k in m)               # no boolean claims
    # bis_10 - full on F1, paired by seed: diffs [-0.04, +0.04], mean 0, sd 0.04 sqrt(2), so
    # se = 0.04 and the t interval is 0 +- t_{.975,1} 0.04 = +-0.508; MDE (t_{.975,1} + t_{.8,1})
    # x 0.04 = 0.563: inconclusive, and the paper's +0.0034 is far below what 2 seeds can see
    full = stats.read_claim(m, "claim/bis_10_vs_full/f1")
    assert full.diff == pytest.approx(0.0, abs=1e-12) and full.n == 2
    assert (full.low, full.high) == (pytest.approx(-0.50825, abs=1e-4),
                                     pytest.approx(0.50825, abs=1e-4))
    assert full.mde == pytest.approx((12.7062 + 1.3764) * 0.04, abs=1e-3)
    assert full.name == "inconclusive" and m["claim/bis_10_vs_full/f1/paper_effect"] == 0.0034
    # bis_10 - random_10 on best-of-N: [0.2, 0.2], two identical differences: no interval (the
    # sign test needs 6), inconclusive
    rand = stats.read_claim(m, "claim/bis_10_vs_random_10/best_of_n")
    assert rand.diff == pytest.approx(0.2) and math.isnan(rand.low) and math.isnan(rand.high)
    assert rand.name == "inconclusive" and rand.paper_effect is None
    table = bc.results_table({"compare": m})
    assert "| bis_10 | 0.750 ± 0.010 |" in table and "| +25.0% |" in table
    assert ("- bis_10 above full, test step F1: **inconclusive**: +0.000 [-0.508, +0.508] over 2 "
            "pairs; MDE 0.563; paper: +0.003") in table
    assert ("- bis_10 above random_10, best-of-N accuracy: **inconclusive**: +0.200 [n/a, n/a] "
            "over 2 pairs; MDE 0.000") in table
    assert bc.results_table({}).startswith("_No results")
    # a second regime kept from another run renders as its own table, with its corpus line
    regime = {**m, "corpus/true_wrong_share": 0.39, "corpus/mc_negative_share": 0.49,
              "corpus/true_mixed_share": 0.3, "corpus/mc_mixed_share": 0.15,
              "corpus/label_agreement": 0.88, "regime/min_operands": 3.0,
              "regime/max_operands": 5.0, "source": "commit abc"}
    both = bc.results_table({"compare": m, "regime_3to5": regime})
    assert both.count("| bis_10 | 0.750 ± 0.010 |") == 2
    assert "Second regime: problems with 3-5 operands (from commit abc)" in both
    assert "39.0% of steps wrong" in both
    # a regime kept without per-seed values (no claim keys) says its claims are not tested
    old = {k: v for k, v in regime.items() if not k.startswith("claim/")}
    assert "not tested in this regime" in bc.results_table({"compare": m, "regime_3to5": old})
    assert "not tested in this regime" not in both
    # claims are checked against the arms and the seeds before any number is reported
    with pytest.raises(ValueError, match=r"claim/bis_5_vs_full/f1 names arm\(s\) \['bis_5'\]"):
        bc.summarize(arms, evaluation, curves, "full",
                     [bc.PaperClaim(method="bis_5", baseline="full", paper_effect=None)])
    one_seed = evaluation.filter(~((pl.col("arm") == "full") & (pl.col("seed") == 1)))
    with pytest.raises(ValueError, match=r"bis_10 vs full.*same keys.*\[1\]"):
        bc.summarize(arms, one_seed, curves, "full", claims[:1])
    with pytest.raises(ValidationError, match="claims repeat"):
        bc.Config(claims=[claims[0], claims[0]])
    with pytest.raises(ValueError, match="full_arm"):
        bc.summarize(arms[1:], evaluation, curves, "full")
