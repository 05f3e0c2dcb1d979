"""Stages `train_structurer` and `train_reader`: the two learned models, tiny Llamas trained from
scratch on the shared SFT engine (stages.train.sft: completion-only loss, AdamW, warm-up then
cosine) over the corpus's word-level tokenizer.

    structurer  prompt `Turn: <user turn or passage>\\nFacts:`, target the paper's structuring
                output for it, `**Statement:** <fact> **Tags:** [...]` or `NONE` (the oracle
                parser's text on the train seeds). The paper prompts Qwen-2.5-32B-Instruct.
    reader      prompt `Memory:\\n<one item a line>\\nQuestion: ...\\nAnswer:`, target the gold
                answer, over the train seeds' memories of the arms `memory` builds there (no
                memory, BM25 chunks, PlugMem over oracle facts with and without reasoning), so
                one reader serves every arm. The paper answers with GPT-4o.

Registered in MLflow as `plugmem-structurer` / `plugmem-reader`, alias `learned`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.core.checks import read_parquet_checked
from stages.plugmem import text
from stages.plugmem.corpus import obs_spec


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["structurer", "reader"]
    hidden_size: int = Field(64, ge=16, le=4096)
    num_layers: int = Field(2, ge=1, le=64)
    num_heads: int = Field(4, ge=1, le=64)
    intermediate_size: int = Field(128, ge=16, le=16384)
    max_positions: int = Field(256, ge=32, le=8192, description="context, tokens")
    steps: int = Field(ge=1, le=1_000_000, description="optimizer steps")
    batch_size: int = Field(16, ge=1, le=4096)
    lr: float = Field(3e-3, gt=0, le=1.0)
    warmup: float = Field(0.05, ge=0, lt=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    log_every: int = Field(50, ge=1)
    num_threads: int = Field(1, ge=0, le=256)
    register_as: str = Field(min_length=1)


def structurer_examples(obs: pl.DataFrame) -> tuple[list[str], list[str]]:
    rows = obs.filter(pl.col("split") == "train").unique("text", keep="first",
                                                          maintain_order=True)
    return ([text.structurer_prompt(t) for t in rows["text"]],
            [" " + o for o in rows["oracle"]])


def reader_examples(contexts: pl.DataFrame) -> tuple[list[str], list[str]]:
    rows = contexts.filter(pl.col("split") == "train")
    return ([text.reader_prompt(json.loads(m), q) for m, q in zip(rows["memory"],
                                                                 rows["question"])],
            [" " + a for a in rows["answer"]])


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import torch
    from transformers import AutoTokenizer

    from stages.agents.imitation import check_examples
    from stages.models import base
    from stages.plugmem.memory import context_spec
    from stages.train.sft import sft

    base.set_threads(cfg.num_threads)
    corpus = ctx.path("plugmem_corpus")
    if cfg.role == "structurer":
        prompts, targets = structurer_examples(read_parquet_checked(corpus / "obs.parquet",
                                                                    obs_spec()))
        out_key = "plugmem_structurer"
    else:
        prompts, targets = reader_examples(read_parquet_checked(
            ctx.path("plugmem_contexts"), context_spec()))
        out_key = "plugmem_reader"
    tokenizer = AutoTokenizer.from_pretrained(str(corpus / "tokenizer"), local_files_only=True)
    torch.manual_seed(ctx.seed)
    model = base.build_model(base.Config(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, max_positions=cfg.max_positions), tokenizer)
    # every example fits the context and has no <unk> (named error before any step)
    longest = check_examples(tokenizer, prompts, targets, cfg.max_positions)
    metrics = sft(model, tokenizer, prompts, targets, steps=cfg.steps, batch_size=cfg.batch_size,
                  lr=cfg.lr, seed=ctx.seed, warmup=cfg.warmup, min_lr_ratio=cfg.min_lr_ratio,
                  log_every=cfg.log_every, log=lambda m, step: ctx.log_metrics(m, step=step))
    model.eval()
    for k in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, k, getattr(tokenizer, k))
    out = ctx.path(out_key)
    io.save_model(model, tokenizer, out)
    n_params = sum(p.numel() for p in model.parameters())
    if ctx.tracker is not None:
        ctx.tracker.register_model(out, cfg.register_as, ["learned"],
                                   tags={"arm": "learned", "role": cfg.role,
                                         "n_params": str(n_params)})
    return {**{k: float(v) for k, v in metrics.items()}, "n_params": float(n_params),
            "examples": float(len(prompts)), "longest_tokens": float(longest)}


def headline(details: dict[str, float]) -> dict[str, float]:
    return {"loss": details["train_loss"], "examples": details["examples"]}
