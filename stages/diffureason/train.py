"""Stage `train` of DiffuReason: per training seed, the tiny diffusion LM and its
autoregressive twin, on the same train problems.

- `mdlm/`: a bidirectional `BertForMaskedLM` (`stages.models.mdlm`) trained with the LLaDA
  objective (t ~ U(0, 1], response tokens masked with probability t, loss on the masked tokens
  weighted 1/t) on fixed-length `<bos> prompt | response <eos>...` rows.
- `ar/`: the Llama twin at the same width, depth and heads, completion-only SFT
  (`stages.train.sft`) on `<bos> prompt` -> `response <eos>`, the same steps, batch and lr.

Both are saved with `save_pretrained` (safetensors) under `models/seed<k>/` and registered in
MLflow as `diffureason-mdlm` / `diffureason-ar` with alias `seed<k>`. Greedy accuracy of each
on the validation split (vanilla block decoding for the diffusion LM) is reported, so a model
that learned nothing is visible before any search.

    python -m stages diffureason train
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.models.mdlm import Config as ModelConfig


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seeds: list[int] = Field([0, 1, 2], min_length=1, description="training seeds [issue: 3]")
    model: ModelConfig = Field(default_factory=ModelConfig, description="size of both models")
    steps: int = Field(1000, ge=1, description="optimizer steps per model")
    batch_size: int = Field(64, ge=1, description="rows per step")
    lr: float = Field(2e-3, gt=0, le=1, description="peak learning rate (both models)")
    val_rows: int = Field(100, ge=1, description="validation problems for the greedy check")
    problems: str = Field("diffureason_problems", description="paths key of the problems")
    out: str = Field("diffureason_models", description="paths key of the models folder")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads (0: all cores; "
                             "workers = 1)")
    workers: int = Field(1, ge=1, le=64, description="seeds trained at once, one process and "
                         "one torch thread each (stages.core.pool)")


def encode_rows(tok: Any, prompts: list[str], responses: list[str] | None, meta: dict) -> Any:
    import torch

    from stages.models.mdlm import encode

    return torch.tensor([encode(tok, p, None if responses is None else r, meta["prompt_len"],
                                meta["response_len"])
                         for p, r in zip(prompts, responses or prompts)], dtype=torch.long)


def train_seed(job: dict[str, Any]) -> dict[str, Any]:
    """Both models of one training seed, saved under `job["out"]`; returns their metrics and the
    diffusion LM's loss curve. A plain function of plain data: `run` maps it over the seeds in
    worker processes (`stages.core.pool`); each model starts from `set_seed(seed)`, so nothing
    depends on which process trains it or in what order."""
    import polars as pl
    from transformers import AutoTokenizer, set_seed

    from stages.diffureason import search as S
    from stages.diffureason.task import read_problems
    from stages.models import mdlm
    from stages.models.base import set_threads
    from stages.train.sft import sft

    cfg, seed, out = Config.model_validate(job["cfg"]), job["seed"], Path(job["out"])
    set_threads(job["threads"])
    folder = Path(job["problems"])
    df, meta = read_problems(folder)
    tok = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
    train = df.filter(pl.col("split") == "train")
    val = df.filter(pl.col("split") == "val").head(cfg.val_rows)
    rows = encode_rows(tok, train["prompt"].to_list(), train["response"].to_list(), meta)
    val_rows = encode_rows(tok, val["prompt"].to_list(), val["response"].to_list(), meta)
    mask_id = int(tok.mask_token_id)
    curve: list[tuple[dict[str, float], int]] = []

    set_seed(seed)
    m: dict[str, float] = {}
    diff = mdlm.build_mdlm(cfg.model, tok)
    got = mdlm.train_mdlm(diff, rows, meta["prompt_len"], mask_id, steps=cfg.steps,
                          batch_size=cfg.batch_size, lr=cfg.lr, seed=seed,
                          log=lambda values, step: curve.append((values, step)),
                          log_every=max(1, cfg.steps // 10))
    m["mdlm_loss"] = got["train_loss"]
    m["mdlm_val_masked_ce"] = mdlm.masked_loss(diff, val_rows, meta["prompt_len"], mask_id)
    m["mdlm_params"] = float(sum(p.numel() for p in diff.parameters()))
    io.save_model(diff, tok, out / "mdlm")

    set_seed(seed)
    ar = mdlm.build_ar_twin(cfg.model, tok)
    got = sft(ar, tok, [p for p in train["prompt"].to_list()],
              train["response"].to_list(), steps=cfg.steps, batch_size=cfg.batch_size,
              lr=cfg.lr, seed=seed, warmup=0.05, min_lr_ratio=0.1,
              log_every=max(1, cfg.steps // 10))
    m["ar_loss"] = float(got["train_loss"])
    m["ar_params"] = float(sum(p.numel() for p in ar.parameters()))
    ar.generation_config.pad_token_id = tok.pad_token_id
    ar.generation_config.eos_token_id = tok.eos_token_id
    io.save_model(ar, tok, out / "ar")

    # Greedy validation accuracy: did each model learn the task at all?
    dec = S.Decoder(diff, tok, meta, seed=seed)
    x = dec.vanilla(val["prompt"].to_list(), steps=max(1, meta["block_size"] // 2))
    m["mdlm_val_greedy_acc"] = S.accuracy(dec, x, val["answer"].to_list())
    ard = S.ARDecoder(ar, tok, meta, seed=seed)
    x = ard.greedy(val["prompt"].to_list())
    m["ar_val_greedy_acc"] = S.accuracy(dec, x, val["answer"].to_list())
    return {"metrics": m, "curve": curve}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.pool import map_jobs
    from stages.diffureason.task import read_problems

    folder = ctx.path(cfg.problems)
    df, meta = read_problems(folder)     # checked here, before any process starts
    if cfg.model.max_positions < meta["prompt_len"] + meta["response_len"]:
        raise ValueError(f"train.model.max_positions = {cfg.model.max_positions} < prompt_len + "
                         f"response_len = {meta['prompt_len'] + meta['response_len']}")
    metrics = {"train_rows": float(df.filter(pl.col("split") == "train").height)}
    out = ctx.path(cfg.out)
    with io.atomic_path(out, is_dir=True) as tmp:
        jobs = [{"cfg": cfg.model_dump(), "seed": seed, "problems": str(folder),
                 "out": str(tmp / f"seed{seed}"),
                 "threads": cfg.num_threads if cfg.workers == 1 else 1} for seed in cfg.seeds]
        results = map_jobs(train_seed, jobs, cfg.workers)
    for seed, res in zip(cfg.seeds, results, strict=True):
        m = res["metrics"]
        for values, step in res["curve"]:
            ctx.log_metrics({f"seed{seed}/{k}": v for k, v in values.items()}, step)
        metrics.update({f"seed{seed}/{k}": v for k, v in m.items()})
        with ctx.method_run("train", "models", seed, {"seed": seed}) as run_:
            run_.log_metrics(m)
    for key in sorted({k.split("/", 1)[1] for k in metrics if "/" in k}):
        vals = [metrics[f"seed{s}/{key}"] for s in cfg.seeds]
        metrics[f"mean/{key}"] = sum(vals) / len(vals)
    if ctx.tracker is not None:
        for seed in cfg.seeds:
            for name, reg in (("mdlm", "diffureason-mdlm"), ("ar", "diffureason-ar")):
                ctx.tracker.register_model(out / f"seed{seed}" / name, reg, [f"seed{seed}"],
                                           tags={"arm": name})
    return metrics


def headline(details: dict[str, float]) -> dict[str, float]:
    keys = ("mean/mdlm_val_greedy_acc", "mean/ar_val_greedy_acc")
    return {k.split("/")[1]: details[k] for k in keys if k in details}
