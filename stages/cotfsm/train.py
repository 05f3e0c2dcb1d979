"""Stage `train` of CoT-FSM: the tiny reasoning model, one per training seed.

A Llama-style decoder (spec §4: 4 layers, d = 128 at `cpu`) built and trained by the shared base
recipe (`stages.models.base`: completion-only SFT with the HF Trainer) on the `lm_train` traces,
`prompt` -> `target <eos>`. It learns the generating chain, correct and incorrect traces alike
(a reasoning model's CoTs are both), so its own samples are what the offline phase labels.
Saved with `save_pretrained` (safetensors) beside the word-level tokenizer, registered in MLflow
as `cotfsm-lm` with alias `seed<k>`.

    python -m stages cotfsm train
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seeds: list[int] = Field([0, 1, 2], min_length=1, description="training seeds (spec: 3)")
    hidden_size: int = Field(128, ge=16, le=4096, description="model width d")
    num_layers: int = Field(4, ge=1, le=64, description="decoder layers")
    num_heads: int = Field(4, ge=1, le=64, description="attention heads")
    intermediate_size: int = Field(256, ge=16, le=16384, description="MLP width")
    steps: int = Field(300, ge=1, description="optimizer steps")
    batch_size: int = Field(32, ge=1, description="traces per step")
    lr: float = Field(2e-3, gt=0, le=1, description="peak learning rate")
    traces: str = Field("cotfsm_traces", description="paths key of the traces folder")
    out: str = Field("cotfsm_models", description="paths key of the models folder")
    register_as: str = Field("cotfsm-lm", description="registered model name")
    num_threads: int = Field(0, ge=0, le=256, description="torch CPU threads (0: all cores)")


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from transformers import AutoTokenizer, set_seed

    from stages.cotfsm.traces import read_split
    from stages.models import base

    base.set_threads(cfg.num_threads)
    folder = ctx.path(cfg.traces)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
    df = read_split(folder, "lm_train")
    rows = base.encode_sft_rows(tokenizer, df["prompt"].to_list(), df["target"].to_list(), 512)
    bcfg = base.Config(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                       num_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                       max_positions=512, steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                       log_every=max(1, cfg.steps // 10), num_threads=cfg.num_threads)
    metrics: dict[str, float] = {"train_rows": float(len(rows))}
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        for seed in cfg.seeds:
            set_seed(seed)
            model = base.build_model(bcfg, tokenizer)
            got = base.train(bcfg, model, tokenizer, rows, seed, ctx)
            model.eval()
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.generation_config.eos_token_id = tokenizer.eos_token_id
            model.generation_config.bos_token_id = tokenizer.bos_token_id
            io.save_model(model, tokenizer, tmp / f"seed{seed}")
            metrics[f"seed{seed}/train_loss"] = got["train_loss"]
            metrics[f"seed{seed}/train_seconds"] = got["train_seconds"]
            metrics["n_params"] = float(sum(p.numel() for p in model.parameters()))
    if ctx.tracker is not None:
        for seed in cfg.seeds:
            # one artifact path per seed: a second version under the same path of this run
            # would be taken for the first one
            ctx.tracker.register_model(ctx.path(cfg.out) / f"seed{seed}", cfg.register_as,
                                       [f"seed{seed}"], tags={"paperline.seed": str(seed)},
                                       artifact_path=f"model-seed{seed}")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    losses = [v for k, v in metrics.items() if k.endswith("/train_loss")]
    return {"train_loss": sum(losses) / len(losses)} if losses else {}
