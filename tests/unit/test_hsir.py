"""HSIR's pieces on hand-computed cases: seed traces, VeriExit, InDiv, pools, the H-GRPO reward."""

from __future__ import annotations

import math
import random

import pytest
import torch

from stages.models.tokenizer import build_tokenizer
from stages.tasks import arith
from stages.hsir import hsir

torch.set_num_threads(1)


# --- 1. overthinking seed traces --------------------------------------------------------------

@pytest.mark.parametrize("question", ["23+45-17", "5+3", "90-95+7-1", "12+7*3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overthink_target_is_correct_and_concise_steps_recover_the_target(question, seed):
    operands, ops = arith.parse_question(question)
    row = {"question": question, "answer": arith.solution_steps(operands, ops)[-1].value}
    concise = arith.format_target(operands, ops)
    verbose = hsir.overthink_target(question, random.Random(seed))
    assert arith.verify_answer(row, verbose)
    assert hsir.concise_steps(verbose) == arith.parse_steps(concise)
    assert hsir.concise_completion(verbose) == concise
    assert all(arith.verify_steps(row, hsir.concise_completion(verbose)))
    assert 2 <= hsir.count_repeats(verbose) <= 4
    steps = arith.parse_steps(verbose)
    for k, step in enumerate(steps):  # a check restates the last derivation step before it
        if hsir.is_check(step):
            last = [s for s in steps[:k] if not hsir.is_check(s)][-1]
            assert step == hsir.CHECK + last
    assert verbose == hsir.overthink_target(question, random.Random(seed))


def test_count_repeats_and_concise_steps_by_hand():
    text = " 23+45=68; check 23+45=68; 68-17=51; check 68-17=51; check 68-17=51 #### 51"
    assert hsir.count_repeats(text) == 3
    assert hsir.concise_steps(text) == ["23+45=68", "68-17=51"]
    assert hsir.concise_completion(text) == " 23+45=68; 68-17=51 #### 51"
    assert hsir.count_repeats(" 23+45=68; 68-17=51 #### 51") == 0
    assert hsir.overthink_target("23+45-17", random.Random(0), repeats=(0, 0)) == \
        " 23+45=68; 68-17=51 #### 51"
    with pytest.raises(ValueError):
        hsir.overthink_target("1+2", random.Random(0), repeats=(3, 2))


def test_seed_rows_mix_is_exact_and_deterministic():
    rows = arith.generate(arith.Config(max_operands=3), 10, seed=0)
    mixed = hsir.seed_rows(rows, 0.5, seed=7)
    assert [r["question"] for r in mixed] == [r["question"] for r in rows]
    verbose = [r for r in mixed if r["n_repeats"] > 0]
    assert len(verbose) == 5
    for old, new in zip(rows, mixed):
        assert arith.verify_answer(old, new["target"])
        assert new["n_repeats"] == hsir.count_repeats(new["target"])
        if new["n_repeats"] == 0:
            assert new["target"] == old["target"]
    assert "n_repeats" not in rows[0]  # inputs untouched
    assert mixed == hsir.seed_rows(rows, 0.5, seed=7)
    assert all(r["n_repeats"] == 0 for r in hsir.seed_rows(rows, 0.0, seed=7))
    assert all(r["n_repeats"] > 0 for r in hsir.seed_rows(rows, 1.0, seed=7))


# --- 2. VeriExit ----------------------------------------------------------------------------------

def test_step_char_spans_match_parse_steps():
    for text in [" 23+45=68; 68-17=51 #### 51", "  1+2=3 ;;check 1+2=3;3-1=2", " #### 5", ""]:
        spans = hsir.step_char_spans(text)
        assert [text[a:b] for a, b in spans] == arith.parse_steps(text)


def test_veriexit_truncates_after_the_first_gold_step():
    # wrong 3-step solution of a 2-step question: gold 51 reached at step 2, then one step too many
    wrong = " 23+45=68; 68-17=51; 51-17=34 #### 34"
    cut = hsir.verify_then_exit(wrong, "23+45-17", 51)
    assert cut == " 23+45=68; 68-17=51 #### 51"
    assert hsir.exit_is_faithful(cut, "23+45-17")
    assert arith.verify_answer({"answer": 51}, cut)


def test_veriexit_returns_none_when_gold_is_never_a_result_or_already_correct():
    # 51 appears as an operand, never as a step's result: a loose match would fire here
    assert hsir.verify_then_exit(" 23+45=68; 68-17=52; 51+1=52 #### 52", "23+45-17", 51) is None
    assert hsir.verify_then_exit(" 23+45=68; 68-17=51 #### 51", "23+45-17", 51) is None
    assert hsir.verify_then_exit(" 23+45=68; 68-17=510 #### 510", "23+45-17", 51) is None


def test_veriexit_unfinished_and_verbose_completions():
    assert hsir.verify_then_exit(" 23+45=68; 68-17=51; 51-1", "23+45-17", 51) == \
        " 23+45=68; 68-17=51 #### 51"
    verbose = " 23+45=68; check 23+45=68; 68-17=51; check 68-17=51 #### 50"
    cut = hsir.verify_then_exit(verbose, "23+45-17", 51)
    assert cut == " 23+45=68; check 23+45=68; 68-17=51 #### 51"
    assert hsir.exit_is_faithful(cut, "23+45-17")


def test_exit_is_faithful_flags_coincidental_matches():
    # 10+5 is 15, the model wrote 16, which happens to be the gold answer of 10+5-3+4
    cut = hsir.verify_then_exit(" 10+5=16; 16-3=13; 13+4=17 #### 17", "10+5-3+4", 16)
    assert cut == " 10+5=16 #### 16"
    assert not hsir.exit_is_faithful(cut, "10+5-3+4")
    # on the true path but too early: 5+3 = 8 is already the answer of 5+3-0
    cut = hsir.verify_then_exit(" 5+3=8; 8-0=9 #### 9", "5+3-0", 8)
    assert cut == " 5+3=8 #### 8"
    assert not hsir.exit_is_faithful(cut, "5+3-0")


def test_trim_after_answer():
    verbose = " 23+45=68; 68-17=51; check 68-17=51; check 68-17=51 #### 51"
    assert hsir.trim_after_answer(verbose, 51) == " 23+45=68; 68-17=51 #### 51"
    concise = " 23+45=68; 68-17=51 #### 51"
    assert hsir.trim_after_answer(concise, 51) == concise
    assert hsir.trim_after_answer(" 5+3=8; 8-0=8 #### 8", 8) == " 5+3=8 #### 8"  # a false positive
    with pytest.raises(ValueError, match="correct completion"):
        hsir.trim_after_answer(" 23+45=68 #### 68", 51)


# --- 3. InDiv ----------------------------------------------------------------------------------

ORTHOGONAL = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
IDENTICAL = torch.tensor([[1.0, 0.0], [1.0, 0.0]])


def test_indiv_eigenscore_by_hand():
    # orthogonal unit rows: G = I/2, eigenvalues 0.5, 0.5
    assert hsir.indiv_eigenscore(ORTHOGONAL) == pytest.approx(math.log(0.501), abs=1e-9)
    # identical rows: G = [[.5,.5],[.5,.5]], eigenvalues 1, 0
    assert hsir.indiv_eigenscore(IDENTICAL) == pytest.approx(
        (math.log(1.001) + math.log(0.001)) / 2, abs=1e-9)
    assert hsir.indiv_eigenscore(IDENTICAL) < hsir.indiv_eigenscore(ORTHOGONAL)
    assert hsir.indiv_eigenscore(torch.eye(4)) == pytest.approx(math.log(0.251), abs=1e-9)
    assert hsir.indiv_eigenscore(torch.tensor([[0.6, 0.8]])) == pytest.approx(math.log(1.001))
    with pytest.raises(ValueError):
        hsir.indiv_eigenscore(torch.zeros(0, 2))


def test_indiv_spectral_entropy_by_hand():
    assert hsir.indiv_spectral_entropy(ORTHOGONAL) == pytest.approx(1.0, abs=1e-9)
    assert hsir.indiv_spectral_entropy(IDENTICAL) == pytest.approx(0.0, abs=1e-9)
    # two identical rows + one orthogonal: G = [[1,1,0],[1,1,0],[0,0,1]]/3, eigenvalues 2/3, 1/3, 0
    E = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)) / math.log(3)
    assert hsir.indiv_spectral_entropy(E) == pytest.approx(h, abs=1e-9)
    assert hsir.indiv_spectral_entropy(torch.tensor([[1.0, 0.0]])) == 1.0
    with pytest.raises(ValueError):
        hsir.indiv_spectral_entropy(torch.zeros(0, 2))


