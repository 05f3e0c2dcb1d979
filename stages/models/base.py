"""Stage `base`: the tiny Llama-style base model, trained from scratch by SFT on the task data.

What it does: builds a small `LlamaConfig` decoder over the character tokenizer and trains it on
train-split `prompt + target + <eos>` with the loss on the completion only (prompt tokens carry
label -100), then saves it with `save_pretrained` (safetensors) beside the tokenizer, so every
later paper loads it with `AutoModelForCausalLM.from_pretrained` like any Hugging Face model.
At the `gpu` profile `init: pretrained` fine-tunes a local Hugging Face model folder instead
(`pretrained_path`; never downloaded, loaded with `local_files_only=True`).

Engine: the transformers `Trainer` with a small completion-only collator, not TRL's
`SFTTrainer`. Both run the same loop (SFTTrainer subclasses Trainer); SFTTrainer adds a
`datasets` tokenisation pass, chat-template/packing logic and bf16/gradient-checkpointing
defaults that are wrong on CPU. Our rows are already split into prompt and completion, and
pre-tokenising them by hand is one list comprehension, so the plain Trainer is the shorter path
with the same speed per step (measured, see benchmarks/RESULTS.md "Base model"). Batches are
grouped by length (`train_sampling_strategy=group_by_length`): 2-operand rows are half as long
as 4-operand rows, and padding a random batch to its longest row wastes ~35% of the compute.

Why the recipe learns in minutes on 2 cores (cpu profile): a wide-enough model (d=256, 4
layers, ~3M params) at a high peak learning rate (2e-3, AdamW, beta2=0.98) with short warmup
and cosine decay to 10%; every step of the worked target is itself one 2-operand operation,
so a 4-operand row teaches three operations. Tiny models need lr ~1e-3, not the 2e-5 that the
SFT defaults use (STACK.md: 82% on 2-operand addition after 229 s at default settings).

    python -m stages base base                        # profile from params.yaml
    dvc exp run -S profile=smoke                      # seconds: proves the wiring
    dvc exp run -S profile=gpu -S profiles.gpu.base.init=pretrained \\
        -S profiles.gpu.base.pretrained_path=/models/Qwen2.5-0.5B   # a local HF folder
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: str = Field("arith", description="task family whose train split is the SFT data")
    init: Literal["scratch", "pretrained"] = Field(
        "scratch", description="scratch: a new Llama-style model over the char tokenizer; "
                               "pretrained: fine-tune the local HF model at `pretrained_path`")
    pretrained_path: str | None = Field(
        None, description="local folder of a Hugging Face causal LM (with its tokenizer) used "
                          "when init=pretrained; never a hub id, nothing is downloaded")
    # Model size (init=scratch).
    hidden_size: int = Field(64, ge=16, le=4096, description="model width d")
    num_layers: int = Field(2, ge=1, le=64, description="decoder layers")
    num_heads: int = Field(4, ge=1, le=64, description="attention heads (divides hidden_size)")
    intermediate_size: int = Field(128, ge=16, le=16384, description="SwiGLU MLP width")
    max_positions: int = Field(256, ge=32, le=8192, description="max sequence length, tokens")
    # Optimisation.
    steps: int = Field(20, ge=1, le=1_000_000, description="optimizer steps")
    batch_size: int = Field(16, ge=1, le=4096, description="sequences per optimizer step")
    lr: float = Field(2e-3, gt=0, le=1.0, description="peak learning rate")
    warmup: float = Field(0.03, ge=0, lt=1, description="linear warmup, fraction of `steps`")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr * this")
    weight_decay: float = Field(0.01, ge=0, le=1, description="AdamW weight decay")
    adam_beta2: float = Field(0.98, gt=0, lt=1, description="AdamW beta2")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    pack_length: int = Field(0, ge=0, le=8192,
                             description="pack examples into rows of this many tokens, each "
                                         "attending only to itself (0: one padded example per row)")
    group_by_length: bool = Field(False, description="batch examples of similar length; less "
                                                     "padding but much slower learning here")
    max_train_rows: int | None = Field(None, ge=1, description="use at most this many train rows")
    # Bookkeeping.
    log_every: int = Field(50, ge=1, description="log training loss every N steps")
    num_threads: int = Field(0, ge=0, le=256,
                             description="torch CPU threads; 0 = all cores this process may use")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.init == "pretrained" and not self.pretrained_path:
            raise ValueError("init=pretrained needs pretrained_path (a local model folder)")
        if self.init == "scratch" and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_heads {self.num_heads}")
        return self


# --- data -----------------------------------------------------------------------------------

def encode_sft_rows(tokenizer: Any, prompts: list[str], targets: list[str],
                    max_len: int) -> list[dict[str, list[int]]]:
    """`<bos> prompt` (label -100) + `target <eos>` (labelled): completion-only SFT examples."""
    p_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    t_ids = tokenizer(targets, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    rows = []
    for p, t in zip(p_ids, t_ids):
        ids = (p + t + [eos])[:max_len]
        labels = ([-100] * len(p) + t + [eos])[:max_len]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


class CompletionCollator:
    """Right-pads a batch: pad id in inputs, 0 in the attention mask, -100 in the labels."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pack_rows(rows: list[dict[str, list[int]]], pack_length: int,
              pad_id: int) -> list[dict[str, list[int]]]:
    """Best-fit pack examples into rows of at most `pack_length` tokens.

    Each packed row carries `position_ids` that restart at 0 for every example; transformers
    turns such restarts into a block-diagonal causal mask (`find_packed_sequence_indices`), so
    an example attends only to itself and the packed batch computes exactly the per-example
    losses of the unpacked one, without the padding. The first token of each example is its
    `<bos>` with label -100, so no loss crosses an example boundary.
    """
    too_long = max(len(r["input_ids"]) for r in rows)
    if too_long > pack_length:
        raise ValueError(f"pack_length = {pack_length}: shorter than the longest example "
                         f"({too_long} tokens)")
    bins: list[list[int]] = []                       # example indices per packed row
    free: list[list[int]] = [[] for _ in range(pack_length + 1)]  # room -> open bins
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        room = next((c for c in range(n, pack_length + 1) if free[c]), None)
        if room is None:
            bins.append([])
            b, room = len(bins) - 1, pack_length
        else:
            b = free[room].pop()
        bins[b].append(i)
        free[room - n].append(b)
    packed = []
    for members in bins:
        ids, labels, pos = [], [], []
        for i in members:
            ids += rows[i]["input_ids"]
            labels += rows[i]["labels"]
            pos += list(range(len(rows[i]["input_ids"])))
        packed.append({"input_ids": ids, "labels": labels, "position_ids": pos})
    return packed


