"""SFT engine: completion-only supervised fine-tuning of a causal LM, in place.

The model sees `<bos> prompt completion <eos>` and the cross-entropy is taken on the completion
tokens only (the prompt is context, not a target): the SFT step of STaR-style self-improvement
(Zelikman et al. 2022, arXiv 2203.14465), of curriculum SFT (EDCO) and of fine-tuned judges
(RACER). The loop is `stages.models.base.train` (AdamW, linear warm-up then cosine decay to
`lr * min_lr_ratio`, gradient clipping), the one the shared base model was trained with, so every
paper's SFT uses the same recipe at its own budget.
"""

from __future__ import annotations

from typing import Any, Callable


class _StepLog:
    """`base.train` logs through `ctx.log_metrics(values, step)`; this shifts the step."""

    def __init__(self, log: Callable[[dict[str, float], int], None] | None, offset: int):
        self.log, self.offset = log, offset

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.log is not None:
            self.log(metrics, self.offset + int(step or 0))


def sft(model: Any, tokenizer: Any, prompts: list[str], completions: list[str], *, steps: int,
        batch_size: int, lr: float, seed: int, warmup: float = 0.0, min_lr_ratio: float = 1.0,
        weight_decay: float = 0.0, max_grad_norm: float = 1.0, log_every: int = 10,
        log: Callable[[dict[str, float], int], None] | None = None,
        step_offset: int = 0) -> dict[str, float]:
    """Completion-only SFT of `model` in place for `steps` optimizer steps of `batch_size` rows
    (`stages.models.base.train` on `<bos> prompt` (no loss) + `completion <eos>`); leaves the
    model in eval mode. `log(metrics, step)` gets every `log_every` steps, shifted by
    `step_offset` (several SFT calls on one curve). Returns the loop's metrics (train_loss...)."""
    from stages.models import base

    cfg = base.Config(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup,
                      min_lr_ratio=min_lr_ratio, weight_decay=weight_decay,
                      max_grad_norm=max_grad_norm, log_every=log_every)
    max_len = getattr(model.config, "max_position_embeddings", 256)
    rows = base.encode_sft_rows(tokenizer, prompts, completions, max_len)
    metrics = base.train(cfg, model, tokenizer, rows, seed, _StepLog(log, step_offset))
    model.eval()
    return metrics
