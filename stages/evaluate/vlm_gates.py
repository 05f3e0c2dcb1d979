"""Stage `gates` of pipeline `vlm`: is the substrate fit for the papers that build on it?

Per seed, on the test splits, with greedy decoding:
- `vlm-shapes`: caption object precision / recall / F1 and CHAIR_S / CHAIR_I (exact class
  vocabulary `shapes.class_names`, counted by stages/evaluate/hallucination.py); POPE-style
  yes/no accuracy and F1 on random, popular and adversarial negatives; and where the caption
  prompt's last token looks among the visual tokens (the share of its visual attention on the
  constant sinks, averaged over layers and heads: GIFT spec §4 asks to check the sink first).
- `vlm-text`: OCR exact match and character accuracy on the rendered images; accuracy of the
  text-conditioned answer (trained) and of the image-conditioned answer (never trained: the
  transfer gap CoRe starts from); the compression ratio (characters per visual token).

Gates (issue 18) [ours: the thresholds are params]: CHAIR_S >= `min_chair_sentence` (0.20: there
must be hallucination for GIFT to remove) and OCR exact match >= `min_ocr_exact` (0.98: the text can
be read, so a reasoning gap is not a reading gap), both on the mean over seeds. The stage reports
a gate that fails, it does not stop: the numbers are the finding either way.

    python -m stages vlm gates
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io

# CHAIR_S / CHAIR_I are `chair_sentence` / `chair_instance`: a key ending in `_s` would read as
# a wall time in seconds (stages.core.io.is_timing_key) and never reach the metrics files.
SHAPES_KEYS = ("caption_f1", "caption_precision", "caption_recall", "chair_sentence",
               "chair_instance",
               "yes_no_acc", "pope_random_f1", "pope_popular_f1", "pope_adversarial_f1",
               "pope_adversarial_acc", "sink_attention")
TEXT_KEYS = ("ocr_exact", "ocr_char_acc", "text_qa_acc", "image_qa_acc")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str = Field("vlm_data", description="path key of the data stage's folder")
    shapes_models: str = Field("vlm_shapes", description="path key: seed<k>/ shapes models")
    text_models: str = Field("vlm_text", description="path key: seed<k>/ text models")
    samples: str = Field("vlm_samples", description="path key: generated outputs (parquet)")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="the vlm-text seeds, and the vlm-shapes ones "
                                         "unless `shapes_seeds` is set")
    shapes_seeds: list[int] | None = Field(None, min_length=1, description="vlm-shapes seeds, "
                                           "where train_shapes trained more than `seeds` "
                                           "(SAME's 5 seeds); None: `seeds`")
    split: str = Field("test", description="split the gates are measured on")
    max_rows: int | None = Field(None, ge=1, description="evaluate at most this many rows")
    caption_tokens: int = Field(24, ge=1, le=512, description="max new tokens of a caption")
    ocr_tokens: int = Field(128, ge=1, le=4096, description="max new tokens of a transcription")
    answer_tokens: int = Field(48, ge=1, le=512, description="max new tokens of an answer")
    sink_rows: int = Field(64, ge=1, description="caption prompts the sink share is taken on")
    batch_size: int = Field(64, ge=1, le=4096, description="prompts per generate call")
    min_chair_sentence: float = Field(0.20, ge=0, le=1, description="gate: CHAIR_S at least this")
    min_ocr_exact: float = Field(0.98, ge=0, le=1, description="gate: OCR exact match at least")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads; 0 = all cores")

    @field_validator("seeds", "shapes_seeds")
    @classmethod
    def _distinct(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"seeds {value} repeat a seed")
        return value

    def family_seeds(self, family: str) -> list[int]:
        """The seeds whose models `family` ('shapes' or 'text') is gated on."""
        return self.shapes_seeds if family == "shapes" and self.shapes_seeds else self.seeds


def sink_attention(vlm: Any, prompts: list[list[int]], images: list[Any]) -> float:
    """Mean over prompts, layers and heads of the last prompt token's attention on the sinks,
    as a share of its attention on the whole visual span (NaN without sinks)."""
    import torch

    from stages.models import vlm as vlm_model

    vlm_model.require_eager(vlm.model)
    tok, layout = vlm.tokenizer, vlm.layout
    if layout.sink_tokens == 0:
        return math.nan
    spans = vlm_model.prompt_spans(prompts[0], tok, layout)
    shares = []
    for i in range(0, len(prompts), 16):
        ids = torch.tensor(prompts[i:i + 16], device=vlm.model.device)   # one prompt length
        with torch.no_grad():
            pixels = vlm_model.pixel_values(vlm.processor, images[i:i + 16])
            out = vlm.model(input_ids=ids, pixel_values=pixels.to(vlm.model.device),
                            output_attentions=True)
        for layer in out.attentions:                      # (B, H, T, T)
            row = layer[:, :, -1, :].float()
            visual = row[..., spans.visual].sum(-1)
            sinks = row[..., spans.v0:spans.v0 + len(spans.sinks)].sum(-1)
            shares.append((sinks / visual).mean().item())
    return sum(shares) / len(shares)


def evaluate_shapes(vlm: Any, df: Any, images: list[Any], qa: Any, cfg: Config
                    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    from stages.evaluate import hallucination
    from stages.models import vlm as vlm_model
    from stages.tasks import shapes

    tok, layout = vlm.tokenizer, vlm.layout
    colours, shape_words = set(), set()
    for objs in df["objects"].to_list():
        for name in objs:
            c, s = name.split(" ")
            colours.add(c)
            shape_words.add(s)
    vocabulary = shapes.class_names(colours, shape_words)
    prompts = [vlm_model.encode_image_prompt(layout, tok, q) for q in df["query"]]
    vlm_model.prompt_spans(prompts[0], tok, layout, df["query"][0])   # the layout holds
    captions = vlm_model.generate(vlm, prompts, images, max_new_tokens=cfg.caption_tokens,
                                  batch_size=cfg.batch_size)
    records = hallucination.chair_per_image(captions, df["objects"].to_list(), vocabulary)
    ch, f1 = hallucination.chair(records), hallucination.objects_f1(records)
    m = {"caption_f1": f1["f1"], "caption_precision": f1["precision"],
         "caption_recall": f1["recall"], "chair_sentence": ch["chair_sentence"],
         "chair_instance": ch["chair_instance"]}
    index = {rid: i for i, rid in enumerate(df["id"].to_list())}
    qa = qa.filter(qa["image_id"].is_in(list(index)))
    q_prompts = [vlm_model.encode_image_prompt(layout, tok, q) for q in qa["query"]]
    q_images = [images[index[i]] for i in qa["image_id"]]
    answers = vlm_model.generate(vlm, q_prompts, q_images, max_new_tokens=2,
                                 batch_size=cfg.batch_size)
    labels, kinds = [bool(x) for x in qa["label"].to_list()], qa["negative"].to_list()
    for kind in shapes.NEGATIVES:        # POPE: the positives + one kind's negatives, balanced
        sel = [i for i, k in enumerate(kinds) if k in ("positive", kind)]
        p = hallucination.pope(hallucination.pope_per_item([answers[i] for i in sel],
                                                           [labels[i] for i in sel]))
        m[f"pope_{kind}_acc"], m[f"pope_{kind}_f1"] = p["accuracy"], p["f1"]
        m[f"pope_{kind}_yes_rate"] = p["yes_ratio"]
    m["yes_no_acc"] = sum(m[f"pope_{k}_acc"] for k in shapes.NEGATIVES) / len(shapes.NEGATIVES)
    n = min(cfg.sink_rows, len(prompts))
    m["sink_attention"] = sink_attention(vlm, prompts[:n], images[:n])
    samples = [{"id": rid, "target": t, "output": c, "hallucinated": r["hallucinated"]}
               for rid, t, c, r in zip(df["id"], df["target"], captions, records)]
    return m, samples


def evaluate_text(vlm: Any, df: Any, images: list[Any], cfg: Config
                  ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    from stages.models import vlm as vlm_model
    from stages.tasks import rendered_text
    from stages.train.vlm import OCR_QUERY

    tok, layout = vlm.tokenizer, vlm.layout
    rows = df.to_dicts()
    ocr_prompt = vlm_model.encode_image_prompt(layout, tok, OCR_QUERY)
    reads = vlm_model.generate(vlm, [ocr_prompt] * len(rows), images,
                               max_new_tokens=cfg.ocr_tokens, batch_size=cfg.batch_size)
    text_prompts = [vlm_model.encode_text_prompt(layout, tok, r["content"], r["query"])
                    for r in rows]
    text_answers = vlm_model.generate(vlm, text_prompts, None, max_new_tokens=cfg.answer_tokens,
                                      batch_size=cfg.batch_size)
    image_prompts = [vlm_model.encode_image_prompt(layout, tok, r["query"]) for r in rows]
    image_answers = vlm_model.generate(vlm, image_prompts, images,
                                       max_new_tokens=cfg.answer_tokens, batch_size=cfg.batch_size)
    n = len(rows)
    m = {"ocr_exact": sum(rendered_text.ocr_exact(r, o) for r, o in zip(rows, reads)) / n,
         "ocr_char_acc": sum(rendered_text.char_accuracy(r["content"], o)
                             for r, o in zip(rows, reads)) / n,
         "text_qa_acc": sum(rendered_text.verify_answer(r, a)
                            for r, a in zip(rows, text_answers)) / n,
         "image_qa_acc": sum(rendered_text.verify_answer(r, a)
                             for r, a in zip(rows, image_answers)) / n}
    samples = [{"id": r["id"], "target": r["content"], "output": o, "hallucinated": 0}
               for r, o in zip(rows, reads)]
    return m, samples


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.stats import mean_std
    from stages.models import vlm as vlm_model
    from stages.models.base import set_threads
    from stages.train.vlm import load_family

    set_threads(cfg.num_threads)
    data_dir = ctx.path(cfg.data)
    folders = {"shapes": ctx.path(cfg.shapes_models), "text": ctx.path(cfg.text_models)}
    for family, folder in folders.items():      # every model present before any compute
        missing = [s for s in cfg.family_seeds(family)
                   if not (folder / f"seed{s}" / "config.json").is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: no model for seeds {missing}; run the "
                                    f"train_{family} stage with these seeds")
    sample_rows: list[dict[str, Any]] = []
    per_seed: dict[str, list[float]] = {}
    metrics: dict[str, float] = {}
    for family, keys in (("shapes", SHAPES_KEYS), ("text", TEXT_KEYS)):
        fam = "shapes" if family == "shapes" else "rendered_text"
        df, images, qa = load_family(data_dir, fam, cfg.split, None)
        if cfg.max_rows:
            df, images = df.head(cfg.max_rows), images[:cfg.max_rows]
        for seed in cfg.family_seeds(family):
            vlm = vlm_model.load_vlm(folders[family] / f"seed{seed}")
            if family == "shapes":
                m, samples = evaluate_shapes(vlm, df, images, qa, cfg)
            else:
                m, samples = evaluate_text(vlm, df, images, cfg)
                m["chars_per_token"] = float(df["chars_per_token"].mean())
            print(f"gates: {family} seed {seed}: " + ", ".join(f"{k} {v:.3f}"
                                                              for k, v in m.items()))
            metrics.update({f"{family}/seed{seed}/{k}": v for k, v in m.items()})
            for k, v in m.items():
                per_seed.setdefault(f"{family}/{k}", []).append(v)
            sample_rows += [{"family": family, "seed": seed, **s} for s in samples]
            if ctx.tracker is not None:
                ctx.tracker.annotate_model(folders[family] / f"seed{seed}",
                                           {k: v for k, v in m.items() if math.isfinite(v)})
    for key, values in per_seed.items():
        metrics[f"{key}_mean"], metrics[f"{key}_std"] = mean_std(values)
    chair_sentence = metrics["shapes/chair_sentence_mean"]
    ocr = metrics["text/ocr_exact_mean"]
    metrics["gate_chair"] = float(chair_sentence >= cfg.min_chair_sentence)
    metrics["gate_ocr_exact"] = float(ocr >= cfg.min_ocr_exact)
    metrics["min_chair_sentence"] = cfg.min_chair_sentence
    metrics["min_ocr_exact"] = cfg.min_ocr_exact
    io.write_parquet(ctx.path(cfg.samples), pl.DataFrame(sample_rows, infer_schema_length=None))
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the four gate numbers (mean over seeds) and whether each gate holds."""
    keys = {"caption_f1": "shapes/caption_f1_mean", "yes_no_acc": "shapes/yes_no_acc_mean",
            "chair_sentence": "shapes/chair_sentence_mean", "ocr_exact": "text/ocr_exact_mean",
            "gate_chair": "gate_chair", "gate_ocr": "gate_ocr_exact"}
    return {short: metrics[k] for short, k in keys.items() if k in metrics}


