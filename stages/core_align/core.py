"""CoRe: Coordinated Reasoning for vision-text compression ("Awakening Visual Reasoning:
Mitigating Post-Training Failure in Vision-Text Compression", ICML 2026, poster 64509).

A VLM reads text rendered as an image (x_img) nearly as well as the text itself (x_txt), yet
reasons much worse on it, and SFT/RL on x_img barely helps. CoRe trains one shared policy pi_theta
and pulls its image-conditioned distribution towards its own text-conditioned one, a stop-gradient
*dynamic anchor*, token by token on the same response prefix y_<t:

    L_match = (1/|y|) sum_t w_t D( pi_anc(.|x_txt, y_<t) || pi_theta(.|x_img, y_<t) )   (step-wise)
    L_SFT   = CE(y* | x_img) + lambda L_match(y*) + mu CE(y* | x_txt)
    L_RL    = GRPO(y ~ pi_theta(.|x_img)) + lambda sum_t KL(pi_theta(.|x_img) || pi_anc(.|x_txt))
    gap recovery = (Acc_CoRe(img) - Acc_visualSFT(img)) / (Acc_textSFT(txt) - Acc_visualSFT(img))

Only the abstract is public (no arXiv copy, no code): every formula beyond "dynamic text anchor +
step-wise distribution matching, inside SFT and RL" is [reconstructed], and each choice is a
setting of `CoReParams` so it can be ablated: the divergence (forward KL = distillation, default;
reverse KL), the weights w_t (1, or 1 only where the anchor's top-1 token is the reference token),
the granularity (token, or reasoning step: average inside a step before weighting), the anchor
(the current parameters under stop-gradient, default; or an EMA teacher).

The anchor never receives a gradient from L_match (spec pitfall: the text policy would drift
towards the weaker visual one and the gap would "close" from above): `match_loss` detaches it
itself, and the anchor forward runs without grad unless mu > 0 needs it for CE(y*|x_txt).

The model interface is minimal: any HF causal LM whose forward takes `input_ids` or
`inputs_embeds` (+ attention_mask, position_ids) and returns `.logits`; an image is whatever
prompt embeddings the VLM's encoder + projector produce (`Branch.inputs_embeds`). The GRPO term
lives in `stages.core_align.trainer` (a subclass of the engine's trainer).

Tensor methods only at module level (torch is imported inside the two functions that need it), so
a stage Config holding `CoReParams` validates without loading torch.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.core.stats import percentile_ci
from stages.train.grpo import GRPOParams
from stages.train.ratio import masked_mean

if TYPE_CHECKING:
    import torch

Spans = Sequence[Sequence[tuple[int, int]]]
"""Reasoning steps per example: half-open [start, end) ranges over response positions, in order,
covering every valid response token exactly once."""


class CoReParams(BaseModel):
    """CoRe inside SFT (all [reconstructed] from the abstract; the spec's defaults)."""

    model_config = ConfigDict(extra="forbid")

    lam: float = Field(1.0, ge=0, le=1e3, description="lambda, weight of L_match")
    mu: float = Field(1.0, ge=0, le=1e3, description="mu, weight of CE(y*|x_txt): keeps the "
                      "anchor improving, which is what makes it 'dynamic'")
    divergence: Literal["forward", "reverse"] = Field(
        "forward", description="forward: KL(anchor || student), mass-covering distillation; "
                               "reverse: KL(student || anchor), mode-seeking (ablation)")
    weighting: Literal["uniform", "anchor_correct"] = Field(
        "uniform", description="w_t = 1, or 1 only where the anchor's top-1 token is the "
                               "reference token (confident and correct)")
    granularity: Literal["token", "step"] = Field(
        "token", description="match per token, or per reasoning step (mean inside the step, "
                             "then weighted; needs step spans)")
    anchor: Literal["dynamic", "ema"] = Field(
        "dynamic", description="dynamic: stop-gradient of the current parameters; ema: an EMA "
                               "teacher of them (ablation)")
    ema_decay: float = Field(0.99, gt=0, lt=1, description="EMA teacher decay (anchor: ema)")


class AnchorKLParams(BaseModel):
    """CoRe's anchor term inside GRPO ([reconstructed]); the reference KL is GRPO's `beta`."""

    model_config = ConfigDict(extra="forbid")

    lam: float = Field(0.1, ge=0, le=1e3, description="lambda, weight of the token-mean "
                       "KL(pi_theta(.|x_img) || pi_anc(.|x_txt)) [reconstructed: the paper gives "
                       "none; 0.1 keeps it below the unit-scale advantage term]")


class CoReGRPOParams(GRPOParams):
    """A GRPO run with CoRe's anchor term (λ_ref = `beta`, 0 or 0.01 in the spec's ablation)."""

    policy_loss: Literal["clip", "core"] = Field(
        "core", description="core: TRL's clipped loss + lambda KL to the text anchor")
    anchor: AnchorKLParams = Field(default_factory=AnchorKLParams,
                                   description="the anchor term (policy_loss: core)")


# --- the matching loss: pure tensor functions ---------------------------------------------------

def _float(x: torch.Tensor) -> torch.Tensor:
    # at least float32 (a bf16 softmax loses the small KLs); float64 stays float64
    return x if x.element_size() >= 4 else x.float()


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return _float(logits).log_softmax(-1)


def token_divergence(anchor_logits: torch.Tensor, student_logits: torch.Tensor,
                     kind: Literal["forward", "reverse"] = "forward") -> torch.Tensor:
    """D at every position, (B, T): forward KL(p_anc || p_stu) = sum_v p_anc (log p_anc - log
    p_stu), or reverse KL(p_stu || p_anc). Logits (B, T, V); no stop-gradient here."""
    log_anc, log_stu = _log_probs(anchor_logits), _log_probs(student_logits)
    if kind == "forward":
        return (log_anc.exp() * (log_anc - log_stu)).sum(-1)
    if kind == "reverse":
        return (log_stu.exp() * (log_stu - log_anc)).sum(-1)
    raise ValueError(f"divergence = {kind!r}: expected 'forward' or 'reverse'")


def token_weights(anchor_logits: torch.Tensor, targets: torch.Tensor,
                  weighting: Literal["uniform", "anchor_correct"] = "uniform") -> torch.Tensor:
    """w_t, (B, T): 1 everywhere, or 1 where argmax p_anc(.|x_txt, y_<t) == y_t (else 0)."""
    dtype = _float(anchor_logits[..., :1]).dtype
    if weighting == "uniform":
        return targets.new_ones(targets.shape, dtype=dtype)
    if weighting == "anchor_correct":
        return (anchor_logits.argmax(-1) == targets).to(dtype)
    raise ValueError(f"weighting = {weighting!r}: expected 'uniform' or 'anchor_correct'")


def step_ids(spans: Spans, mask: torch.Tensor) -> torch.Tensor:
    """Step index of every response position, (B, T) long, -1 outside the valid tokens.

    ValueError naming the example when its spans are empty, unordered, overlapping, or do not
    cover its valid tokens (mask must be a right-padded prefix) exactly once."""
    if len(spans) != mask.shape[0]:
        raise ValueError(f"step spans for {len(spans)} examples but the batch has {mask.shape[0]}")
    ids = mask.new_full(mask.shape, -1).long()
    for b, example in enumerate(spans):
        length = int(mask[b].sum())
        if not bool(mask[b, :length].all()):
            raise ValueError(f"example {b}: the response mask is not a right-padded prefix")
        cursor = 0
        for s, (start, end) in enumerate(example):
            if start != cursor or end <= start or end > length:
                raise ValueError(f"example {b}: step spans {list(example)} must be ordered, "
                                 f"non-empty [start, end) ranges covering positions 0..{length} "
                                 f"exactly once (span {s} = ({start}, {end}))")
            ids[b, start:end] = s
            cursor = end
        if cursor != length:
            raise ValueError(f"example {b}: step spans {list(example)} cover {cursor} of its "
                             f"{length} response tokens; every token must be in a step")
    return ids


def step_sums(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of `values` per step, tokens per step), each (B, S); positions with id -1 dropped."""
    num_steps = int(ids.max()) + 1 if ids.numel() else 0
    slot = ids.masked_fill(ids < 0, num_steps)        # -1 -> a spare slot, cut off below
    sums = values.new_zeros(ids.shape[0], num_steps + 1).scatter_add(1, slot, values)
    counts = values.new_zeros(ids.shape[0], num_steps + 1).scatter_add(
        1, slot, (ids >= 0).to(values.dtype))
    return sums[:, :num_steps], counts[:, :num_steps]


def match_loss(anchor_logits: torch.Tensor, student_logits: torch.Tensor,
               targets: torch.Tensor, mask: torch.Tensor, *,
               divergence: Literal["forward", "reverse"] = "forward",
               weighting: Literal["uniform", "anchor_correct"] = "uniform",
               spans: Spans | None = None) -> torch.Tensor:
    """L_match, a scalar: mean over examples of (1/|y|) sum_t w_t D_t (token granularity), or,
    with `spans`, of (1/#steps) sum_s w_s mean_{t in s} D_t, w_s = 1 only if every token of the
    step has w_t = 1 [reconstructed]. `anchor_logits` are detached here: sg(theta), always.

    anchor_logits, student_logits: (B, T, V) at the response positions; targets: the reference
    tokens y_t, (B, T); mask: 1 on valid response tokens (right-padded), (B, T)."""
    anchor_logits = anchor_logits.detach()   # the anchor gets no gradient from L_match
    d = token_divergence(anchor_logits, student_logits, divergence)
    w = token_weights(anchor_logits, targets, weighting)
    m = mask.to(d.dtype)
    if spans is None:
        per_example = (w * d * m).sum(1) / m.sum(1).clamp(min=1)
    else:
        ids = step_ids(spans, mask)
        d_sum, count = step_sums(d * m, ids)
        w_sum, _ = step_sums(w * m, ids)
        d_step = d_sum / count.clamp(min=1)                 # mean inside the step
        w_step = (w_sum == count).to(d.dtype)               # all of its tokens weighted
        steps = (count > 0).to(d.dtype)
        per_example = (w_step * d_step * steps).sum(1) / steps.sum(1).clamp(min=1)
    return per_example.mean()


def anchor_kl(student_logits: torch.Tensor, anchor_logits: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """CoRe's RL term, a scalar: KL(pi_theta(.|x_img, y_<t) || pi_anc(.|x_txt, y_<t)) averaged
    over the valid completion tokens (the engine's token-mean 'bnpo' loss, so lambda is on the
    scale of the policy term) [reconstructed: the spec writes a sum over t]. Anchor detached."""
    return masked_mean(token_divergence(anchor_logits.detach(), student_logits, "reverse"), mask)


def response_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CE(y* | x): mean negative log-likelihood over every valid response token of the batch
    (the engine's SFT convention)."""
    nll = -_log_probs(logits).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    m = mask.to(nll.dtype)
    return (nll * m).sum() / m.sum().clamp(min=1)


# --- the model side ------------------------------------------------------------------------------

@dataclass
class Branch:
    """One conditioning of the responses: text tokens (`input_ids`) or prompt embeddings
    (`inputs_embeds`, e.g. projected image patches + question), left-padded, (B, P[, H])."""

    attention_mask: torch.Tensor
    input_ids: torch.Tensor | None = None
    inputs_embeds: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.inputs_embeds is None):
            raise ValueError("a Branch takes exactly one of input_ids and inputs_embeds")
        context = self.input_ids if self.input_ids is not None else self.inputs_embeds
        if tuple(context.shape[:2]) != tuple(self.attention_mask.shape):
            raise ValueError(f"context {tuple(context.shape[:2])} and attention_mask "
                             f"{tuple(self.attention_mask.shape)} differ in (batch, length)")


def response_logits(model: Any, context: Branch, response_ids: torch.Tensor,
                    response_mask: torch.Tensor) -> torch.Tensor:
    """Logits predicting each response token y_t from (context, y_<t), (B, T, V).

    The same response tokens follow either context, so both branches are scored on identical y
    (spec pitfall). Positions count valid tokens only, so left padding does not shift them."""
    import torch

    if response_ids.shape[0] != context.attention_mask.shape[0]:
        raise ValueError(f"{response_ids.shape[0]} responses for a context batch of "
                         f"{context.attention_mask.shape[0]}")
    mask = torch.cat([context.attention_mask, response_mask.to(context.attention_mask.dtype)], 1)
    position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
    if context.input_ids is not None:
        out = model(input_ids=torch.cat([context.input_ids, response_ids], 1),
                    attention_mask=mask, position_ids=position_ids)
    else:
        embed = model.get_input_embeddings()(response_ids).to(context.inputs_embeds.dtype)
        out = model(inputs_embeds=torch.cat([context.inputs_embeds, embed], 1),
                    attention_mask=mask, position_ids=position_ids)
    start = context.attention_mask.shape[1] - 1         # the last context position predicts y_0
    return out.logits[:, start:start + response_ids.shape[1]]


class EMAAnchor:
    """The EMA-teacher anchor (ablation): theta_ema <- d theta_ema + (1 - d) theta after each
    step; a frozen copy, never trained, never given a gradient."""

    def __init__(self, model: Any, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).requires_grad_(False)
        for p in self.model.parameters():
            p.grad = None

    def update(self, model: Any) -> None:
        import torch

        with torch.no_grad():
            for ema, live in zip(self.model.parameters(), model.parameters()):
                ema.mul_(self.decay).add_(live.detach(), alpha=1.0 - self.decay)


def core_sft_loss(model: Any, text: Branch, image: Branch, response_ids: torch.Tensor,
                  response_mask: torch.Tensor, params: CoReParams, *,
                  spans: Spans | None = None, ema: EMAAnchor | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """(L, parts) with L = CE(y*|x_img) + lam L_match + mu CE(y*|x_txt) on one batch of pairs.

    The anchor is the text branch's logits, detached (dynamic), or the EMA teacher's (`ema`,
    required when params.anchor == "ema"). `spans` are required at step granularity."""
    import torch

    if params.granularity == "step" and spans is None:
        raise ValueError("granularity 'step' needs the reasoning-step spans of every response")
    if (params.anchor == "ema") != (ema is not None):
        raise ValueError(f"anchor = {params.anchor!r} but an EMA teacher was "
                         f"{'not ' if ema is None else ''}given")
    image_logits = response_logits(model, image, response_ids, response_mask)
    ce_img = response_ce(image_logits, response_ids, response_mask)
    if params.mu > 0:
        text_logits = response_logits(model, text, response_ids, response_mask)
        ce_txt = response_ce(text_logits, response_ids, response_mask)
    else:
        with torch.no_grad():
            text_logits = response_logits(model, text, response_ids, response_mask)
        ce_txt = ce_img.new_zeros(())
    if ema is not None:
        with torch.no_grad():
            anchor_logits = response_logits(ema.model, text, response_ids, response_mask)
    else:
        anchor_logits = text_logits      # detached inside match_loss
    match = match_loss(anchor_logits, image_logits, response_ids, response_mask,
                       divergence=params.divergence, weighting=params.weighting,
                       spans=spans if params.granularity == "step" else None)
    loss = ce_img + params.lam * match + params.mu * ce_txt
    return loss, {"loss": loss.item(), "ce_img": ce_img.item(), "ce_txt": ce_txt.item(),
                  "match": match.item()}


def sft_step(model: Any, optimizer: Any, text: Branch, image: Branch, response_ids: torch.Tensor,
             response_mask: torch.Tensor, params: CoReParams, *, spans: Spans | None = None,
             ema: EMAAnchor | None = None, max_grad_norm: float | None = 1.0) -> dict[str, float]:
    """One optimizer step on `core_sft_loss` (then the EMA teacher's update); returns the parts."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    loss, parts = core_sft_loss(model, text, image, response_ids, response_mask, params,
                                spans=spans, ema=ema)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    if ema is not None:
        ema.update(model)
    return parts


# --- the headline metric -----------------------------------------------------------------

def gap_recovery(acc_core_img: float, acc_visual_img: float, acc_text_txt: float) -> float:
    """(Acc_CoRe(img) - Acc_visualSFT(img)) / (Acc_textSFT(txt) - Acc_visualSFT(img)); NaN
    (undefined) when the text upper bound does not exceed visual SFT (denominator <= 0)."""
    gap = acc_text_txt - acc_visual_img
    return (acc_core_img - acc_visual_img) / gap if gap > 0 else math.nan


@dataclass(frozen=True)
class GapRecovery:
    """Gap recovery with its paired percentile-bootstrap 95% CI over test items."""

    value: float
    low: float
    high: float
    gap: float                 # Acc_textSFT(txt) - Acc_visualSFT(img), on all items
    n: int                     # test items
    undefined_draws: int       # resamples whose gap was <= 0 (dropped from the CI)

    @property
    def defined(self) -> bool:
        return math.isfinite(self.value)

    def describe(self) -> str:
        if not self.defined:
            return (f"undefined: text SFT does not beat visual SFT (gap {self.gap:+.3f} over "
                    f"{self.n} items); report the accuracies instead")
        ci = (f"[{self.low:.2f}, {self.high:.2f}]" if math.isfinite(self.low) else "[n/a]")
        return f"{self.value:.2f} {ci} over {self.n} items (gap {self.gap:+.3f})"


def gap_recovery_ci(core_img: Sequence[float], visual_img: Sequence[float],
                    text_txt: Sequence[float], *, draws: int = 2000, seed: int = 0) -> GapRecovery:
    """Gap recovery from per-item correctness (0/1) of the three arms on the same test items
    (item i is one pair x_txt / x_img), with a paired bootstrap: items are resampled together
    across arms (`stages.core.stats.percentile_ci`); resamples with gap <= 0 are dropped and
    counted."""
    n = len(core_img)
    if n == 0 or len(visual_img) != n or len(text_txt) != n:
        raise ValueError(f"gap recovery needs per-item scores of the same non-empty test items "
                         f"for all three arms, got {len(core_img)}, {len(visual_img)} and "
                         f"{len(text_txt)}")
    undefined = 0

    def statistic(idx: list[int]) -> float:
        nonlocal undefined
        k = len(idx)
        value = gap_recovery(sum(core_img[i] for i in idx) / k,
                             sum(visual_img[i] for i in idx) / k,
                             sum(text_txt[i] for i in idx) / k)
        undefined += not math.isfinite(value)
        return value

    acc = [sum(v) / n for v in (core_img, visual_img, text_txt)]
    value = gap_recovery(*acc)
    low, high = percentile_ci(n, statistic, draws, seed) if math.isfinite(value) else (
        math.nan, math.nan)
    return GapRecovery(value, low, high, acc[2] - acc[1], n, undefined)