def test_step_embeddings_by_hand():
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 4.0]])
    attn = torch.tensor([0.3, 0.1, 0.6])
    E = hsir.step_embeddings(hidden, attn, [(0, 2), (2, 3)])
    # step 0: weights 0.3, 0.1 -> 0.75, 0.25 -> (0.75, 0.25) -> (3, 1) / sqrt(10)
    assert torch.allclose(E[0], torch.tensor([3.0, 1.0]) / math.sqrt(10))
    assert torch.allclose(E[1], torch.tensor([0.6, 0.8]))
    # zero attention inside a step: uniform weights
    E = hsir.step_embeddings(hidden, torch.tensor([0.0, 0.0, 1.0]), [(0, 2)])
    assert torch.allclose(E[0], torch.tensor([1.0, 1.0]) / math.sqrt(2))


def test_step_token_spans():
    # a BPE-like tokenizer: <bos> then tokens covering characters [0,3) [3,5) [5,9)
    offsets = [(0, 0), (0, 3), (3, 5), (5, 9)]
    assert hsir.step_token_spans(offsets, [(4, 6), (0, 1)]) == [(2, 4), (1, 2)]
    assert hsir.step_token_spans(offsets, [(1, 2)], shift=4) == [(3, 4)]
    with pytest.raises(ValueError):
        hsir.step_token_spans(offsets, [(9, 10)])
    # the repo's character tokenizer: <bos>, then one token per character
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA check"))
    prompt, completion = "Q: 1+2=? A:", " 1+2=3; check 1+2=3 #### 3"
    enc = tokenizer(prompt + completion, return_offsets_mapping=True)
    spans = hsir.step_token_spans(enc["offset_mapping"], hsir.step_char_spans(completion),
                                  shift=len(prompt))
    assert spans == [(13, 18), (20, 31)]  # chars [1,6) and [8,19) of the completion, +11, +1 <bos>
    assert tokenizer.decode(enc["input_ids"][13:18]) == "1+2=3"
    assert tokenizer.decode(enc["input_ids"][20:31]) == "check 1+2=3"


