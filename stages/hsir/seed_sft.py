"""Stage `seed_sft` of HSIR: theta_0, a model that sometimes overthinks (spec §4 "Seed data").

The paper starts self-improvement from a model SFT'd on long chains of thought distilled from
DeepSeek-R1, verbose and often repetitive. Here the shared base model is fine-tuned on the shared
train split, where `frac_verbose` of the targets are overthinking traces: the concise solution
plus 2-4 re-verification steps ("check 68-17=51", `stages.hsir.hsir.seed_rows`). The answer is
unchanged, so every trace is correct; only its length and redundancy vary. The model thus learns
to re-verify some of the time, which is what InDiv and the length filter should remove.

Metrics (held-out shared test split): greedy accuracy and the share of greedy outputs that
re-verify at least once; the same for one sample per prompt at temperature 1 (what the
self-training rounds see).

    python -m stages hsir seed_sft
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: Literal["arith"] = Field("arith", description="task family of the seed traces")
    frac_verbose: float = Field(0.5, ge=0, le=1, description="share of overthinking targets")
    repeats: tuple[int, int] = Field((2, 4), description="re-verification steps per verbose "
                                                         "target, uniform in [low, high]")
    steps: int = Field(300, ge=1, le=1_000_000, description="SFT optimizer steps")
    batch_size: int = Field(32, ge=1, le=8192, description="rows per step")
    lr: float = Field(5e-4, gt=0, le=1, description="peak learning rate")
    warmup: float = Field(0.03, ge=0, lt=1, description="linear warmup, share of steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr * this")
    weight_decay: float = Field(0.01, ge=0, le=1, description="AdamW weight decay")
    max_train_rows: int | None = Field(None, ge=1, description="use at most this many rows")
    eval_rows: int = Field(200, ge=1, description="held-out test prompts evaluated")
    max_new_tokens: int = Field(128, ge=1, le=32768, description="generation budget, tokens")
    eval_batch_size: int = Field(256, ge=1, le=65536, description="sequences decoded together")
    model: str = Field("base_model", description="paths key of the model fine-tuned")
    out: str = Field("seed_model", description="paths key of the output model folder")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: all cores)")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        lo, hi = self.repeats
        if not 0 <= lo <= hi:
            raise ValueError(f"repeats = {self.repeats}: expected 0 <= low <= high")
        return self


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from transformers import set_seed

    from stages.models.base import set_threads
    from stages.models.generate import generate, load_model
    from stages.tasks import get_family, load_split
    from stages.hsir import hsir
    from stages.hsir.self_improve import greedy_eval
    from stages.train.sft import sft

    set_threads(cfg.num_threads)
    set_seed(ctx.seed)
    train = load_split(ctx.path("tasks"), cfg.family, "train").to_dicts()
    if cfg.max_train_rows:
        train = train[:cfg.max_train_rows]
    rows = hsir.seed_rows(train, cfg.frac_verbose, ctx.seed, cfg.repeats)
    test = load_split(ctx.path("tasks"), cfg.family, "test").to_dicts()[:cfg.eval_rows]
    model, tokenizer = load_model(ctx.path(cfg.model))
    metrics = sft(model, tokenizer, [r["prompt"] for r in rows], [r["target"] for r in rows],
                  steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, seed=ctx.seed,
                  warmup=cfg.warmup, min_lr_ratio=cfg.min_lr_ratio,
                  weight_decay=cfg.weight_decay, log_every=max(1, cfg.steps // 20),
                  log=ctx.log_metrics)
    metrics["seed_rows"] = float(len(rows))
    metrics["seed_verbose_share"] = sum(r["n_repeats"] > 0 for r in rows) / len(rows)
    metrics.update({f"greedy_{k}": v for k, v in greedy_eval(
        model, tokenizer, test, cfg.family, cfg.max_new_tokens, cfg.eval_batch_size).items()})
    fam = get_family(cfg.family)
    sampled = [o[0] for o in generate(model, tokenizer, [r["prompt"] for r in test],
                                      max_new_tokens=cfg.max_new_tokens, do_sample=True,
                                      temperature=1.0, batch_size=cfg.eval_batch_size,
                                      seed=ctx.seed)]
    metrics["sampled_acc"] = sum(fam.verify_answer(r, o) for r, o in zip(test, sampled)) / len(test)
    metrics["sampled_verbose_share"] = sum(hsir.count_repeats(o) > 0 for o in sampled) / len(test)
    model.eval()
    io.save_model(model, tokenizer, ctx.path(cfg.out))
    return {k: float(v) for k, v in metrics.items() if v == v}  # NaN (nothing solved) left out


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the seed model's greedy and sampled accuracy; verbosity and the training
    record in details/seed_sft.json."""
    return {k: metrics[k] for k in ("greedy_acc", "sampled_acc") if k in metrics}
