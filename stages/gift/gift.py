"""GIFT, Gaze Shift-Guided Cross-modal Fusion Enhancement (Qi, Shang, Spiliopoulou, Pappas,
arXiv 2510.22067; official code github.com/amazon-science/GIFT, CC BY-NC: reimplemented here,
not copied). A training-free fix for VLM hallucination that edits attention at inference time.

Prompt layout `[system][visual v0..v1][query q0..q1][template tail]` (inclusive spans, `Spans`
of stages/models/vlm.py, which `prompt_spans` reads off a tokenized prompt).
`A^l_{h,i,j}` is the post-softmax attention of layer l, head h, from position i to key j.

Phase 1, once per sample (one prefill with `output_attentions=True`), in saliency layers L_s:
1. gaze shift   dA^l_{h,i,j} = max(A^l_{h,i,j} - A^l_{h,i-1,j}, 0),  i in [q0, q1], j visual
   (i = q0 compares with row q0 - 1): where attention to the image *rises* while the model
   reads the query. Static attention would keep the visual attention sink; a sink token's
   attention barely moves, so its shift is small.
2. keep informative query tokens (the code: spaCy POS in {NOUN, PROPN, VERB, ADJ, ADV, NUM};
   here the caller's word list stands in for the tagger);
3. keep the top floor(H/2) heads ranked by sum_{i,j} dA;
4. s_j = mean of dA over (layers, kept heads, informative tokens);
5. clip s to [mu - 3 sigma, mu + 3 sigma], min-max scale to s_hat in [0, 1];
6. multiplier m_j = exp(alpha * s_hat_j)   (alpha = 5 for LLaVA-1.5, 4 for Qwen2-VL).

Phase 2, at every decoding step, in enhancement layers L_e, on the last position's row only
(`enhance_row`): multiply the visual attention of the floor(H/2) most visual heads by m, take
the ratio r = (boosted visual mass) / (original visual mass) of those heads (one scalar per
layer), multiply the query attention of the floor(H/2) most query-attending heads by r so the
two modalities stay balanced, renormalise the row, and mix the values with it as usual.
Ablation arms: `visual_only` (no query rescaling) and `vaf_row` (ClearSight-style boost of each
visual token's attention in proportion to that attention, a_j (1 + alpha a_j)).

Where this departs from the official code:
- L_s / L_e are hard-coded per model there (LLaVA-7B: 11 / 12-22); `choose_layers` applies the
  paper's rule instead (L_s = middle layer with the largest total positive change, L_e = the
  next ~40% of layers), because a tiny model has no published setting.
- the code prefills twice (`generate(max_new_tokens=1)` for saliency); one forward gives the same
  attention rows.
- the code patches `modeling_llama.py` of transformers 4.50; here `attention_hook` swaps, per
  chosen layer, the attention function for the installed eager one plus a last-row edit (see
  its docstring), so the installed transformers stays untouched.

    with attention_hook(lm, enhance_layers, gift_edit(spans, m)):
        lm.generate(inputs_embeds=..., do_sample=False)
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
import torch
from torch import nn

# One definition of the prompt spans and of the eager-attention check for every vision method:
# the substrate's (stages/models/vlm.py), re-exported here for the method's callers.
from stages.models.vlm import Spans, require_eager

Edit = Callable[[torch.Tensor], torch.Tensor]  # (H, seq) post-softmax row -> edited row


def _heads_kept(n_heads: int) -> int:
    if n_heads < 2:
        raise ValueError(f"GIFT keeps the top floor(H/2) heads and needs H >= 2, got H = {n_heads}")
    return n_heads // 2


def top_heads(mass: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Indices of the k heads with the largest `mass` (H,), k = floor(H/2) by default."""
    k = _heads_kept(mass.shape[0]) if k is None else k
    return torch.topk(mass, k).indices


# --- phase 1: the saliency map (pure) -------------------------------------------------------------

def _layer(attn: torch.Tensor) -> torch.Tensor:
    """One layer's attention as (H, S, S); a leading batch of 1 is dropped."""
    if attn.dim() == 4:
        if attn.shape[0] != 1:
            raise ValueError(f"GIFT runs one sample at a time (batch 1), got batch {attn.shape[0]}")
        attn = attn[0]
    if attn.dim() != 3 or attn.shape[1] != attn.shape[2]:
        raise ValueError(f"expected attention of shape (H, S, S), got {tuple(attn.shape)}")
    return attn