def test_resolve_layer():
    assert hsir.resolve_layer("middle", 4) == 1
    assert hsir.resolve_layer("middle", 2) == 0
    assert hsir.resolve_layer(-1, 4) == 3
    assert hsir.resolve_layer(0, 4) == 0
    with pytest.raises(ValueError):
        hsir.resolve_layer(4, 4)


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA check"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                         attn_implementation="sdpa")  # as base.build_model makes it
    return LlamaForCausalLM(config).eval(), tokenizer


def test_indiv_scores_on_a_tiny_model(tiny_model):
    model, tokenizer = tiny_model
    rows = arith.generate(arith.Config(max_operands=4), 4, seed=3)
    prompts = [r["prompt"] for r in rows] * 2
    completions = [r["target"] for r in rows] + \
        [hsir.overthink_target(r["question"], random.Random(i)) for i, r in enumerate(rows)]
    scores = hsir.indiv_scores(model, tokenizer, prompts, completions, batch_size=3)
    assert len(scores) == len(completions) and all(math.isfinite(s) for s in scores)
    assert model.config._attn_implementation == "sdpa"  # switched back after the call
    assert scores == hsir.indiv_scores(model, tokenizer, prompts, completions, batch_size=3)
    # right padding: a row's score does not depend on its batch
    alone = hsir.indiv_scores(model, tokenizer, prompts, completions, batch_size=1)
    assert alone == pytest.approx(scores, abs=1e-4)
    entropy = hsir.indiv_scores(model, tokenizer, prompts, completions, layer="middle",
                                method="spectral_entropy", batch_size=8)
    assert all(0.0 <= s <= 1.0 + 1e-9 for s in entropy)
    assert math.isnan(hsir.indiv_scores(model, tokenizer, ["Q: 1+2=? A:"], [" #### 3"])[0])
    with pytest.raises(ValueError, match="method"):
        hsir.indiv_scores(model, tokenizer, prompts, completions, method="cosine")


