"""Stage `data` of pipeline `vlm`: the shapes world and the rendered-text family, every split.

    <paths.vlm_data>/shapes/{train,val,test}.parquet             one row per image
    <paths.vlm_data>/shapes/{train,val,test}_questions.parquet   yes/no questions (POPE style)
    <paths.vlm_data>/rendered_text/{train,val,test}.parquet      content, question, image

Held-out splits are drawn first (test, val, then train), each disjoint from the earlier ones
(shapes: on the pixels; rendered text: on the content), so growing `train` leaves them as they
are. Popular and adversarial negatives come from the TRAIN captions' statistics. Before anything
is written every table passes its great-expectations suite, the shapes ground truth its row
checks (stages/tasks/shapes.py), and every rendered-text target verifies itself; the whole
folder is then replaced in one rename.

    python -m stages vlm data
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.core.checks import DataValidationError, validate_frame
# aliases: `shapes` and `rendered_text` are also Config fields
from stages.tasks import rendered_text as text_family
from stages.tasks import shapes as shapes_family


class Sizes(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train: int = Field(ge=1, le=10_000_000, description="train rows")
    val: int = Field(ge=1, le=1_000_000, description="validation rows (method settings)")
    test: int = Field(ge=1, le=1_000_000, description="test rows (reported numbers)")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out: str = Field("vlm_data", description="path key of the output folder")
    shapes: shapes_family.Config = Field(default_factory=shapes_family.Config,
                                         description="shapes world")
    shapes_sizes: Sizes = Field(default_factory=lambda: Sizes(train=3000, val=200, test=500),
                                description="images per split")
    rendered_text: text_family.Config = Field(default_factory=text_family.Config,
                                                description="rendered-text layout and content")
    text_sizes: Sizes = Field(default_factory=lambda: Sizes(train=3000, val=200, test=500),
                              description="rows per split")


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def cooccur_rate(objects: list[list[str]], pairs: list[tuple[str, str]]) -> float:
    """P(partner | anchor) pooled over the planted pairs (NaN without any anchor)."""
    with_anchor = sum(1 for objs in objects for a, _ in pairs if a in objs)
    both = sum(1 for objs in objects for a, b in pairs if a in objs and b in objs)
    return both / with_anchor if with_anchor else float("nan")


def build_shapes(cfg: Config, seed: int, out: Path, label_root: Path, root: Path
                 ) -> dict[str, float]:
    sizes = {s: getattr(cfg.shapes_sizes, s) for s in shapes_family.SPLITS}
    splits = shapes_family.generate_splits(cfg.shapes, sizes, seed)
    freq, cooc = shapes_family.train_statistics(r["objects"] for r in splits["train"])
    metrics: dict[str, float] = {}
    for split, rows in splits.items():
        df = pl.DataFrame(rows, schema=shapes_family.SCHEMA)
        qa = pl.DataFrame(shapes_family.questions(cfg.shapes, rows, freq, cooc, seed, split),
                          schema=shapes_family.QUESTION_SCHEMA)
        name = _rel(label_root / "shapes" / f"{split}.parquet", root)
        validate_frame(df, shapes_family.expectations(cfg.shapes, split), name)
        shapes_family.check_ground_truth(df, cfg.shapes, name)
        validate_frame(qa, shapes_family.question_expectations(cfg.shapes, split),
                       _rel(label_root / "shapes" / f"{split}_questions.parquet", root))
        io.write_parquet(out / "shapes" / f"{split}.parquet", df)
        io.write_parquet(out / "shapes" / f"{split}_questions.parquet", qa)
        metrics[f"shapes_{split}_images"] = float(df.height)
        metrics[f"shapes_{split}_questions"] = float(qa.height)
        metrics[f"shapes_{split}_cooccur_rate"] = cooccur_rate(df["objects"].to_list(),
                                                               cfg.shapes.pairs)
        metrics[f"shapes_{split}_objects_mean"] = float(df["n_objects"].mean())
    return metrics


def build_text(cfg: Config, seed: int, out: Path, label_root: Path, root: Path
               ) -> dict[str, float]:
    sizes = {s: getattr(cfg.text_sizes, s) for s in text_family.SPLITS}
    splits = text_family.generate_splits(cfg.rendered_text, sizes, seed)
    metrics: dict[str, float] = {}
    for split, rows in splits.items():
        df = pl.DataFrame(rows, schema=text_family.SCHEMA)
        name = _rel(label_root / "rendered_text" / f"{split}.parquet", root)
        validate_frame(df, text_family.expectations(cfg.rendered_text, split), name)
        for row in rows:
            if not (text_family.verify_answer(row, row["target"])
                    and text_family.ocr_exact(row, row["content"])):
                raise DataValidationError(
                    f"{name}: row {row['id']}: rule 'target verifies' failed: "
                    f"{row['target']!r}", source=name, column="target", rule="target verifies")
        io.write_parquet(out / "rendered_text" / f"{split}.parquet", df)
        metrics[f"text_{split}_rows"] = float(df.height)
        metrics[f"text_{split}_chars_per_token"] = float(df["chars_per_token"].mean())
        metrics[f"text_{split}_chars_per_token_min"] = float(df["chars_per_token"].min())
    return metrics


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    text_family.check_font(cfg.rendered_text.font)   # before any compute
    out = ctx.path(cfg.out)
    metrics: dict[str, float] = {}
    with io.atomic_path(out, is_dir=True) as tmp:
        t0 = time.perf_counter()
        metrics.update(build_shapes(cfg, ctx.seed, tmp, out, ctx.root))
        t1 = time.perf_counter()
        metrics.update(build_text(cfg, ctx.seed, tmp, out, ctx.root))
        metrics["shapes_seconds"] = t1 - t0
        metrics["text_seconds"] = time.perf_counter() - t1
    ctx.log_params({"font": cfg.rendered_text.font,
                    "font_sha256": text_family.font_sha(cfg.rendered_text.font),
                    "renderer_version": text_family.RENDERER_VERSION})
    metrics["renderer_version"] = float(text_family.RENDERER_VERSION)
    metrics["text_visual_tokens"] = float(cfg.rendered_text.visual_tokens)
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: test sizes, the planted prior in train vs test, the text compression."""
    keys = ("shapes_train_cooccur_rate", "shapes_test_cooccur_rate", "text_test_chars_per_token")
    return {k: metrics[k] for k in keys if k in metrics}
