"""EDCO on hand-computed cases: top-20 entropy in bits, top-20% aggregation, selection and its
edge cases, the static orders, the noisy pool, budgets; then the estimator and one curriculum
round on a tiny real model (the round really changes the weights). The comparison:
tests/unit/test_edco_compare.py."""

from __future__ import annotations

import math

import polars as pl
import pytest
import torch
from pydantic import ValidationError

from stages.models import base
from stages.models.tokenizer import build_tokenizer
from stages.edco import edco
from stages.tasks import arith
from stages.edco.pool import add_noise, corrupt
from stages.edco import rl as edco_rl
from stages.edco import sft as edco_sft

torch.set_num_threads(1)


# --- entropy of known distributions, in bits ---------------------------------------------------

def test_entropy_of_known_distributions_in_bits():
    assert edco.topk_entropy_bits(torch.zeros(4)).item() == pytest.approx(2.0)      # uniform/4
    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    assert edco.topk_entropy_bits(p.log()).item() == pytest.approx(1.75)
    assert edco.topk_entropy_bits(torch.tensor([3.0, 3.0])).item() == pytest.approx(1.0)
    assert edco.topk_entropy_bits(torch.tensor([0.0, -1e9])).item() == pytest.approx(0.0,
                                                                                      abs=1e-6)
    # top-p masks with -inf: those tokens have probability 0 and add nothing (no NaN)
    masked = torch.tensor([0.0, 0.0, -math.inf, -math.inf])
    assert edco.topk_entropy_bits(masked).item() == pytest.approx(1.0)


def test_top20_renormalisation():
    # 40 tokens: 20 at logit 0, 20 at logit -1. Top-20 keeps the 20 zeros: uniform, log2 20 bits
    # (the full 40-token distribution has more entropy than that).
    logits = torch.cat([torch.zeros(20), -torch.ones(20)])
    assert edco.topk_entropy_bits(logits, k=20).item() == pytest.approx(math.log2(20))
    assert edco.topk_entropy_bits(logits, k=40).item() > math.log2(20)
    # 21 tokens: one at log 2, twenty at 0; top-20 keeps log 2 and nineteen zeros:
    # p = 2/21 once and 1/21 nineteen times after renormalising over the 20 kept
    logits = torch.tensor([math.log(2.0)] + [0.0] * 20)
    expected = -(2 / 21 * math.log2(2 / 21) + 19 * (1 / 21) * math.log2(1 / 21))
    assert edco.topk_entropy_bits(logits, k=20).item() == pytest.approx(expected)
    # a vocabulary smaller than k keeps every token; shape (B, T, V) -> (B, T)
    assert edco.topk_entropy_bits(torch.zeros(2, 3, 8), k=20).shape == (2, 3)
    assert edco.topk_entropy_bits(torch.zeros(2, 3, 8), k=20)[1, 2].item() == pytest.approx(3.0)


def test_top_fraction_aggregation():
    h = [float(v) for v in range(10)]                        # T = 10 -> k = int(2.0) = 2
    assert edco.aggregate_entropy(h, "top_frac", 0.2) == pytest.approx((9 + 8) / 2)
    assert edco.aggregate_entropy([0.1, 0.7, 0.2, 0.4], "top_frac", 0.2) == 0.7  # k = max(1, 0)
    assert edco.aggregate_entropy([1.0, 2.0, 3.0, 4.0, 5.0], "top_frac", 0.2) == 5.0  # int(1.0)
    assert edco.aggregate_entropy(list(range(9)), "top_frac", 0.2) == 8.0   # int(1.8) = 1
    assert edco.aggregate_entropy(list(range(15)), "top_frac", 0.2) == pytest.approx(13.0)
    assert edco.aggregate_entropy([1.0, 2.0, 6.0], "mean") == pytest.approx(3.0)
    assert edco.aggregate_entropy([5.0], "top_frac") == 5.0
    with pytest.raises(ValueError, match="no generated token"):
        edco.aggregate_entropy([], "top_frac")
    with pytest.raises(ValueError, match="aggregate"):
        edco.aggregate_entropy([1.0], "median")


def test_valid_token_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 2, 0]])
    assert edco.valid_token_mask(ids, eos_id=2).tolist() == [
        [True, True, False, False], [True, True, True, True], [True, False, False, False]]


# --- selection and the static orders ---------------------------------------------------------