def gaze_shift(attn: torch.Tensor, spans: Spans) -> torch.Tensor:
    """dA_{h,i,j} = max(A_{h,i,j} - A_{h,i-1,j}, 0) for query rows i in [q0, q1] and visual keys
    j in [v0, v1] (the row before q0 is q0 - 1). attn (H, S, S) -> (H, n_query, n_visual)."""
    attn = _layer(attn).float()
    if attn.shape[-1] <= spans.q1:
        raise ValueError(f"attention covers {attn.shape[-1]} positions but the query ends at "
                         f"q1 = {spans.q1}")
    rows = attn[:, spans.q0:spans.q1 + 1, spans.visual]
    previous = attn[:, spans.q0 - 1:spans.q1, spans.visual]
    return (rows - previous).clamp(min=0.0)


def informative_mask(query_words: Sequence[str], informative: set[str] | frozenset[str]
                     ) -> torch.Tensor:
    """Which query tokens carry content: token t is informative when the word it belongs to
    (`query_words[t]`, e.g. from a tokenizer's word_ids) is in `informative`. The official code
    keeps spaCy POS in {NOUN, PROPN, VERB, ADJ, ADV, NUM}; a fixed word list stands in here.
    Words are compared lowercased, without surrounding punctuation or subword markers."""
    lexicon = {w.lower() for w in informative}
    return torch.tensor([w.lower().strip(" .,;:!?'\"Ġ▁") in lexicon for w in query_words],
                        dtype=torch.bool)


def _informative_rows(delta: torch.Tensor, informative: torch.Tensor | None) -> torch.Tensor:
    if informative is None:
        return delta
    if informative.shape != (delta.shape[1],):
        raise ValueError(f"the informative mask has shape {tuple(informative.shape)} but the "
                         f"query has {delta.shape[1]} tokens")
    if not informative.any():
        # No content word in the query (e.g. a bare "Describe."): the POS filter of the paper
        # would keep the verb; keeping every query token is the closest stand-in.
        return delta
    return delta[:, informative]


def saliency(attentions: Sequence[torch.Tensor], spans: Spans, layers: Sequence[int],
             informative: torch.Tensor | None = None) -> torch.Tensor:
    """s_j: mean gaze shift over the saliency layers, each layer's top floor(H/2) heads (ranked
    by sum_{i,j} dA over the informative tokens) and the informative query tokens. -> (n_visual,)"""
    if not layers:
        raise ValueError("saliency needs at least one layer")
    per_layer = []
    for layer in layers:
        if not 0 <= layer < len(attentions):
            raise ValueError(f"saliency layer {layer} is outside the model's {len(attentions)} "
                             "layers")
        delta = _informative_rows(gaze_shift(attentions[layer], spans), informative)
        heads = top_heads(delta.sum(dim=(1, 2)))
        per_layer.append(delta[heads])  # (H//2, n_informative, n_visual)
    return torch.cat(per_layer).mean(dim=(0, 1))


def clip_and_scale(s: torch.Tensor) -> torch.Tensor:
    """Clip s to [mu - 3 sigma, mu + 3 sigma] (population sigma over the visual tokens), then
    min-max scale to [0, 1]. A constant map carries no saliency: all zeros (no boost)."""
    mu, sigma = s.mean(), s.std(correction=0)
    s = s.clamp(mu - 3 * sigma, mu + 3 * sigma)
    span = s.max() - s.min()
    if span <= 0:
        return torch.zeros_like(s)
    return (s - s.min()) / span


def multiplier(s_hat: torch.Tensor, alpha: float) -> torch.Tensor:
    """m_j = exp(alpha * s_hat_j): at alpha = 5 the most salient token's attention x ~148."""
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    return torch.exp(alpha * s_hat)


def saliency_multiplier(attentions: Sequence[torch.Tensor], spans: Spans, layers: Sequence[int],
                        alpha: float, informative: torch.Tensor | None = None) -> torch.Tensor:
    """Phase 1 end to end: attentions of one prefill -> m (n_visual,)."""
    return multiplier(clip_and_scale(saliency(attentions, spans, layers, informative)), alpha)


# --- the layer rule ------------------------------------------------------------------------------

def positive_change_per_layer(attentions: Sequence[torch.Tensor], spans: Spans,
                              informative: torch.Tensor | None = None) -> torch.Tensor:
    """Total gaze shift sum_{h,i,j} dA of every layer -> (n_layers,); sum it over a validation
    set before `choose_layers`."""
    return torch.stack([_informative_rows(gaze_shift(a, spans), informative).sum()
                        for a in attentions])