ROWS = (("shapes", "caption_f1", "caption object F1"),
        ("shapes", "caption_precision", "caption object precision"),
        ("shapes", "caption_recall", "caption object recall"),
        ("shapes", "chair_sentence", "CHAIR_S (captions with a hallucinated object)"),
        ("shapes", "chair_instance", "CHAIR_I (hallucinated / mentioned objects)"),
        ("shapes", "yes_no_acc", "yes/no accuracy (mean of the three POPE sets)"),
        ("shapes", "pope_random_f1", "POPE F1, random negatives"),
        ("shapes", "pope_popular_f1", "POPE F1, popular negatives"),
        ("shapes", "pope_adversarial_f1", "POPE F1, adversarial (co-occurrence) negatives"),
        ("shapes", "sink_attention", "share of the last prompt token's visual attention on sinks"),
        ("text", "ocr_exact", "OCR exact match"),
        ("text", "ocr_char_acc", "OCR character accuracy"),
        ("text", "text_qa_acc", "answer accuracy, text-conditioned (trained)"),
        ("text", "image_qa_acc", "answer accuracy, image-conditioned (never trained)"),
        ("text", "chars_per_token", "characters per visual token"))


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """The README block of `paperline report vlm`: every gate number, mean ± std over seeds,
    and each gate's verdict."""
    m = metrics.get("gates", {})
    if "shapes/chair_sentence_mean" not in m:
        return "_No results yet: run the pipeline._\n"
    seeds = sorted({int(k.split("/")[1][4:]) for k in m if k.count("/") == 2})
    per_family = {f: sorted({int(k.split("/")[1][4:]) for k in m
                             if k.count("/") == 2 and k.startswith(f"{f}/")})
                  for f in ("shapes", "text")}
    lines = [f"Test split, greedy decoding, mean ± std over training seeds (vlm-shapes: "
             f"{', '.join(map(str, per_family['shapes']))}; vlm-text: "
             f"{', '.join(map(str, per_family['text']))}).", "",
             "| model | metric | mean ± std | per seed |", "|---|---|---|---|"]
    for family, key, label in ROWS:
        mean, std = m.get(f"{family}/{key}_mean"), m.get(f"{family}/{key}_std")
        if mean is None:
            continue
        per = ", ".join(f"{m[f'{family}/seed{s}/{key}']:.3f}" for s in seeds
                        if f"{family}/seed{s}/{key}" in m)
        name = "vlm-shapes" if family == "shapes" else "vlm-text"
        lines.append(f"| {name} | {label} | {mean:.3f} ± {std:.3f} | {per} |")
    verdict = {1.0: "holds", 0.0: "FAILS"}
    lines += ["", "**Gates** (on the means): CHAIR_S ≥ "
                  f"{m.get('min_chair_sentence', float('nan')):.2f} "
                  f"(there is hallucination to fix): {verdict.get(m.get('gate_chair'), '?')}; "
                  f"OCR exact match ≥ {m.get('min_ocr_exact', float('nan')):.2f} (the text can "
                  f"be read): {verdict.get(m.get('gate_ocr_exact'), '?')}.", ""]
    return "\n".join(lines)
