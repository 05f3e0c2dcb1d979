"""Stage `train_explorer`: the learned explorer, a tiny Llama trained from scratch by imitation
on the scripted breadth-first expert's trajectories (stages.agents.imitation on the shared SFT
engine). Prompt = the episode so far as `PromptFormat` renders it (the task, a count of earlier
turns, the last turn and observations), target = the expert's next `Action:` line.

The paper runs frontier LLMs as explorers (arXiv 2602.02039 section 4); the issue makes the
explorer here a learned model. It is character-level, so it must write every SQL character
itself, and at the `gpu` profile `explore` runs a served model through the backend instead.
Registered in MLflow as `ddr-explorer` with the alias `learned`.
"""

from __future__ import annotations

import string
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.agents.imitation import ILConfig, train_il
from stages.agents.trajectories import read_rollouts
from stages.core import io

CHARS = (set(string.printable) - set("\t\r\x0b\x0c")) | {"\n"}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(64, ge=16, le=4096)
    num_layers: int = Field(2, ge=1, le=64)
    num_heads: int = Field(4, ge=1, le=64)
    intermediate_size: int = Field(128, ge=16, le=16384)
    max_positions: int = Field(768, ge=64, le=8192, description="context, characters + 2")
    il: ILConfig
    num_threads: int = Field(1, ge=0, le=256)
    register_as: str = "ddr-explorer"


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import torch

    from stages.models import base
    from stages.models.tokenizer import build_tokenizer

    base.set_threads(cfg.num_threads)
    episodes, steps = read_rollouts(ctx.path("ddr_expert"))
    torch.manual_seed(ctx.seed)
    tokenizer = build_tokenizer(CHARS)
    model = base.build_model(base.Config(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, max_positions=cfg.max_positions), tokenizer)
    metrics = train_il(model, tokenizer, episodes, steps, cfg.il, seed=ctx.seed,
                       log=lambda m, step: ctx.log_metrics(m, step=step))
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    out = ctx.path("ddr_explorer")
    io.save_model(model, tokenizer, out)
    n_params = sum(p.numel() for p in model.parameters())
    if ctx.tracker is not None:
        ctx.tracker.register_model(out, cfg.register_as, ["learned"],
                                   tags={"arm": "learned", "expert": "breadth",
                                         "n_params": str(n_params)})
    return {**{k: float(v) for k, v in metrics.items()}, "n_params": float(n_params)}


def headline(details: dict[str, float]) -> dict[str, float]:
    return {"loss": details["train_loss"]}