def test_calibrate_threshold_drops_the_requested_share():
    scores = [5.0, 1.0, 4.0, 2.0, 3.0]
    tau = hsir.calibrate_threshold(scores, 0.4)
    assert tau == 3.0
    assert hsir.keep_by_indiv(scores, tau) == [True, False, True, False, True]
    assert all(hsir.keep_by_indiv(scores, hsir.calibrate_threshold(scores, 0.0)))
    assert not any(hsir.keep_by_indiv(scores, hsir.calibrate_threshold(scores, 1.0)))
    many = [float(i) for i in range(100)]
    assert hsir.keep_by_indiv(many, hsir.calibrate_threshold(many, 0.3)).count(False) == 30
    assert hsir.calibrate_threshold([float("nan"), 2.0, 1.0], 0.5) == 2.0  # NaN ignored
    assert hsir.keep_by_indiv([float("nan")], -1e9) == [False]


# --- 4. pools and the H-GRPO reward -----------------------------------------------------------

QUESTION = {"easy": "2+3", "hard": "10+5-3+4", "mid": "23+45-17"}
GOLD = {"easy": 5, "hard": 16, "mid": 51}
SAMPLES = [
    {"query_id": "easy", "difficulty": 2, "completion": " 2+3=5 #### 5", "correct": True},
    {"query_id": "easy", "difficulty": 2, "completion": " 2+3=5; check 2+3=5 #### 5",
     "correct": True},
    {"query_id": "easy", "difficulty": 2, "completion": " 2+3=6 #### 6", "correct": False},
    {"query_id": "mid", "difficulty": 3, "completion": " 23+45=68; 68-17=51; 51-1=50 #### 50",
     "correct": False},
    {"query_id": "hard", "difficulty": 4, "completion": " 10+5=16; 16-3=13; 13+4=17 #### 17",
     "correct": False},
]


def test_star_rest_em_and_length_pools():
    star = hsir.star_pool(SAMPLES)
    assert [s["completion"] for s in star] == [" 2+3=5 #### 5", " 2+3=5; check 2+3=5 #### 5"]
    assert {s["source"] for s in star} == {"correct"}
    assert [s["completion"] for s in hsir.rest_em_pool(SAMPLES, 1)] == [" 2+3=5 #### 5"]
    assert len(hsir.rest_em_pool(SAMPLES, 5)) == 2
    assert [s["completion"] for s in hsir.length_filter_pool(SAMPLES, 0.5)] == [" 2+3=5 #### 5"]
    assert len(hsir.length_filter_pool(SAMPLES)) == 1  # round(0.7 * 2) = 1


