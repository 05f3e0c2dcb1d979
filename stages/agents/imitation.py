"""Imitation learning: a policy trained on expert trajectories to write the expert's next turn.

Each expert turn is one supervised example: prompt = the episode so far as the agent saw it
(the `prompt` stored with the step, rendered by `react.PromptFormat`), target = the turn the
expert wrote (`Thought: ...` / `Action: <call>`). The loss is next-token cross-entropy on the
target only, `L_IL = -sum log pi(a_i | s_i)` (Early Experience's IL baseline, arXiv
2510.08558 section 2), run by the project's shared SFT engine (`stages.train.sft`: AdamW, warm
up then cosine, completion-only loss), so a paper that adds world-modelling or reflection
examples (same engine, other targets) trains under the same recipe and update count.

By default only successful episodes and turns that parsed and were accepted are imitated
(`only_success`, `skip_failed_turns`): a scripted expert never fails, but a pipeline that
imitates a served model's rollouts would otherwise teach its mistakes.

Checked before any step: every example fits the model's context (the SFT engine would
otherwise cut the target silently) and no character of it maps to the tokenizer's `<unk>` (the
project's character tokenizer has no newline, for instance: use `PromptFormat(sep=" | ")`).

    episodes, steps = read_rollouts("data/agents/expert")
    metrics = train_il(model, tokenizer, episodes, steps, ILConfig(steps=300), seed=0)
"""

from __future__ import annotations

from typing import Any, Callable

import polars as pl
from pydantic import BaseModel, ConfigDict, Field


class ILConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(200, ge=1, le=10_000_000, description="optimizer steps")
    batch_size: int = Field(32, ge=1, le=65_536, description="examples (turns) per step")
    lr: float = Field(2e-3, gt=0, le=1.0, description="peak learning rate (tiny models from "
                      "scratch need ~1e-3)")
    warmup: float = Field(0.05, ge=0, lt=1, description="linear warm-up, fraction of steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr * this")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay")
    only_success: bool = Field(True, description="imitate successful episodes only")
    skip_failed_turns: bool = Field(True, description="leave out turns that did not parse or "
                                    "that the environment refused")
    log_every: int = Field(50, ge=1, description="log the training loss every N steps")


def il_examples(episodes: pl.DataFrame, steps: pl.DataFrame, *, only_success: bool = True,
                skip_failed_turns: bool = True) -> tuple[list[str], list[str]]:
    """(prompts, targets) of the turns to imitate, in episode and step order."""
    keep = episodes.filter(pl.col("success")) if only_success else episodes
    rows = steps.join(keep.select("episode_id"), on="episode_id", how="semi")
    if skip_failed_turns:
        rows = rows.filter((pl.col("parse_error") == "") & (pl.col("invalid_action") == ""))
    rows = rows.sort("episode_id", "step")
    return rows["prompt"].to_list(), rows["turn"].to_list()


def check_examples(tokenizer: Any, prompts: list[str], targets: list[str],
                   max_len: int) -> int:
    """Raise ValueError on an example longer than `max_len` tokens or with characters the
    tokenizer maps to <unk>; returns the longest length. Lengths are counted as training
    encodes the example (`stages.models.base.encode_sft_rows`: `<bos> prompt`, then
    `target <eos>`, each encoded apart): a subword tokenizer can spell the two apart in more
    tokens than the text glued together, and training would cut the difference silently."""
    from stages.models.base import encode_sft_rows

    if not prompts:
        raise ValueError("imitation learning: no example to train on (no successful episode, "
                         "or every turn failed)")
    unk = tokenizer.unk_token_id
    longest = 0
    rows = encode_sft_rows(tokenizer, prompts, targets, max_len=1 << 30)   # nothing cut
    for k, (p, t, row) in enumerate(zip(prompts, targets, rows, strict=True)):
        n = len(row["input_ids"])
        longest = max(longest, n)
        if n > max_len:
            raise ValueError(f"imitation example {k} is {n} tokens, over the model's context of "
                             f"{max_len}: shorten prompts (PromptFormat.window / "
                             f"max_prompt_chars) or use a longer model. Prompt: {p[:120]!r}")
        if unk is not None and unk in row["input_ids"]:
            chars = set()
            for text in (p, t):
                enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
                chars |= {text[a:b] for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
                          if i == unk}
            raise ValueError(f"imitation example {k}: characters {sorted(chars)} are not in the "
                             "tokenizer's vocabulary (they would train as <unk>); e.g. use "
                             "PromptFormat(sep=' | ') for a tokenizer without a newline")
    return longest


def train_il(model: Any, tokenizer: Any, episodes: pl.DataFrame, steps: pl.DataFrame,
             cfg: ILConfig, *, seed: int,
             log: Callable[[dict[str, float], int], None] | None = None) -> dict[str, float]:
    """Imitation-train `model` in place on the trajectories; returns the SFT engine's metrics
    plus `il_examples` and `il_episodes`."""
    from stages.train.sft import sft

    prompts, targets = il_examples(episodes, steps, only_success=cfg.only_success,
                                   skip_failed_turns=cfg.skip_failed_turns)
    max_len = getattr(model.config, "max_position_embeddings", 256)
    longest = check_examples(tokenizer, prompts, targets, max_len)
    metrics = sft(model, tokenizer, prompts, targets, steps=cfg.steps,
                  batch_size=cfg.batch_size, lr=cfg.lr, seed=seed, warmup=cfg.warmup,
                  min_lr_ratio=cfg.min_lr_ratio, weight_decay=cfg.weight_decay,
                  log_every=cfg.log_every, log=log)
    used = episodes.filter(pl.col("success")).height if cfg.only_success else episodes.height
    return {**metrics, "il_examples": float(len(prompts)), "il_episodes": float(used),
            "il_longest_tokens": float(longest)}