def choose_layers(change: torch.Tensor, enhance_fraction: float = 0.4,
                  window: tuple[float, float] = (0.25, 0.75)) -> tuple[int, list[int]]:
    """The paper's rule: L_s = the layer with the largest total positive change among the middle
    layers (fractions `window` of the depth), L_e = the next round(enhance_fraction * n_layers)
    layers after it (at least one). For LLaVA-1.5-7B (32 layers) the rule gives 12-24 after an
    L_s of 11, near the published 11 / 12-22, not equal to it. -> (L_s, L_e)."""
    n = change.shape[0]
    if n < 2:
        raise ValueError(f"the layer rule needs at least 2 layers, got {n}")
    if not (0 <= window[0] < window[1] <= 1 and 0 < enhance_fraction <= 1):
        raise ValueError(f"need 0 <= window[0] < window[1] <= 1 and 0 < enhance_fraction <= 1, "
                         f"got window {window}, enhance_fraction {enhance_fraction}")
    lo = int(window[0] * n)
    hi = min(max(lo, math.ceil(window[1] * n) - 1), n - 2)  # leave a layer to enhance
    lo = min(lo, hi)
    saliency_layer = lo + int(torch.argmax(change[lo:hi + 1]))
    n_enhance = max(1, round(enhance_fraction * n))
    return saliency_layer, list(range(saliency_layer + 1, min(n, saliency_layer + 1 + n_enhance)))


# --- phase 2: the enhancement of one attention row (pure) ---------------------------------------

def enhance_row(a: torch.Tensor, m: torch.Tensor, spans: Spans, visual_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """GIFT on one post-softmax row a (H, seq) of the last position -> (edited row, r).

    hv = top floor(H/2) heads by visual mass; a[hv, visual] *= m; r = (their visual mass after) /
    (before), one scalar; ht = top floor(H/2) heads by query mass (chosen separately: may differ
    from hv); a[ht, query] *= r (skipped when `visual_only`); renormalise every head's row."""
    if m.shape != (spans.n_visual,):
        raise ValueError(f"the multiplier has shape {tuple(m.shape)} but there are "
                         f"{spans.n_visual} visual tokens")
    a = a.float().clone()
    hv = top_heads(a[:, spans.visual].sum(-1))
    before = a[hv, spans.visual].sum()
    a[hv, spans.visual] = a[hv, spans.visual] * m
    r = a[hv, spans.visual].sum() / before if before > 0 else torch.ones(())
    if not visual_only:
        ht = top_heads(a[:, spans.query].sum(-1))
        a[ht, spans.query] = a[ht, spans.query] * r
    return a / a.sum(-1, keepdim=True), r


def vaf_row(a: torch.Tensor, spans: Spans, alpha: float) -> torch.Tensor:
    """VAF-like baseline (ClearSight; GIFT spec §4, arm 2): every visual token's post-softmax
    attention a_j scaled by (1 + alpha * a_j), in every head, then the row renormalised to sum
    to 1 (spec §6: scale probabilities, then renormalise). The boost is proportional to the
    token's own attention, so the high-attention sink is boosted *most*: with visual (0.5 sink,
    0.1) and query 0.4 at alpha = 1 the row becomes (0.75, 0.11, 0.4) / 1.26 and the sink's share
    of the visual attention rises from 0.833 to 0.872. That, and the unrebalanced query, is what
    GIFT argues against. Applied to the same rows, layers and steps as GIFT, so the arms differ
    only in what they boost. alpha multiplies weights in [0, 1], so its useful range is far
    larger than GIFT's exponent (calibrate's `vaf_alpha_grid`)."""
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    a = a.float().clone()
    visual = a[:, spans.visual]
    a[:, spans.visual] = visual * (1 + alpha * visual)   # spec §4: x (1 + alpha * A)
    return a / a.sum(-1, keepdim=True)


def gift_edit(spans: Spans, m: torch.Tensor, visual_only: bool = False) -> Edit:
    return lambda row: enhance_row(row, m.to(row.device), spans, visual_only)[0]


def vaf_edit(spans: Spans, alpha: float) -> Edit:
    return lambda row: vaf_row(row, spans, alpha)


class BatchEdit:
    """An edit of a batch's last rows (B, H, seq) -> (B, H, seq): sample b's row gets `edits[b]`.

    Prompts of one batch share their spans (same template and query length, no padding), so
    every sample's visual and query tokens sit at the same positions; each sample keeps its own
    multiplier m (saliency is per sample, spec §2)."""

    batched = True

    def __init__(self, edits: Sequence[Edit]):
        self.edits = list(edits)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] != len(self.edits):
            raise ValueError(f"the batch has {rows.shape[0]} rows but {len(self.edits)} edits")
        return torch.stack([edit(row) for edit, row in zip(self.edits, rows)])