def test_hsir_pool_arms():
    plain = hsir.hsir_pool(SAMPLES, QUESTION, GOLD, None, tau=0.0, use_veriexit=False,
                           use_indiv=False)
    assert plain == hsir.star_pool(SAMPLES)
    veri = hsir.hsir_pool(SAMPLES, QUESTION, GOLD, None, tau=0.0, use_indiv=False)
    assert [(r["query_id"], r["source"]) for r in veri] == [
        ("easy", "correct"), ("easy", "correct"), ("mid", "veriexit"), ("hard", "veriexit")]
    assert veri[2]["completion"] == " 23+45=68; 68-17=51 #### 51" and veri[2]["faithful"]
    assert veri[3]["completion"] == " 10+5=16 #### 16" and not veri[3]["faithful"]
    assert veri[3]["original_completion"] == SAMPLES[4]["completion"] and veri[3]["correct"]
    # InDiv stand-in: minus the number of re-verification steps
    def indiv_of(rows):
        return [-float(hsir.count_repeats(r["completion"])) for r in rows]

    full = hsir.hsir_pool(SAMPLES, QUESTION, GOLD, indiv_of, tau=-0.5)
    assert [r["completion"] for r in full] == [" 2+3=5 #### 5", " 23+45=68; 68-17=51 #### 51",
                                              " 10+5=16 #### 16"]
    assert [r["indiv"] for r in full] == [0.0, 0.0, 0.0]
    only_indiv = hsir.hsir_pool(SAMPLES, QUESTION, GOLD, indiv_of, tau=-0.5, use_veriexit=False)
    assert [r["completion"] for r in only_indiv] == [" 2+3=5 #### 5"]
    with pytest.raises(ValueError, match="indiv_of"):
        hsir.hsir_pool(SAMPLES, QUESTION, GOLD, None, tau=0.0)


def test_hgrpo_rewards_by_hand():
    s = math.sqrt(2) * 0.2  # z = +-sqrt(2) for InDiv [1, 3, 2, 2]: mean 2, std sqrt(0.5)
    rewards = hsir.hgrpo_rewards([True, True, True, False, True, False, True, False],
                                 [1.0, 3.0, 2.0, 2.0, 5.0, 5.0, 5.0, 5.0], group_size=4)
    assert rewards == pytest.approx([1 - s, 1 + s, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0])  # group 2: std 0
    # bonus only on correct: the wrong response's high InDiv gives it nothing
    assert hsir.hgrpo_rewards([True, False], [1.0, 3.0], 2) == pytest.approx([0.8, 0.0])
    # z over the correct responses only: [1, 3, 2] has std sqrt(2/3)
    z = 1 / math.sqrt(2 / 3)
    assert hsir.hgrpo_rewards([True, True, True, False], [1.0, 3.0, 2.0, 9.0], 4, over="correct") \
        == pytest.approx([1 - 0.2 * z, 1 + 0.2 * z, 1.0, 0.0])
    assert hsir.hgrpo_rewards([True, True], [float("nan"), 1.0], 2) == [1.0, 1.0]
    with pytest.raises(ValueError):
        hsir.hgrpo_rewards([True, True, True], [0.0, 0.0, 0.0], 2)
    with pytest.raises(ValueError):
        hsir.hgrpo_rewards([True], [0.0, 1.0], 1)


def test_length_bonus_by_hand():
    """-w * z_G(length) on correct responses only; wrong ones get no bonus."""
    from stages.hsir.rl import GroupBonus

    bonus = GroupBonus("length", 0.2, 2, "arith").bind(model=None, tokenizer=None)
    out = bonus(prompts=["p"] * 4, completions=[" #### 3", " 1+2=3 #### 3", " #### 3", " #### 4"],
                answer=[3, 3, 3, 3])
    assert out == pytest.approx([0.2, -0.2, 0.0, 0.0])  # group 2: one correct -> z over both
    assert bonus.__name__ == "length_bonus"             # TRL logs rewards/length_bonus/mean


def test_indiv_bonus_reads_the_policy_it_is_bound_to(tiny_model):
    from stages.hsir.rl import GroupBonus
    from stages.train.grpo import PolicyReward

    model, tokenizer = tiny_model
    reward = GroupBonus("indiv", 0.2, 2, "arith")
    assert isinstance(reward, PolicyReward)
    bonus = reward.bind(model, tokenizer)
    comps = [" 1+2=3 #### 3", " 1+2=3; check 1+2=3; check 1+2=3 #### 3"]
    model.train()
    out = bonus(prompts=["Q: 1+2=? A:"] * 2, completions=comps, answer=[3, 3])
    assert model.training                                # its mode is restored
    model.eval()
    assert len(out) == 2 and out[0] == pytest.approx(-out[1]) and abs(out[0]) == pytest.approx(0.2)
