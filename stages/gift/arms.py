"""The four GIFT arms on a tiny VLM (GIFT spec §4), batched: what `calibrate` and `decode` run.

- `greedy`: plain greedy decoding;
- `vaf`: the VAF-like baseline, each visual token's attention a_j x (1 + alpha * a_j) in every
  head of the enhancement layers (`gift.vaf_row`), then renormalised: the boost grows with the
  token's own attention, so the sink gains most;
- `gift_visual`: GIFT without the query rescaling (the paper's "visual-only" ablation);
- `gift`: full GIFT (`gift.enhance_row`).

Every arm edits the same rows: the last position's attention row in the enhancement layers L_e,
at the prefill's last prompt token and at every decoding step (spec §2). GIFT's saliency map
comes from one eager prefill per sample (`gift.prefill_attentions`) in the saliency layer L_s;
`choose_layers` picks L_s / L_e from the validation split (`calibrate`).

Batching: the prompts of one call share one template and one query length (the caption prompt;
the POPE questions `is there a <colour> <shape> ?` are five words each), so there is no
padding and one `Spans` holds for the whole batch (`batch_spans` checks it); each sample keeps
its own multiplier (`gift.BatchEdit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stages.gift import gift
from stages.models import vlm as vlm_model

ARMS = ("greedy", "vaf", "gift_visual", "gift")
HOOKED = ("vaf", "gift_visual", "gift")


def batch_spans(vlm: vlm_model.VLM, prompts: Sequence[Sequence[int]]) -> vlm_model.Spans:
    """The spans every prompt of a batch shares (ValueError when lengths or spans differ)."""
    spans = {vlm_model.prompt_spans(p, vlm.tokenizer, vlm.layout) for p in prompts}
    if len(spans) != 1:
        raise ValueError(f"a GIFT batch needs prompts with identical spans (one template, one "
                         f"query length), got {len(spans)} different layouts")
    return spans.pop()


def informative_words(vlm: vlm_model.VLM, prompt: Sequence[int], spans: vlm_model.Spans
                      ) -> list[str]:
    """The query's tokens as words (word tokenizer: one token per word)."""
    return vlm.tokenizer.convert_ids_to_tokens(list(prompt[spans.q0:spans.q1 + 1]))


def inputs(vlm: vlm_model.VLM, prompts: Sequence[Sequence[int]], images: Sequence[Any]
           ) -> dict[str, torch.Tensor]:
    ids, mask = vlm_model.left_pad(prompts, vlm.tokenizer.pad_token_id)
    device = vlm.model.device
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "pixel_values": vlm_model.pixel_values(vlm.processor, images).to(device)}


def multipliers(vlm: vlm_model.VLM, batch: dict[str, torch.Tensor], spans: vlm_model.Spans,
                saliency_layer: int, alpha: float, informative: torch.Tensor | None
                ) -> torch.Tensor:
    """Phase 1 for a batch: one eager prefill, then each sample's m (B, n_visual)."""
    attentions = gift.prefill_attentions(vlm.model, **batch)
    return torch.stack([
        gift.saliency_multiplier([a[b:b + 1] for a in attentions], spans, [saliency_layer],
                                 alpha, informative)
        for b in range(batch["input_ids"].shape[0])])


def layer_change(vlm: vlm_model.VLM, prompts: Sequence[Sequence[int]], images: Sequence[Any],
                 lexicon: set[str], batch_size: int = 64) -> torch.Tensor:
    """Total gaze shift per layer summed over the samples (input of `gift.choose_layers`)."""
    total = None
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        spans = batch_spans(vlm, chunk)
        mask = gift.informative_mask(informative_words(vlm, chunk[0], spans), lexicon)
        attentions = gift.prefill_attentions(vlm.model, **inputs(vlm, chunk,
                                                                 images[i:i + batch_size]))
        for b in range(len(chunk)):
            change = gift.positive_change_per_layer([a[b:b + 1] for a in attentions], spans,
                                                    mask)
            total = change if total is None else total + change
    assert total is not None, "no prompts"
    return total


