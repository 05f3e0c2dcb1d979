"""Stage `policy` of the TRACE pipeline: the chain-of-thought generators the metric is tested on.

Spec §4 "CoT generator": a tiny decoder trained on templated arithmetic CoTs that mix
well-structured traces with poorly structured ones; the share of poorly structured training data
and the training step give the "models" of the correlation study (the paper: 7 reasoning
models). Each mix `d` fine-tunes the shared base model (arith, stages/models/base.py `train`, the
same SFT recipe) on one trace per SFT problem, poorly structured with probability d (a uniformly
drawn kind), good otherwise; a checkpoint is saved after each of `checkpoints` cumulative steps
(constant learning rate after warm-up, so a checkpoint is simply an earlier point of the run).

    <out>/<condition>/            save_pretrained folders, condition = d<share%>_s<steps>
    <out>/conditions.json         [{condition, mix, steps, path}]

    python -m stages trace policy
"""

from __future__ import annotations

import random
import time
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io
from stages.core.checks import read_parquet_checked, spec_from_schema
from stages.trace.corpus import SFT_SCHEMA


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("base_model", description="paths key of the starting model folder")
    corpus: str = Field("corpus", description="paths key of the corpus folder (sft.parquet)")
    out: str = Field("policies", description="paths key of the output folder")
    mixes: list[float] = Field([0.1, 0.5, 0.9], min_length=1,
                               description="shares of poorly structured training traces")
    checkpoints: list[int] = Field([50, 200], min_length=1,
                                   description="cumulative SFT steps at which to save")
    batch_size: int = Field(32, ge=1, le=4096)
    lr: float = Field(1e-3, gt=0, le=1)
    warmup: float = Field(0.05, ge=0, lt=1, description="warm-up, fraction of the first chunk")
    weight_decay: float = Field(0.01, ge=0, le=1)
    num_threads: int = Field(0, ge=0, le=256, description="torch threads (0: all cores)")

    @field_validator("mixes")
    @classmethod
    def _shares(cls, value: list[float]) -> list[float]:
        if any(not 0 <= v <= 1 for v in value) or len(set(value)) != len(value):
            raise ValueError(f"mixes {value}: distinct shares in [0, 1] expected")
        return value

    @field_validator("checkpoints")
    @classmethod
    def _increasing(cls, value: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(value, value[1:])) or value[0] < 1:
            raise ValueError(f"checkpoints {value}: strictly increasing positive steps expected")
        return value


def condition_name(mix: float, steps: int) -> str:
    return f"d{round(mix * 100):02d}_s{steps}"


def mix_rows(sft: pl.DataFrame, share: float, seed: int) -> pl.DataFrame:
    """One trace per problem: a poorly structured kind with probability `share`, else good."""
    rng = random.Random(f"trace:mix:{share}:{seed}")
    by_id = sft.partition_by("id", as_dict=True, maintain_order=True)
    picks = []
    for (pid,), group in by_id.items():
        kinds = group["kind"].to_list()
        bad = [i for i, k in enumerate(kinds) if k != "good"]
        good = [i for i, k in enumerate(kinds) if k == "good"]
        idx = rng.choice(bad) if (rng.random() < share and bad) or not good else good[0]
        picks.append(group.row(idx, named=True))
    return pl.DataFrame(picks, schema=sft.schema)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from transformers import set_seed

    from stages.models import base
    from stages.models.generate import load_model

    threads = base.set_threads(cfg.num_threads)
    sft = read_parquet_checked(ctx.path(cfg.corpus) / "sft.parquet", spec_from_schema(SFT_SCHEMA))
    out = ctx.path(cfg.out)
    conditions, metrics = [], {}
    with io.atomic_path(out, is_dir=True) as tmp:
        for mix in cfg.mixes:
            set_seed(ctx.seed)
            model, tokenizer = load_model(ctx.path(cfg.model))
            model.train()
            rows_df = mix_rows(sft, mix, ctx.seed)
            max_len = model.config.max_position_embeddings
            rows = base.encode_sft_rows(tokenizer, rows_df["prompt"].to_list(),
                                        rows_df["target"].to_list(), max_len)
            done, started = 0, time.perf_counter()
            for k, steps in enumerate(cfg.checkpoints):
                bcfg = base.Config(steps=steps - done, batch_size=cfg.batch_size, lr=cfg.lr,
                                   warmup=cfg.warmup if k == 0 else 0.0, min_lr_ratio=1.0,
                                   weight_decay=cfg.weight_decay, log_every=max(1, steps - done))
                got = base.train(bcfg, model, tokenizer, rows, ctx.seed + k)
                done = steps
                name = condition_name(mix, steps)
                model.eval()
                model.generation_config.pad_token_id = tokenizer.pad_token_id
                io.save_model(model, tokenizer, tmp / name)
                model.train()
                conditions.append({"condition": name, "mix": mix, "steps": steps})
                metrics[f"{name}/train_loss"] = got["train_loss"]
                ctx.log_metrics({f"{name}/train_loss": got["train_loss"]})
            metrics[f"d{round(mix * 100):02d}/seconds"] = time.perf_counter() - started
            metrics[f"d{round(mix * 100):02d}/good_share"] = float(
                (rows_df["kind"] == "good").mean())
        io.write_json(tmp / "conditions.json", conditions)
    metrics["conditions"] = float(len(conditions))
    metrics["threads"] = float(threads)
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the number of generator conditions; per-condition training in
    details/policy.json."""
    return {k: metrics[k] for k in ("conditions",) if k in metrics}
