"""Batched generation helpers and the pass@k / accuracy arithmetic of the evaluate stage."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from stages.evaluate.accuracy import Config as EvalConfig
from stages.evaluate.accuracy import pass_at_k, summarise
from stages.models import base
from stages.models.generate import default_device, generate, load_model
from stages.models.tokenizer import build_tokenizer

PROMPTS = [f"Q: {a}+{b}=? A:" for a, b in [(1, 2), (13, 4), (7, 70), (22, 9), (5, 5)]]
ANSWER = " ok"  # every prompt is trained to answer exactly this, then <eos>


# --- pass@k: hand-computed from 1 - C(n-c, k) / C(n, k) --------------------------------------

@pytest.mark.parametrize("n, c, k, expected", [
    (8, 0, 1, 0.0),
    (8, 8, 4, 1.0),
    (8, 1, 1, 1 / 8),
    (8, 3, 1, 3 / 8),                # pass@1 is the fraction correct
    (8, 2, 4, 1 - 15 / 70),          # C(6,4)=15, C(8,4)=70
    (5, 2, 2, 1 - 3 / 10),           # C(3,2)=3,  C(5,2)=10
    (8, 5, 4, 1.0),                  # fewer than k wrong samples: some k-subset is all correct
    (10, 1, 10, 1.0),
    (100, 1, 4, 0.04),               # 1 - C(99,4)/C(100,4) = 4/100
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_summarise_by_difficulty():
    metrics, plot = summarise(
        difficulty=[2, 2, 3, 3], greedy=[True, False, False, False],
        sampled=[[True, True], [False, False], [True, False], [False, False]], pass_k=[1, 2])
    assert metrics["greedy_acc"] == 0.25 and metrics["greedy_acc_d2"] == 0.5
    assert metrics["greedy_acc_d3"] == 0.0
    assert metrics["pass@1_d2"] == 0.5 and metrics["pass@2_d3"] == 0.5
    assert metrics["pass@2"] == pytest.approx((1 + 0 + 1 + 0) / 4)
    assert [r["difficulty"] for r in plot] == ["2", "3", "all"]
    assert plot[0] == {"difficulty": "2", "n": 2, "greedy_acc": 0.5, "pass_at_1": 0.5,
                       "pass_at_2": 0.5}


def test_pass_k_larger_than_samples_is_a_config_error():
    with pytest.raises(ValueError, match="pass_k"):
        EvalConfig(num_samples=4, pass_k=[1, 8])


# --- generation on a tiny model trained to answer " ok<eos>" -----------------------------------

def train_ok_model(folder) -> Any:
    """A tiny model trained (HF Trainer; on the GPU where one is visible) to answer " ok<eos>"
    to every prompt, saved to `folder`; returns the trained model."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer(set("0123456789+-=;#?:QA ok"))
    cfg = base.Config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_positions=64, steps=60, batch_size=5, lr=1e-2, warmup=0.0,
                      log_every=30, group_by_length=False)
    model = base.build_model(cfg, tokenizer)
    rows = base.encode_sft_rows(tokenizer, PROMPTS, [ANSWER] * len(PROMPTS), max_len=64)
    base.train(cfg, model, tokenizer, rows, seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen-model")
    train_ok_model(folder)
    return load_model(folder)


def test_greedy_stops_at_eos_and_is_deterministic(trained):
    model, tokenizer = trained
    first = generate(model, tokenizer, PROMPTS, max_new_tokens=40, batch_size=2)
    assert first == [[ANSWER]] * len(PROMPTS)  # would run on for 40 tokens without the stop
    assert generate(model, tokenizer, PROMPTS, max_new_tokens=40, batch_size=8) == first


def test_sampling_returns_num_samples_per_prompt_in_prompt_order(trained):
    model, tokenizer = trained
    prompts = PROMPTS + ["Q: 1+1=? A:"]  # a shorter prompt: sorted by length internally
    out = generate(model, tokenizer, prompts, max_new_tokens=6, do_sample=True,
                   temperature=1.5, num_samples=3, batch_size=7, seed=3)
    assert len(out) == len(prompts) and all(len(s) == 3 for s in out)
    assert all(isinstance(t, str) and "<eos>" not in t and "<pad>" not in t
               for s in out for t in s)
    again = generate(model, tokenizer, prompts, max_new_tokens=6, do_sample=True,
                     temperature=1.5, num_samples=3, batch_size=7, seed=3)
    assert again == out
    state = torch.get_rng_state()
    generate(model, tokenizer, prompts[:1], max_new_tokens=2, do_sample=True, seed=9)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left alone


def test_greedy_with_several_samples_repeats_the_one_answer(trained):
    model, tokenizer = trained
    out = generate(model, tokenizer, PROMPTS[:2], max_new_tokens=10, num_samples=4)
    assert out == [[ANSWER] * 4] * 2
    assert generate(model, tokenizer, [], max_new_tokens=4) == []


def test_models_load_on_the_device_asked_for(trained, tmp_path, monkeypatch):
    # $PAPERLINE_DEVICE wins; without it a visible GPU is used (none here: the CPU)
    monkeypatch.setenv("PAPERLINE_DEVICE", "meta")
    assert default_device() == "meta"
    model, tokenizer = trained
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert load_model(tmp_path)[0].device.type == "meta"
    assert load_model(tmp_path, device="cpu")[0].device.type == "cpu"
    monkeypatch.delenv("PAPERLINE_DEVICE")
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
