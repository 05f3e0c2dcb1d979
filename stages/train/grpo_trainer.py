"""`GRPOTrainer`: TRL's GRPO trainer with a policy-loss hook, rollout replay and ratio diagnostics.

It subclasses `trl.GRPOTrainer` (never forks it), so the same code runs under accelerate /
DeepSpeed / vLLM on GPU workers. TRL computes a micro-batch's loss in `_compute_loss(model,
inputs)`; this class routes that call through one public hook,

    policy_loss(model, inputs) -> loss        (scaled for gradient accumulation, as TRL's)

which here is TRL's own clipped GRPO loss, untouched (the baseline of every comparison), plus
the ratio diagnostics. A method with another loss subclasses this class and overrides
`policy_loss` only (e.g. `stages.r2vpo.trainer.R2VPOTrainer`); it gets the completion log-probs
from `completion_logps`, logs with `log_ratio_stats` like the baseline, and reports its own state
through `policy_state` (saved with the policy) and `policy_metrics` (the run's final metrics).

`inputs` is TRL's generation batch: prompt_ids / prompt_mask (left-padded), completion_ids /
completion_mask (right-padded), advantages (B,), old_per_token_logps (the behaviour policy's,
absent when TRL knows they equal the current ones), ref_per_token_logps (if beta > 0).

Imported by `stages.train.grpo.train_grpo` only when training starts: it imports TRL and torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import trl

from stages.train.ratio import clip_fraction, masked_mean, policy_ratio

_PROMPT_KEYS = ("prompt_ids", "prompt_mask")                   # left-padded
_TOKEN_KEYS = ("completion_ids", "completion_mask", "old_per_token_logps",
               "ref_per_token_logps")                            # right-padded, per token


def concat_rollouts(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack generation batches of different widths: prompts left-padded, tokens right-padded.

    Padding is masked out (mask 0), so padded log-probs (0) never enter a loss.
    """
    out: dict[str, Any] = {}
    keys = [k for k in batches[0] if all(k in b for b in batches)]
    for key in keys:
        values = [b[key] for b in batches]
        if key == "num_items_in_batch":
            out[key] = sum(values)
        elif key in _PROMPT_KEYS:
            width = max(v.shape[1] for v in values)
            out[key] = torch.cat([F.pad(v, (width - v.shape[1], 0)) for v in values])
        elif key in _TOKEN_KEYS:
            width = max(v.shape[1] for v in values)
            out[key] = torch.cat([F.pad(v, (0, width - v.shape[1])) for v in values])
        elif torch.is_tensor(values[0]) and values[0].dim() >= 1:
            out[key] = torch.cat(values)
        else:
            out[key] = values[0]
    return out


class GRPOTrainer(trl.GRPOTrainer):
    """`trl.GRPOTrainer` + the `policy_loss` hook + replay + ratio diagnostics.

    `params` (a `stages.train.grpo.GRPOParams`, or a subclass carrying a subclass trainer's own
    settings) gives `replay_batches` and the `clip_epsilon` of the clip diagnostic.
    """

    def __init__(self, *args: Any, params: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.params = params
        self.replay: list[dict[str, Any]] = []
        self.rollouts = 0            # fresh completions generated (the sample budget)
        self.tokens_generated = 0
        self._captured_logps = None
        self._capture = False

    # --- the hook -----------------------------------------------------------------------------

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        return self.policy_loss(model, inputs)

    def policy_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """The loss of one micro-batch. Here: TRL's clipped GRPO surrogate as TRL computes it,
        -mean_t min(r_t A, clip(r_t, 1-eps, 1+eps) A) (+ beta KL), with its own logging; the
        ratio statistics are read off the log-probs TRL computed on the way."""
        self._capture = True
        try:
            loss = super()._compute_loss(model, inputs)   # TRL's clipped GRPO, as is
        finally:
            self._capture = False
        logps = self._captured_logps.detach()
        old = inputs.get("old_per_token_logps")
        self.log_ratio_stats(logps, logps if old is None else old, inputs)
        return loss

    def policy_state(self) -> dict[str, Any]:
        """JSON-able state of the loss, saved with the policy (`policy_state.json`)."""
        return {}

    def policy_metrics(self) -> dict[str, float]:
        """The loss's own final metrics, added to the run's (e.g. a final multiplier)."""
        return {}

    # --- helpers for policy_loss ----------------------------------------------------------------

    def completion_logps(self, model: Any, inputs: dict[str, Any]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi(token), entropy) at every completion token under `model`, (B, T) each."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, mask], dim=1)
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True)
        return logps, entropies

    @property
    def mode(self) -> str:
        """"train" or "eval": which of TRL's metric buffers a value goes to."""
        return "train" if self.model.training else "eval"

    def log_ratio_stats(self, logps: torch.Tensor, old: torch.Tensor,
                        inputs: dict[str, Any]) -> torch.Tensor:
        """Log the ratio r = pi/mu over the valid tokens: mean, variance, the share the clip cuts
        (or would cut) and how often the |log r| guard bites. Returns r."""
        mask = inputs["completion_mask"]
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        with torch.no_grad():
            ratio, clamped = policy_ratio(logps, old)
            mean = masked_mean(ratio, mask)
            var = masked_mean((ratio - mean) ** 2, mask)
            m = self._metrics[self.mode]
            m["ratio/mean"].append(mean.item())
            m["ratio/var"].append(var.item())
            m["ratio/clip_fraction"].append(
                clip_fraction(ratio, adv, self.params.clip_epsilon, mask).item())
            m["ratio/log_clamped"].append(masked_mean(clamped.float(), mask).item())
        return ratio

    # --- replay and log-prob capture ------------------------------------------------------------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """Fresh rollouts, pushed to the replay buffer, plus the last K rounds (with their mu)."""
        fresh = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return fresh
        self.rollouts += int(fresh["completion_ids"].shape[0])
        self.tokens_generated += int(fresh["completion_mask"].sum().item())
        self._metrics["train"]["rollouts"].append(float(self.rollouts))
        self._metrics["train"]["tokens_generated"].append(float(self.tokens_generated))
        k = self.params.replay_batches
        if not k:
            return fresh
        stale = self.replay[-k:]
        self.replay = [*stale, {key: (v.detach() if hasattr(v, "detach") else v)
                                for key, v in fresh.items()}][-k:]
        self._metrics["train"]["replay_rows"].append(
            float(sum(int(b["completion_ids"].shape[0]) for b in stale)))
        return concat_rollouts([fresh, *stale]) if stale else fresh

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._capture:
            self._captured_logps = out[0]
        return out