def decode(vlm: vlm_model.VLM, prompts: Sequence[Sequence[int]], images: Sequence[Any], *,
           arm: str, alpha: float, saliency_layer: int, enhance_layers: Sequence[int],
           lexicon: set[str], max_new_tokens: int, batch_size: int = 64) -> list[str]:
    """Greedy completions under one arm (see module docstring), decoded without specials."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; expected one of {ARMS}")
    if len(prompts) != len(images):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} images")
    tok = vlm.tokenizer
    out: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        batch = inputs(vlm, chunk, images[i:i + batch_size])
        generate = {"max_new_tokens": max_new_tokens, "do_sample": False,
                    "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
        with torch.no_grad():
            if arm == "greedy":
                seqs = vlm.model.generate(**batch, **generate)
            else:
                spans = batch_spans(vlm, chunk)
                if arm == "vaf":
                    edit: Any = gift.vaf_edit(spans, alpha)
                    edit = gift.BatchEdit([edit] * len(chunk))
                else:
                    mask = gift.informative_mask(informative_words(vlm, chunk[0], spans), lexicon)
                    m = multipliers(vlm, batch, spans, saliency_layer, alpha, mask)
                    edit = gift.BatchEdit([gift.gift_edit(spans, m[b], arm == "gift_visual")
                                           for b in range(len(chunk))])
                with gift.attention_hook(vlm.model, enhance_layers, edit):
                    seqs = vlm.model.generate(**batch, **generate)
        out += tok.batch_decode(seqs[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def output_attention(vlm: vlm_model.VLM, prompts: Sequence[Sequence[int]],
                     images: Sequence[Any], max_new_tokens: int) -> torch.Tensor:
    """The attention-sink plot's data: the generated tokens' attention over the visual span
    (sinks first), averaged over layers, heads, decoding steps and samples -> (n_visual,).
    Greedy decoding, eager attention."""
    vlm_model.require_eager(vlm.model)
    batch = inputs(vlm, prompts, images)
    spans = batch_spans(vlm, prompts)
    tok = vlm.tokenizer
    with torch.no_grad():
        out = vlm.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 output_attentions=True, return_dict_in_generate=True)
    rows = []
    for step in out.attentions:                      # per step: one (B, H, q, seq) per layer
        for layer in step:
            rows.append(layer[:, :, -1, spans.visual].float().mean(dim=(0, 1)))
    return torch.stack(rows).mean(0)


# What the official code's POS filter ({NOUN, PROPN, VERB, ADJ, ADV, NUM}) keeps of the caption
# prompt `describe the image .` (stages.tasks.shapes.CAPTION_QUERY): the verb and the noun, not
# the article or the full stop. The POPE questions `is there a <colour> <shape> ?` keep the
# colour and the shape (`is` is AUX, `there` PRON), which the class words cover.
PROMPT_WORDS = frozenset({"describe", "image"})


def load_split(data_dir: Any, split: str, max_rows: int | None
               ) -> tuple[Any, list[Any], Any, list[str], set[str]]:
    """(images table, decoded images, its POPE questions, object vocabulary, lexicon) of one
    shapes split, every table and image checked first (stages/train/vlm.py `load_family`).
    The lexicon (spec §4: "a fixed lexicon of object and colour words", standing in for spaCy's
    POS filter) is every colour and shape word of the classes, plus `PROMPT_WORDS`, the caption
    prompt's content words."""
    from stages.tasks import shapes
    from stages.train.vlm import load_family

    df, images, qa = load_family(data_dir, "shapes", split, 64)
    if max_rows:
        df, images = df.head(max_rows), images[:max_rows]
        qa = qa.filter(qa["image_id"].is_in(df["id"].to_list()))
    colours, kinds = set(), set()
    for name in {n for objs in df["objects"].to_list() for n in objs} | set(qa["object"]):
        colour, kind = name.split(" ")
        colours.add(colour)
        kinds.add(kind)
    return df, images, qa, shapes.class_names(colours, kinds), colours | kinds | PROMPT_WORDS