class PackedCollator:
    """Right-pads packed rows; the padding is one more 'example' whose labels are -100.

    No attention mask is passed: with `position_ids` alone transformers builds the packed
    (block-diagonal causal) mask."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        pos = torch.arange(width, dtype=torch.long).repeat(len(rows), 1)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            pos[i, :n] = torch.tensor(r["position_ids"])
            pos[i, n:] = torch.arange(width - n)
        return {"input_ids": ids, "labels": labels, "position_ids": pos}


def completion_loss(model: Any, rows: list[dict[str, list[int]]], pad_id: int,
                    batch_size: int = 128) -> float:
    """Mean per-token cross-entropy on the labelled (completion) tokens, no gradient."""
    import torch

    collate = CompletionCollator(pad_id)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = {k: v.to(model.device) for k, v in collate(rows[i:i + batch_size]).items()}
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                ignore_index=-100, reduction="sum")
            total += loss.item()
            count += int((labels != -100).sum())
    return total / max(count, 1)


# --- model ----------------------------------------------------------------------------------

def build_model(cfg: Config, tokenizer: Any) -> Any:
    """A fresh Llama-style decoder sized by `cfg` (tied embeddings, SDPA attention, no dropout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions, rope_theta=10000.0,
        tie_word_embeddings=True, attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def load_pretrained(path: str) -> tuple[Any, Any]:
    """A local HF causal LM and its tokenizer (pad := eos when it has none); offline only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"base.pretrained_path = {path!r}: no config.json there; expected "
                                f"a local Hugging Face model folder (nothing is downloaded)")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    return model, tokenizer


def set_threads(num_threads: int) -> int:
    """Use every core this process may run on (2 here) unless told otherwise."""
    import os

    import torch

    n = num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


# --- training -------------------------------------------------------------------------------

def train(cfg: Config, model: Any, tokenizer: Any, rows: list[dict[str, list[int]]],
          seed: int, ctx: Any = None, output_dir: str | Path | None = None) -> dict[str, float]:
    """SFT `model` in place on pre-encoded rows with the HF Trainer; returns timing metrics."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class ForwardLogs(TrainerCallback):
        """Trainer logs (loss, lr, grad norm) -> MLflow through the stage context."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if ctx is not None and logs:
                vals = {f"train/{k}": float(v) for k, v in logs.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)}
                ctx.log_metrics(vals, step=state.global_step)

    with tempfile.TemporaryDirectory(prefix="paperline-base-") as scratch:
        if cfg.pack_length:
            dataset = pack_rows(rows, cfg.pack_length, tokenizer.pad_token_id)
            collator: Any = PackedCollator(tokenizer.pad_token_id)
            # `batch_size` counts examples: take as many packed rows as hold that many.
            per_row = len(rows) / len(dataset)
            per_step = max(1, round(cfg.batch_size / per_row))
        else:
            dataset, collator, per_step = rows, CompletionCollator(tokenizer.pad_token_id), cfg.batch_size
        model.config.use_cache = False  # no KV cache in training (and packed masks need none)
        args = TrainingArguments(
            output_dir=str(output_dir or scratch), max_steps=cfg.steps,
            per_device_train_batch_size=per_step, learning_rate=cfg.lr,
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": cfg.min_lr_ratio},
            warmup_steps=cfg.warmup, weight_decay=cfg.weight_decay, adam_beta2=cfg.adam_beta2,
            max_grad_norm=cfg.max_grad_norm, optim="adamw_torch",
            train_sampling_strategy="group_by_length" if cfg.group_by_length else "random",
            logging_steps=cfg.log_every, save_strategy="no", report_to="none",
            use_cpu=not torch.cuda.is_available(), bf16=False,
            seed=seed, data_seed=seed, dataloader_pin_memory=False, remove_unused_columns=False,
            disable_tqdm=False)
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                          callbacks=[ForwardLogs()])
        started = time.perf_counter()
        result = trainer.train()
        seconds = time.perf_counter() - started
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tail = losses[-max(1, len(losses) // 10):] or [float("nan")]
    # Tokens actually fed (padding excluded) over the steps taken: rows are drawn uniformly.
    mean_len = sum(len(r["input_ids"]) for r in dataset) / len(dataset)
    tokens = mean_len * per_step * result.global_step
    model.config.use_cache = True
    return {"train_loss": sum(tail) / len(tail), "train_seconds": seconds,
            "train_steps": float(result.global_step), "train_tokens": tokens,
            "train_tokens_per_s": tokens / seconds,
            "epochs": per_step * result.global_step / len(dataset)}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.tasks import load_split
    import polars as pl
    from transformers import AutoTokenizer, set_seed

    threads = set_threads(cfg.num_threads)
    set_seed(ctx.seed)
    tasks = ctx.path("tasks") / cfg.family
    # Inputs validated at the stage boundary (great-expectations suite of the family).
    train_df = load_split(ctx.path("tasks"), cfg.family, "train").select("prompt", "target")
    if cfg.max_train_rows:
        train_df = train_df.head(cfg.max_train_rows)
    val_path = tasks / "val.parquet"
    val_df = (load_split(ctx.path("tasks"), cfg.family, "val").select("prompt", "target")
              if val_path.is_file() else None)

    if cfg.init == "pretrained":
        model, tokenizer = load_pretrained(cfg.pretrained_path or "")
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(ctx.path("tokenizer")), local_files_only=True)
        model = build_model(cfg, tokenizer)
    max_len = getattr(model.config, "max_position_embeddings", cfg.max_positions)
    rows = encode_sft_rows(tokenizer, train_df["prompt"].to_list(), train_df["target"].to_list(),
                           max_len)
    n_params = sum(p.numel() for p in model.parameters())
    ctx.log_params({"n_params": n_params, "threads": threads, "train_rows": len(rows)})
    print(f"base: {cfg.init} model, {n_params / 1e6:.2f}M params, {len(rows)} train rows, "
          f"{cfg.steps} steps x {cfg.batch_size}, {threads} threads")

    metrics = train(cfg, model, tokenizer, rows, ctx.seed, ctx)
    if val_df is not None:
        val_rows = encode_sft_rows(tokenizer, val_df["prompt"].to_list(),
                                   val_df["target"].to_list(), max_len)
        metrics["val_loss"] = completion_loss(model, val_rows, tokenizer.pad_token_id)

    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    out = ctx.path("base_model")
    io.save_model(model, tokenizer, out)
    metrics["n_params"] = float(n_params)
    metrics["train_rows"] = float(len(rows))
    if ctx.tracker is not None:
        ctx.tracker.register_model(
            out, "base-arith", ["candidate", "champion"],
            tags={"init": cfg.init, "family": cfg.family,
                  "n_params": str(n_params), "val_loss": f"{metrics.get('val_loss', math.nan):.4f}"})
    return metrics