# --- the attention hook (transformers' eager path) ----------------------------------------------

HOOKED_ATTENTION = "gift_eager"  # name registered in transformers' ALL_ATTENTION_FUNCTIONS


def _hooked_eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float, dropout: float = 0.0, **kwargs):
    """The model's own `eager_attention_forward`, then the last query position's row edited and
    its output recomputed: attn_output[:, -1] = edited row @ V. Returns the edited weights, so
    `output_attentions` shows what the values were mixed with."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise TypeError(f"{type(module).__module__} has no eager_attention_forward: the GIFT hook "
                        "supports transformers' Llama-style attention modules")
    output, weights = eager(module, query, key, value, attention_mask, scaling=scaling,
                            dropout=dropout, **kwargs)
    weights = weights.clone()
    if getattr(module.gift_edit, "batched", False):
        weights[:, :, -1, :] = module.gift_edit(weights[:, :, -1, :]).to(weights.dtype)
    else:
        if weights.shape[0] != 1:
            raise ValueError(f"the GIFT hook runs one sample at a time (batch 1), got batch "
                             f"{weights.shape[0]}; a batch needs a BatchEdit")
        weights[0, :, -1, :] = module.gift_edit(weights[0, :, -1, :]).to(weights.dtype)
    rows = weights[:, :, -1, :]                                       # (B, H, seq)
    groups = getattr(module, "num_key_value_groups", 1)  # grouped-query heads share values
    values = value.repeat_interleave(groups, dim=1)                   # (B, H, seq, d)
    output = output.clone()
    output[:, -1] = torch.einsum("bhk,bhkd->bhd", rows, values).to(output.dtype)
    return output, weights


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The decoder's self-attention modules by layer index (those with a `layer_idx`)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if hasattr(module, "layer_idx") and hasattr(module, "config") and hasattr(module, "o_proj"):
            if module.layer_idx in found:
                raise ValueError(f"two attention modules claim layer {module.layer_idx} (the "
                                 f"second is {name}): pass the language model, not its wrapper")
            found[module.layer_idx] = module
    if not found:
        raise ValueError(f"no decoder attention modules (with layer_idx) in {type(model).__name__}")
    return found


@contextmanager
def attention_hook(model: nn.Module, layers: Sequence[int], edit: Edit) -> Iterator[None]:
    """Apply `edit` to the last position's attention row in `layers`, at every forward inside the
    block: the prefill's last prompt token, then each decoding step (with the KV cache, each
    step's query is the last position).

    Mechanism: transformers dispatches attention by `module.config._attn_implementation` through
    `ALL_ATTENTION_FUNCTIONS`. We register `gift_eager` there once and give each chosen layer's
    attention module a shallow copy of the config that names it; every other layer, the mask
    builder and `output_attentions` still see the untouched shared config ('eager'), so the
    masks keep their eager format and the model is restored exactly on exit."""
    from transformers import AttentionInterface

    require_eager(model)
    if model.training:
        raise ValueError("GIFT is an inference-time method: call model.eval() first (eager "
                         "attention applies dropout before the hook sees the probabilities)")
    modules = attention_modules(model)
    missing = [layer for layer in layers if layer not in modules]
    if missing or not layers:
        raise ValueError(f"enhancement layers {list(layers)} must be non-empty and within the "
                         f"model's layers 0..{max(modules)}; not found: {missing}")
    AttentionInterface.register(HOOKED_ATTENTION, _hooked_eager_attention)
    saved = {layer: modules[layer].config for layer in layers}
    try:
        for layer in layers:
            hooked = copy.copy(saved[layer])
            hooked._attn_implementation_internal = HOOKED_ATTENTION
            modules[layer].config = hooked
            modules[layer].gift_edit = edit
        yield
    finally:
        for layer, config in saved.items():
            modules[layer].config = config
            if hasattr(modules[layer], "gift_edit"):
                del modules[layer].gift_edit


@torch.no_grad()
def prefill_attentions(model: nn.Module, **inputs) -> tuple[torch.Tensor, ...]:
    """Phase 1's single prefill: every layer's attention (1, H, S, S), eager path only."""
    require_eager(model)
    return model(**inputs, output_attentions=True, use_cache=False).attentions
