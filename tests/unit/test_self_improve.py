"""HSIR's self-training loop on hand cases: pool rules per arm, tau calibration, pool
statistics, one real round (the comparison: tests/unit/test_hsir_compare.py)."""

from __future__ import annotations

import math

import polars as pl
import pytest
import torch
from pydantic import ValidationError

from stages.models import base
from stages.models.tokenizer import build_tokenizer
from stages.tasks import arith
from stages.hsir import hsir
from stages.hsir import self_improve as si

torch.set_num_threads(1)

QUESTION = {"easy": "2+3", "hard": "10+5-3+4", "mid": "23+45-17"}
GOLD = {"easy": 5, "hard": 16, "mid": 51}
SAMPLES = [
    {"query_id": "easy", "difficulty": 2, "prompt": "Q: 2+3=? A:", "completion": " 2+3=5 #### 5",
     "correct": True},
    {"query_id": "easy", "difficulty": 2, "prompt": "Q: 2+3=? A:",
     "completion": " 2+3=5; check 2+3=5 #### 5", "correct": True},
    {"query_id": "easy", "difficulty": 2, "prompt": "Q: 2+3=? A:", "completion": " 2+3=6 #### 6",
     "correct": False},
    {"query_id": "mid", "difficulty": 3, "prompt": "Q: 23+45-17=? A:",
     "completion": " 23+45=68; 68-17=51; 51-1=50 #### 50", "correct": False},
    {"query_id": "hard", "difficulty": 4, "prompt": "Q: 10+5-3+4=? A:",
     "completion": " 10+5=16; 16-3=13; 13+4=17 #### 17", "correct": False},
]


def minus_repeats(rows):
    """InDiv stand-in: minus the number of re-verification steps."""
    return [-float(hsir.count_repeats(r["completion"])) for r in rows]


def test_label_samples_flattens_queries_and_verifies():
    rows = [{"id": "q1", "difficulty": 2, "prompt": "Q: 2+3=? A:", "answer": 5},
            {"id": "q2", "difficulty": 3, "prompt": "Q: 1+1+1=? A:", "answer": 3}]
    out = si.label_samples(rows, [[" #### 5", " #### 6"], [" 1+1=2; 2+1=3 #### 3", ""]],
                           arith.verify_answer)
    assert [(s["query_id"], s["sample"], s["correct"]) for s in out] == [
        ("q1", 0, True), ("q1", 1, False), ("q2", 0, True), ("q2", 1, False)]
    assert out[2]["prompt"] == "Q: 1+1+1=? A:" and out[2]["difficulty"] == 3


def test_build_pool_rules_of_every_arm():
    def pool(**kw):
        rows, _ = si.build_pool(SAMPLES, QUESTION, GOLD, indiv_of=minus_repeats, tau=-0.5, **kw)
        return [(r["query_id"], r["completion"]) for r in rows]

    star = [("easy", " 2+3=5 #### 5"), ("easy", " 2+3=5; check 2+3=5 #### 5")]
    assert pool() == star
    assert pool(pool="rest_em", max_per_query=1) == star[:1]
    assert pool(pool="length_filter", keep_frac=0.5) == star[:1]
    assert pool(veriexit=True) == star + [("mid", " 23+45=68; 68-17=51 #### 51"),
                                          ("hard", " 10+5=16 #### 16")]
    assert pool(indiv_filter=True) == star[:1]                    # the re-verifying one drops
    assert pool(veriexit=True, indiv_filter=True) == [
        star[0], ("mid", " 23+45=68; 68-17=51 #### 51"), ("hard", " 10+5=16 #### 16")]
    with pytest.raises(ValueError, match="pool"):
        si.build_pool(SAMPLES, QUESTION, GOLD, pool="dpo")
    with pytest.raises(ValueError, match="indiv_of"):
        si.build_pool(SAMPLES, QUESTION, GOLD, indiv_filter=True)


def test_tau_is_calibrated_once_then_kept():
    scores = iter([[1.0, 2.0, 3.0, 4.0]])
    calls = []

    def indiv_of(rows):
        calls.append(len(rows))
        return next(scores)

    # 4 candidates (2 correct + 2 VeriExit), drop 25%: tau = 2nd smallest, one row dropped
    rows, tau = si.build_pool(SAMPLES, QUESTION, GOLD, veriexit=True, indiv_filter=True,
                              indiv_of=indiv_of, tau=None, drop_frac=0.25)
    assert tau == 2.0 and calls == [4]  # InDiv computed once per candidate
    assert [r["indiv"] for r in rows] == [2.0, 3.0, 4.0]
    # a later round keeps the tau it is given
    rows, tau2 = si.build_pool(SAMPLES, QUESTION, GOLD, indiv_filter=True,
                               indiv_of=lambda r: [5.0, 1.0], tau=tau)
    assert tau2 == 2.0 and [r["indiv"] for r in rows] == [5.0]
    # no candidate: empty pool, tau still to be calibrated
    wrong = [s for s in SAMPLES if not s["correct"]][:1]
    assert si.build_pool(wrong, QUESTION, GOLD, indiv_filter=True, indiv_of=lambda r: [],
                         tau=None) == ([], None)