def test_select_top_n_and_its_edge_cases():
    assert edco.select_top_n([0.1, 0.5, 0.3], 2) == [1, 2]
    assert edco.select_top_n([0.2, 0.9, 0.2, 0.9], 3) == [1, 3, 0]     # ties: earlier row first
    assert edco.select_top_n([1.0] * 5, 3) == [0, 1, 2]                # all equal: pool order
    assert edco.select_top_n([0.3, 0.1], 2) == [0, 1]                  # N = pool: everything
    with pytest.raises(ValueError, match="empty"):
        edco.select_top_n([], 1)
    with pytest.raises(ValueError, match="N = 4 but the pool has 3"):
        edco.select_top_n([0.1, 0.2, 0.3], 4)
    with pytest.raises(ValueError, match="N = 0"):
        edco.select_top_n([0.1], 0)
    with pytest.raises(ValueError, match="non-finite"):
        edco.select_top_n([0.1, float("nan")], 1)


def test_static_orders_and_schedule():
    diff = [4, 2, 3, 2, 4, 3]
    order = edco.easy_to_hard_order(diff, seed=0)
    assert [diff[i] for i in order] == [2, 2, 3, 3, 4, 4]
    assert order == edco.easy_to_hard_order(diff, seed=0)              # deterministic
    assert {tuple(edco.easy_to_hard_order(diff, s)) for s in range(8)} != {tuple(order)}
    assert edco.score_order([3.0, 1.0, 2.0, 1.0]) == [1, 3, 2, 0]      # ascending, ties by row
    assert edco.score_order([3.0, 1.0, 2.0, 1.0], ascending=False) == [0, 2, 1, 3]
    perm = edco.random_order(5, epochs=2, seed=1)
    assert sorted(perm[:5]) == sorted(perm[5:]) == list(range(5)) and perm[:5] != perm[5:]
    assert edco.tile_schedule([0, 1, 2], n=2, rounds=4) == [[0, 1], [2, 0], [1, 2], [0, 1]]
    with pytest.raises(ValueError, match="empty"):
        edco.tile_schedule([], 2, 2)
    assert edco.budget_n(7000, 8, 2) == 1750                           # the code's Qwen3-4B SFT


# --- the noisy pool ---------------------------------------------------------------------------

def test_noisy_rows_have_a_wrong_but_self_consistent_target():
    row = arith.make_row([2, 4, 9], ["*", "-"], "pool", 0)
    bad = corrupt(row, 3)
    assert bad["target"] == " 2*4=8; 8-9=2 #### 2" and bad["answer"] == 2
    assert arith.verify_answer(bad, bad["target"]) and not arith.verify_answer(row, bad["target"])
    with pytest.raises(ValueError):
        corrupt(row, 0)
    rows = arith.generate(arith.Config(operators="+-*", max_value=12), 100, "t", split="pool")
    noisy = add_noise(rows, 0.05, 10, "s")
    assert sum(r["noisy"] for r in noisy) == 5
    assert noisy == add_noise(rows, 0.05, 10, "s")                     # seeded
    for r in noisy:
        assert (r["answer"] != r["clean_answer"]) == r["noisy"]
        assert arith.verify_answer(r, r["target"])
    assert not any(r["noisy"] for r in add_noise(rows, 0.0, 10, "s"))


def test_an_empty_or_flagless_pool_file_is_refused_at_the_boundary(tmp_path):
    from stages.core.checks import DataValidationError
    from stages.edco.pool import EXTRA_SCHEMA, read_pool

    schema = {**arith.SCHEMA, **EXTRA_SCHEMA}
    pl.DataFrame(schema=schema).write_parquet(tmp_path / "pool.parquet")
    with pytest.raises(DataValidationError, match="row count"):
        read_pool(tmp_path / "pool.parquet")
    rows = arith.generate(arith.Config(), 4, "t", split="pool")
    pl.DataFrame(rows, schema=arith.SCHEMA).write_parquet(tmp_path / "old.parquet")
    with pytest.raises(DataValidationError, match="'noisy'"):
        read_pool(tmp_path / "old.parquet")


# --- configs and budgets ----------------------------------------------------------------------

def test_configs_refuse_bad_budgets_and_unknown_keys():
    with pytest.raises(ValidationError, match="multiple of batch_size"):
        edco_sft.Config(top_n=100, batch_size=32)
    with pytest.raises(ValidationError, match="repeat"):
        edco_sft.Config(seeds=[1, 1])
    with pytest.raises(ValidationError, match="extra"):
        edco_sft.Config(estimator={"prefix_token": 8})
    with pytest.raises(ValidationError, match="prompts_per_round"):
        edco_rl.Config(top_n=4, grpo={"prompts_per_round": 8})
    with pytest.raises(ValidationError, match="distinct"):
        edco.Config(prefix_lengths=[4, 4])
    a = edco_sft.Config(strategy="edco", top_n=64, batch_size=16)
    b = edco_sft.Config(strategy="random", top_n=64, batch_size=16)
    assert a.budget == b.budget and a.steps_per_round == 4


# --- a tiny real model: estimator and one curriculum round ---------------------------------------

