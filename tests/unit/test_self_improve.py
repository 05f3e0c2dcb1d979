"""HSIR's self-training loop and its comparison on hand cases: pool rules per arm, tau
calibration, pool statistics, Spearman, budget refusal, the README table, one real round."""

from __future__ import annotations

import math

import polars as pl
import pytest
import torch
from pydantic import ValidationError

from stages.hsir import compare as hc
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


def test_mean_std_ignores_nan():
    assert si.mean_std([1.0, 3.0, float("nan")]) == (2.0, 1.0)
    assert all(math.isnan(v) for v in si.mean_std([float("nan")]))


# --- compare -------------------------------------------------------------------------------------

def test_spearman_by_hand():
    assert hc.ranks([10.0, 30.0, 20.0, 20.0]) == [1.0, 4.0, 2.5, 2.5]
    assert hc.spearman([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    # ranks x = 1..5, y = [1, 2, 3, 5, 4]: d^2 sums to 2, rho = 1 - 6*2 / (5*24) = 0.9
    assert hc.spearman([1, 2, 3, 4, 5], [10, 20, 30, 50, 40]) == pytest.approx(0.9)
    # with ties: y ranks [1.5, 1.5, 3, 4] -> Pearson of ranks = 0.9486833
    assert hc.spearman([1, 2, 3, 4], [0, 0, 1, 2]) == pytest.approx(3 / math.sqrt(10))
    assert math.isnan(hc.spearman([1, 2, 3], [5, 5, 5]))
    assert hc.spearman([1, 2, float("nan"), 3], [3, 2, 0, 1]) == pytest.approx(-1.0)
    with pytest.raises(ValueError):
        hc.spearman([1, 2], [1])


def test_unequal_budgets_are_refused_with_arm_and_key():
    same = {"rounds": 2, "samples_per_query": 4, "sft_steps_per_round": 16}
    hc.check_budgets({"star": same, "hsir": dict(same)}, ["rounds", "sft_steps_per_round"])
    with pytest.raises(ValueError, match="'hsir' ran with sft_steps_per_round = 32"):
        hc.check_budgets({"star": same, "hsir": {**same, "sft_steps_per_round": 32}},
                         hc.SELF_BUDGET_KEYS)


def test_summarize_arms_and_relative_changes():
    finals = {"star": {"acc": [0.4, 0.6], "hard_acc": [0.1, 0.1], "tokens_per_solved": [50, 50]},
              "hsir": {"acc": [0.55, 0.55], "hard_acc": [0.2, 0.2],
                       "tokens_per_solved": [30, 30]}}
    m = hc.summarize_arms(finals, "star", "self")
    assert m["self/star/acc_mean"] == 0.5 and m["self/star/acc_std"] == pytest.approx(0.1)
    assert m["self/hsir/acc_vs_star"] == pytest.approx(0.1)
    assert m["self/hsir/hard_acc_vs_star"] == pytest.approx(1.0)
    assert m["self/hsir/tokens_per_solved_vs_star"] == pytest.approx(-0.4)
    assert m["self/star/acc_vs_star"] == 0.0 and m["self/hsir/order"] == 1.0
    assert math.isnan(hc.relative(0.3, 0.0))


def test_results_table_is_the_metrics_rendered():
    finals = {"star": {"acc": [0.5], "hard_acc": [0.1], "tokens_per_solved": [50.0]},
              "hsir": {"acc": [0.6], "hard_acc": [0.2], "tokens_per_solved": [40.0]}}
    m = {**hc.summarize_arms(finals, "star", "self"),
         **hc.summarize_arms({"grpo": finals["star"]}, "grpo", "rl"),
         "self/hsir/pool_hard_share": 0.25, "self/hsir/faithful_rate": 0.5,
         "self/hsir/pool_hard_coverage": 0.125,
         "indiv/eigenscore/spearman_repeats": -0.8}
    table = hc.results_table({"compare": dict(sorted(m.items()))})
    lines = table.splitlines()
    star_row = next(i for i, line in enumerate(lines) if line.startswith("| star |"))
    hsir_row = next(i for i, line in enumerate(lines) if line.startswith("| hsir |"))
    assert star_row < hsir_row                     # compare's order, not alphabetical
    assert "| 0.600 ± 0.000 | +20.0% |" in lines[hsir_row] and "| -20.0% |" in lines[hsir_row]
    assert "| 25.0% | 12.5% |" in lines[hsir_row] and "| 50% |" in lines[hsir_row]
    assert "| grpo |" in table and "| eigenscore | -0.800 | n/a |" in table
    assert hc.results_table({}) == "_No results yet: run the pipeline._\n"


def test_pool_summary_weights_faithfulness_by_rows():
    frame = pl.DataFrame({"round": [0.0, 1.0, 2.0], "pool_hard_share": [None, 0.2, 0.4],
                          "pool_size": [None, 10.0, 20.0], "pool_mean_repeats": [None, 1.0, 0.0],
                          "pool_veriexit_rows": [None, 1.0, 3.0],
                          "pool_veriexit_faithful": [None, 1.0, 1.0],
                          "pool_hard_coverage": [None, 0.1, 0.3],
                          "mean_repeats": [0.5, 0.5, 0.5]})  # greedy outputs', not the pool's
    s = hc.pool_summary(frame)
    assert s["pool_hard_share"] == pytest.approx(0.3) and s["faithful_rate"] == 0.5
    assert s["veriexit_rows"] == 2.0 and s["pool_size"] == 15.0
    assert s["pool_hard_coverage"] == pytest.approx(0.2)


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
