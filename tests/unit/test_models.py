"""Char tokenizer, tiny Llama base model: training really moves it, saving really round-trips."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages.core.config import ParamsError, validate_section
from stages.models import base
from stages.models.tokenizer import build_tokenizer

CHARS = set("0123456789+-=;#?:QA ")
PROMPTS = [f"Q: {a}+{b}=? A:" for a, b in [(1, 2), (13, 4), (7, 70), (22, 9), (5, 5), (40, 1)]]
TARGETS = [f" {a}+{b}={a + b} #### {a + b}" for a, b in [(1, 2), (13, 4), (7, 70), (22, 9),
                                                          (5, 5), (40, 1)]]


def tiny_cfg(**kw) -> base.Config:
    values = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                  max_positions=64, steps=12, batch_size=6, lr=1e-2, warmup=0.0,
                  log_every=4, group_by_length=False)
    values.update(kw)
    return base.Config(**values)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(CHARS)


def test_tokenizer_is_one_token_per_character_and_reloads_offline(tokenizer, tmp_path):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    text = "Q: 23+45-17=? A: 23+45=68; 68-17=51 #### 51"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer("x", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]
    tokenizer.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again(text)["input_ids"] == ids
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)


def test_sft_rows_label_only_the_completion_and_eos(tokenizer):
    (row,) = base.encode_sft_rows(tokenizer, ["Q: 1+2=? A:"], [" 1+2=3 #### 3"], max_len=64)
    n_prompt = len("Q: 1+2=? A:") + 1  # + <bos>
    assert row["labels"][:n_prompt] == [-100] * n_prompt
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    batch = base.CompletionCollator(tokenizer.pad_token_id)([row, {"input_ids": [1, 5],
                                                                   "labels": [-100, 5]}])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["attention_mask"][1].tolist() == [1, 1] + [0] * (len(row["input_ids"]) - 2)
    assert (batch["labels"][1, 2:] == -100).all()


def test_packed_rows_compute_exactly_the_per_example_loss(tokenizer):
    """Packing relies on transformers turning position_ids restarts into a block-diagonal
    mask (only without a KV cache); if that ever changes, examples would see each other."""
    torch.manual_seed(0)
    model = base.build_model(tiny_cfg(), tokenizer)
    model.config.use_cache = False
    rows = base.encode_sft_rows(tokenizer, PROMPTS * 3, TARGETS * 3, max_len=64)
    packed = base.pack_rows(rows, 100, tokenizer.pad_token_id)
    assert sum(len(r["input_ids"]) for r in packed) == sum(len(r["input_ids"]) for r in rows)
    assert len(packed) < len(rows) and max(len(r["input_ids"]) for r in packed) <= 100
    with torch.no_grad():
        loss_packed = model(**base.PackedCollator(tokenizer.pad_token_id)(packed)).loss
        loss_padded = model(**base.CompletionCollator(tokenizer.pad_token_id)(rows)).loss
    assert loss_packed.item() == pytest.approx(loss_padded.item(), rel=1e-5)
    with pytest.raises(ValueError, match="pack_length"):
        base.pack_rows(rows, 10, tokenizer.pad_token_id)


def test_training_changes_every_parameter_and_lowers_the_loss(tokenizer):
    torch.manual_seed(0)
    cfg = tiny_cfg()
    model = base.build_model(cfg, tokenizer)
    rows = base.encode_sft_rows(tokenizer, PROMPTS, TARGETS, max_len=64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss_before = base.completion_loss(model, rows, tokenizer.pad_token_id)
    metrics = base.train(cfg, model, tokenizer, rows, seed=0)
    loss_after = base.completion_loss(model, rows, tokenizer.pad_token_id)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(before[n], p.detach())]
    assert unchanged == []
    assert loss_after < 0.7 * loss_before
    assert metrics["train_steps"] == cfg.steps and metrics["train_tokens_per_s"] > 0


def test_save_pretrained_round_trip_gives_identical_logits(tokenizer, tmp_path):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    torch.manual_seed(1)
    model = base.build_model(tiny_cfg(), tokenizer).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    again = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    batch = AutoTokenizer.from_pretrained(tmp_path)(PROMPTS[:3], padding=True,
                                                    return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, again(**batch).logits)


def test_config_fails_early_with_the_key_named():
    with pytest.raises(ParamsError, match="pretrained_path"):
        validate_section(base.Config, {"base": {"init": "pretrained"}}, "base", "gpu", "p.yaml")
    with pytest.raises(ParamsError, match="not divisible"):
        validate_section(base.Config, {"base": {"hidden_size": 30, "num_heads": 4}}, "base",
                         "cpu", "p.yaml")
    with pytest.raises(ParamsError, match="base.lr"):
        validate_section(base.Config, {"base": {"lr": -1}}, "base", "cpu", "p.yaml")


def test_pretrained_init_never_reaches_for_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        base.load_pretrained(str(tmp_path / "Qwen2.5-0.5B"))