@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny Llama SFT'd briefly on 1-digit additions: right sometimes, wrong sometimes."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-*=;#?:QA "))
    cfg = base.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_positions=64, steps=60, batch_size=16, lr=5e-3, warmup=0.0,
                      log_every=30)
    model = base.build_model(cfg, tokenizer)
    rows = arith.generate(arith.Config(min_operands=2, max_operands=2, max_value=9), 80, 1)
    enc = base.encode_sft_rows(tokenizer, [r["prompt"] for r in rows],
                               [r["target"] for r in rows], max_len=64)
    base.train(cfg, model, tokenizer, enc, seed=0)
    folder = tmp_path_factory.mktemp("policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _pool(n: int) -> list[dict]:
    cfg = arith.Config(min_operands=2, max_operands=3, max_value=9, operators="+-*")
    return add_noise(arith.generate(cfg, n, "unit", split="pool"), 0.1, 5, "unit")


def test_prefix_estimator_scores_the_first_L_tokens_of_the_same_sample(policy):
    from stages.models.generate import load_model

    model, tok = load_model(policy)
    prompts = [r["prompt"] for r in _pool(12)]
    params = edco.EstimatorParams(batch_size=4)
    full, texts = edco.sample_entropies(model, tok, prompts, max_new_tokens=24, params=params,
                                        seed=3)
    pre, _ = edco.sample_entropies(model, tok, prompts, max_new_tokens=4, params=params, seed=3)
    assert len(full) == len(texts) == len(prompts)
    for f, p in zip(full, pre):
        assert 1 <= len(p) <= 4 and len(f) <= 24
        assert p == pytest.approx(f[:len(p)], abs=1e-5)
        assert all(0.0 <= h <= math.log2(20) + 1e-6 for h in f)
    scores = edco.prompt_entropy(model, tok, prompts, params.model_copy(
        update={"prefix_tokens": 4}), seed=3)
    assert scores == pytest.approx([edco.aggregate_entropy(p) for p in pre])
    assert edco.sample_entropies(model, tok, [], max_new_tokens=4, params=params) == ([], [])


def test_target_nll_matches_the_shared_completion_loss(policy):
    from stages.models.generate import load_model

    model, tok = load_model(policy)
    row = _pool(1)[0]
    nll = edco.target_nll(model, tok, [row["prompt"]], [row["target"]])
    enc = base.encode_sft_rows(tok, [row["prompt"]], [row["target"]], 64)
    assert nll[0] == pytest.approx(base.completion_loss(model, enc, tok.pad_token_id), rel=1e-5)


def test_one_edco_round_selects_top_n_and_changes_the_model(policy, tmp_path):
    from safetensors.torch import load_file

    rows = _pool(24)
    cfg = edco_sft.Config(strategy="edco", rounds=1, top_n=8, batch_size=4, lr=5e-3,
                          max_new_tokens=24, seeds=[0],
                          estimator={"prefix_tokens": 6, "batch_size": 8})
    curve, picks = edco_sft.curriculum_sft(cfg, policy, rows, rows[:6], 0, tmp_path / "out")
    assert len(curve) == 1 and len(picks) == 8 and curve[0]["sft_steps"] == 2
    scores = [p["score"] for p in picks]
    assert scores == sorted(scores, reverse=True)                      # the top N, best first
    assert curve[0]["noisy_frac"] == pytest.approx(sum(p["noisy"] for p in picks) / 8)
    assert curve[0]["new_items"] == 8 and 0.0 <= curve[0]["acc"] <= 1.0
    before = load_file(str(policy / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # N larger than the pool: a clear error before any compute
    with pytest.raises(ValueError, match="pool has only 24 rows"):
        edco_sft.curriculum_sft(cfg.model_copy(update={"top_n": 32}), policy, rows, rows, 0,
                                tmp_path / "x")
    with pytest.raises(ValueError, match="empty"):
        edco_sft.curriculum_sft(cfg, policy, [], rows, 0, tmp_path / "y")


def test_static_arms_follow_their_schedule(policy, tmp_path):
    rows = _pool(12)
    cfg = edco_sft.Config(strategy="easy_to_hard", rounds=2, top_n=8, batch_size=4, lr=1e-3,
                          max_new_tokens=16, seeds=[0])
    curve, picks = edco_sft.curriculum_sft(cfg, policy, rows, rows[:4], 0, tmp_path / "out")
    first = [rows[p["row"]]["difficulty"] for p in picks if p["round"] == 1]
    assert first == sorted(first) and curve[1]["new_items"] == 4       # 12 rows, N = 8: 4 new
    assert edco_sft.static_schedule(cfg, rows, 0, None)[0] == [p["row"] for p in picks
                                                               if p["round"] == 1]
    with pytest.raises(ValueError, match="target NLL"):
        edco_sft.static_schedule(cfg.model_copy(update={"strategy": "ppl"}), rows, 0, None)