def test_pool_stats_by_hand():
    pool, _ = si.build_pool(SAMPLES, QUESTION, GOLD, veriexit=True)
    stats = si.pool_stats(pool, SAMPLES, hard_difficulty=3)
    assert stats["pool_size"] == 4 and stats["pool_queries"] == 3
    assert stats["pool_hard_share"] == 0.5          # mid + hard rows of 4
    assert stats["pool_hard_coverage"] == 1.0       # both hard queries (mid, hard) have a row
    assert stats["pool_veriexit_rows"] == 2 and stats["pool_veriexit_faithful"] == 1
    assert stats["pool_faithful_rate"] == 0.5       # " 10+5=16" is a wrong step that hit gold
    assert stats["pool_mean_repeats"] == 0.25 and stats["pool_verbose_share"] == 0.25
    assert stats["sample_acc"] == 0.4
    empty = si.pool_stats([], SAMPLES, 3)
    assert empty["pool_size"] == 0 and math.isnan(empty["pool_hard_share"])
    assert math.isnan(empty["pool_faithful_rate"]) and empty["pool_hard_coverage"] == 0.0


def test_config_rules_and_budget():
    with pytest.raises(ValidationError, match="build on STaR"):
        si.Config(pool="rest_em", veriexit=True)
    with pytest.raises(ValidationError, match="repeat"):
        si.Config(seeds=[0, 0])
    a, b = si.Config(pool="star"), si.Config(pool="star", veriexit=True, indiv_filter=True)
    assert a.budget == b.budget and a.budget["sft_steps_per_round"] == 40


def test_summarize_curve_averages_seeds_over_finite_values():
    """Final-round mean/std over seeds; a seed that solved nothing (tokens_per_solved NaN) and
    an arm without InDiv (tau NaN) are left out, not propagated."""
    keys = ("acc", "hard_acc", "tokens_per_solved", "hard_tokens_per_solved", "mean_tokens",
            "verbose_share", "pool_size", "pool_hard_share", "pool_hard_coverage",
            "pool_veriexit_rows", "pool_veriexit_faithful", "pool_mean_repeats",
            "pool_verbose_share", "sample_acc", "tau")
    nan = float("nan")
    rows = [{"seed": s, "round": r, **{k: 0.5 for k in keys}} for s in (0, 1) for r in (0.0, 1.0)]
    rows[1].update(acc=1.0, tokens_per_solved=10.0, tau=nan)
    rows[3].update(acc=0.0, tokens_per_solved=nan, tau=nan)
    m = si.summarize_curve(pl.DataFrame(rows), rounds=1, train_queries=4)
    assert (m["acc_mean"], m["acc_std"]) == (0.5, 0.5)
    assert (m["tokens_per_solved_mean"], m["tokens_per_solved_std"]) == (10.0, 0.0)
    assert math.isnan(m["tau"]) and m["seeds"] == 2.0 and m["initial_acc"] == 0.5


# --- one real round on a tiny model ---------------------------------------------------------

@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny Llama SFT'd briefly on 1-digit additions: right sometimes, wrong sometimes."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA check"))
    cfg = base.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_positions=96, steps=80, batch_size=16, lr=5e-3, warmup=0.0,
                      log_every=40)
    model = base.build_model(cfg, tokenizer)
    rows = arith.generate(arith.Config(max_operands=2, max_value=9), 80, seed=1)
    enc = base.encode_sft_rows(tokenizer, [r["prompt"] for r in rows],
                               [r["target"] for r in rows], max_len=96)
    base.train(cfg, model, tokenizer, enc, seed=0)
    folder = tmp_path_factory.mktemp("policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_one_hsir_round_trains_on_its_pool_and_saves_it(policy, tmp_path):
    from safetensors.torch import load_file

    rows = arith.generate(arith.Config(max_operands=2, max_value=9), 12, seed=2, split="train")
    evals = {"": rows[:4], "hard": rows[4:8]}
    cfg = si.Config(pool="star", veriexit=True, indiv_filter=True, rounds=1, samples_per_query=4,
                    max_new_tokens=16, sft_steps_per_round=2, batch_size=4, lr=1e-3,
                    drop_frac=0.3, hard_difficulty=2, seeds=[0])
    logged = []
    curve = si.self_train(cfg, policy, rows, evals, 0, tmp_path / "seed0", tmp_path / "pools",
                          log=lambda m, step: logged.append((step, m)))
    assert len(curve) == 1 and curve[0]["rollouts"] == 12 * 4
    pool = pl.read_parquet(tmp_path / "pools/round1_seed0.parquet")
    assert len(pool) == curve[0]["pool_size"] > 0, "the tiny policy solved nothing"
    assert pool["indiv"].min() >= curve[0]["tau"]       # the InDiv filter ran with tau
    assert curve[0]["sft_steps"] == 2 and 0.0 <= curve[0]["hard_acc"] <= 1.0
    before = load_file(str(policy / "model.safetensors"))
    after = load_file(str(tmp_path / "seed0/model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)  # SFT moved it
    assert any("acc" in m for _, m in logged)
