"""Task family `shapes`: a 64x64 shapes world with exact ground truth and a planted language prior.

Each image holds 1-4 objects from `colours x shapes` (5 x 4 = 20 classes by default) on a
textured grey background (stripes, checker or noise). Objects sit in distinct cells of a 2x2
grid, at most once per class, so the object list of an image is exact and the caption order is
fixed (cell order: top-left, top-right, bottom-left, bottom-right):

    caption   a red circle and a blue triangle and a green square
    objects   ["red circle", "blue triangle", "green square"]

The language prior GIFT needs [reconstructed, spec §4]: each `pairs` entry (anchor -> partner)
makes the partner present in `cooccur_p` (0.8) of the training images that hold the anchor, and
in only `eval_cooccur_p` (0.5) of the val/test images, so a model that learned the prior names
the partner where it is absent: a hallucination CHAIR counts exactly.

Two tables per split (both from the same images):
- `<split>.parquet`, one row per image: PNG bytes, the object list (CHAIR's ground truth), cells,
  positions, sizes, the caption task (`query` -> `target`).
- `<split>_questions.parquet`, yes/no existence questions (POPE style): one positive and one
  negative per negative type per image. `random`: an absent class drawn uniformly; `popular`: one
  of the `popular_k` classes most frequent in the TRAIN captions that is absent; `adversarial`:
  the absent class that co-occurs most with the image's objects in the TRAIN captions (the planted
  partner where the anchor is present). Train questions use `train_negatives` only.

The exact object vocabulary is `class_names` (a `<colour> <shape>` phrase; a bare shape names
no class); CHAIR and POPE counting over it live in stages/evaluate/hallucination.py, shared by
the gates and the papers.
Everything is deterministic in the seed (private `random.Random` / numpy generators).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import numpy as np

    from stages.core.checks import FrameSpec

FAMILY = "shapes"
SPLITS = ("test", "val", "train")          # generation order: held-out splits first
NEGATIVES = ("random", "popular", "adversarial")
TEXTURES = ("stripes", "checker", "noise")
CAPTION_QUERY = "describe the image ."

SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String,                 # shapes-train-000123
    "family": pl.String,             # "shapes"
    "split": pl.String,
    "image": pl.Binary,              # PNG, RGB, image_size x image_size
    "image_sha": pl.String,          # SHA-256 of the pixels: unique across all splits
    "objects": pl.List(pl.String),   # class names in caption (cell) order: CHAIR's ground truth
    "cells": pl.List(pl.Int64),      # grid cell of each object (0 = top-left, row-major)
    "xs": pl.List(pl.Int64),         # object centre x, pixels
    "ys": pl.List(pl.Int64),         # object centre y, pixels
    "sizes": pl.List(pl.Int64),      # object side / diameter, pixels
    "n_objects": pl.Int64,
    "texture": pl.String,            # stripes | checker | noise
    "query": pl.String,              # "describe the image ."
    "target": pl.String,             # the caption
    "difficulty": pl.Int64,          # = n_objects
}

QUESTION_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String,                 # shapes-train-000123-q2
    "image_id": pl.String,           # the image row's id
    "split": pl.String,
    "object": pl.String,             # the class asked about
    "negative": pl.String,           # positive | random | popular | adversarial
    "query": pl.String,              # "is there a red circle ?"
    "target": pl.String,             # "yes" | "no"
    "label": pl.Int64,               # 1 = present
}


class Config(BaseModel):
    """Knobs of the shapes world (every one a param; the defaults are the `cpu` world)."""

    model_config = ConfigDict(extra="forbid")

    image_size: int = Field(64, ge=16, le=1024, description="square image side, pixels")
    grid: int = Field(2, ge=1, le=8, description="objects sit in distinct cells of a grid x grid")
    colours: dict[str, list[int]] = Field(
        default_factory=lambda: {"red": [220, 40, 40], "green": [40, 170, 60],
                                 "blue": [40, 80, 230], "yellow": [235, 205, 30],
                                 "purple": [150, 60, 200]},
        min_length=1, description="colour word -> RGB")
    shapes: list[str] = Field(default_factory=lambda: ["circle", "square", "triangle", "diamond"],
                              min_length=1, description="shape words (each has a drawing)")
    min_objects: int = Field(1, ge=1, le=64, description="fewest objects in an image")
    max_objects: int = Field(4, ge=1, le=64, description="most objects in an image (<= grid^2)")
    min_size: int = Field(12, ge=4, le=512, description="smallest object size, pixels")
    max_size: int = Field(16, ge=4, le=512, description="largest object size, pixels")
    jitter: int = Field(1, ge=0, le=256, description="+- pixels of an object's centre around "
                                                     "its cell's centre")
    colour_jitter: int = Field(20, ge=0, le=60, description="+- per RGB channel of an object")
    outline: int = Field(1, ge=0, le=4, description="dark outline width, pixels (0: none)")
    texture_contrast: int = Field(18, ge=0, le=80, description="background texture amplitude")
    pairs: list[tuple[str, str]] = Field(
        default_factory=lambda: [("red circle", "blue triangle"),
                                 ("green square", "yellow diamond"),
                                 ("purple triangle", "red square"),
                                 ("blue circle", "green diamond")],
        description="planted co-occurrence prior, anchor -> partner classes")
    cooccur_p: float = Field(0.8, ge=0, le=1, description="P(partner | anchor) in train images")
    eval_cooccur_p: float = Field(0.5, ge=0, le=1,
                                  description="P(partner | anchor) in val/test images")
    train_negatives: list[str] = Field(default_factory=lambda: ["random"],
                                       description="negative types of the TRAIN questions")
    popular_k: int = Field(3, ge=1, le=64, description="popular negatives: among the k most "
                                                      "frequent absent train classes")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        classes = set(self.classes)
        for name, rgb in self.colours.items():
            if len(rgb) != 3 or any(not 0 <= c <= 255 for c in rgb):
                raise ValueError(f"colours.{name} = {rgb}: expected three values in 0..255")
            if " " in name:
                raise ValueError(f"colour {name!r}: one word expected (captions are word-level)")
        unknown = sorted(set(self.shapes) - set(DRAW))
        if unknown:
            raise ValueError(f"shapes {unknown}: no drawing for them; known: {sorted(DRAW)}")
        if len(set(self.shapes)) != len(self.shapes):
            raise ValueError(f"shapes {self.shapes} list a shape twice")
        if self.min_objects > self.max_objects:
            raise ValueError(f"min_objects ({self.min_objects}) > max_objects ({self.max_objects})")
        if self.max_objects > self.grid ** 2:
            raise ValueError(f"max_objects = {self.max_objects} does not fit a {self.grid}x"
                             f"{self.grid} grid ({self.grid ** 2} cells)")
        if self.max_objects > len(classes):
            raise ValueError(f"max_objects = {self.max_objects} > {len(classes)} classes "
                             f"(a class appears at most once per image)")
        if self.min_size > self.max_size:
            raise ValueError(f"min_size ({self.min_size}) > max_size ({self.max_size})")
        cell = self.image_size // self.grid
        if (self.max_size + 1) // 2 + self.jitter + 1 > cell // 2:
            raise ValueError(f"max_size = {self.max_size} with jitter {self.jitter} does not fit "
                             f"a grid cell of {cell} px (image_size {self.image_size} / grid "
                             f"{self.grid}) with a margin")
        seen: set[str] = set()
        for anchor, partner in self.pairs:
            for name in (anchor, partner):
                if name not in classes:
                    raise ValueError(f"pairs: {name!r} is not a class; classes are "
                                     f"'<colour> <shape>', e.g. {self.classes[0]!r}")
                if name in seen:
                    raise ValueError(f"pairs: {name!r} appears in two pairs (pairs must be "
                                     f"disjoint so each rate is exact)")
                seen.add(name)
        bad = sorted(set(self.train_negatives) - set(NEGATIVES))
        if bad:
            raise ValueError(f"train_negatives {bad}: known {list(NEGATIVES)}")
        return self

    @property
    def classes(self) -> list[str]:
        return [f"{c} {s}" for c in self.colours for s in self.shapes]


# --- drawing --------------------------------------------------------------------------------

OUTLINE = (20, 20, 20)  # a dark outline: the shape's edges are visible whatever its colour


def _circle(draw: Any, cx: int, cy: int, s: int, fill: tuple, width: int) -> None:
    r = s / 2
    draw.ellipse([cx - r, cy - r, cx + r - 1, cy + r - 1], fill=fill,
                 outline=OUTLINE if width else None, width=width)


def _square(draw: Any, cx: int, cy: int, s: int, fill: tuple, width: int) -> None:
    h = s // 2
    draw.rectangle([cx - h, cy - h, cx - h + s - 1, cy - h + s - 1], fill=fill,
                   outline=OUTLINE if width else None, width=width)


def _triangle(draw: Any, cx: int, cy: int, s: int, fill: tuple, width: int) -> None:
    h = s / 2
    draw.polygon([(cx, cy - h), (cx + h, cy + h - 1), (cx - h, cy + h - 1)], fill=fill,
                 outline=OUTLINE if width else None, width=width)


def _diamond(draw: Any, cx: int, cy: int, s: int, fill: tuple, width: int) -> None:
    h = s / 2
    draw.polygon([(cx, cy - h), (cx + h, cy), (cx, cy + h), (cx - h, cy)], fill=fill,
                 outline=OUTLINE if width else None, width=width)


DRAW = {"circle": _circle, "square": _square, "triangle": _triangle, "diamond": _diamond}


def background(cfg: Config, rng: "np.random.Generator", kind: str) -> "np.ndarray":
    """A grey textured background, (S, S, 3) uint8: low contrast, so colour is the object's."""
    import numpy as np

    s = cfg.image_size
    y, x = np.mgrid[0:s, 0:s].astype(np.float64)
    base = rng.uniform(100, 160)
    c = cfg.texture_contrast
    if kind == "stripes":
        angle, period = rng.uniform(0, np.pi), rng.uniform(4, 10)
        tex = c * np.sin(2 * np.pi * (x * np.cos(angle) + y * np.sin(angle)) / period)
    elif kind == "checker":
        k = int(rng.integers(3, 9))
        tex = c * (((x // k + y // k) % 2) * 2 - 1)
    else:
        tex = rng.normal(0, c / 2, size=(s, s))
    tint = rng.uniform(-8, 8, size=3)
    img = base + tex[..., None] + tint[None, None, :]
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def render(cfg: Config, objects: Sequence[str], cells: Sequence[int], sizes: Sequence[int],
           centres: Sequence[tuple[int, int]], texture: str,
           rng: "np.random.Generator") -> "np.ndarray":
    """Pixels of one image: the background, then each object in its colour (with jitter)."""
    import numpy as np
    from PIL import Image, ImageDraw

    img = Image.fromarray(background(cfg, rng, texture))
    draw = ImageDraw.Draw(img)
    for name, size, (cx, cy) in zip(objects, sizes, centres):
        colour, shape = name.split(" ")
        rgb = np.array(cfg.colours[colour]) + rng.integers(-cfg.colour_jitter,
                                                           cfg.colour_jitter + 1, size=3)
        DRAW[shape](draw, cx, cy, size, tuple(int(v) for v in np.clip(rgb, 0, 255)),
                    cfg.outline)
    return np.asarray(img, dtype=np.uint8)


# --- sampling -------------------------------------------------------------------------------

def sample_classes(cfg: Config, rng: random.Random, cooccur_p: float) -> list[str]:
    """The classes of one image: a uniform draw, then each present anchor's partner forced
    present with probability `cooccur_p` and absent otherwise (pairs are disjoint, so the rate
    P(partner | anchor) is exactly `cooccur_p`)."""
    classes = cfg.classes
    partner_of = dict(cfg.pairs)
    anchors = set(partner_of)
    n = rng.randint(cfg.min_objects, cfg.max_objects)
    chosen = rng.sample(classes, n)
    locked: set[str] = set()
    for anchor, partner in cfg.pairs:
        if anchor not in chosen:
            continue
        locked.add(anchor)
        want = rng.random() < cooccur_p
        # Replacements never add an anchor (it would need its own draw) or a partner whose
        # anchor is present (that would change its rate).
        present_partners = {partner_of[a] for a in chosen if a in anchors}
        fillers = [c for c in classes if c not in chosen and c not in anchors
                   and c not in present_partners]
        if want and partner not in chosen:
            if len(chosen) < cfg.max_objects:
                chosen.append(partner)
            else:
                free = [c for c in chosen if c not in locked and c not in present_partners]
                if not free:  # every slot holds a decided class: keep the draw as it is
                    continue
                chosen[chosen.index(rng.choice(free))] = partner
        elif not want and partner in chosen:
            if fillers:
                chosen[chosen.index(partner)] = rng.choice(fillers)
            elif len(chosen) > cfg.min_objects:
                chosen.remove(partner)
        if partner in chosen:
            locked.add(partner)
    return chosen


def sample_image(cfg: Config, rng: random.Random, cooccur_p: float) -> dict[str, Any]:
    """One image's ground truth and pixels."""
    import numpy as np

    classes = sample_classes(cfg, rng, cooccur_p)
    cells = sorted(rng.sample(range(cfg.grid ** 2), len(classes)))
    rng.shuffle(classes)                    # which class goes to which cell
    cell_px = cfg.image_size // cfg.grid
    sizes, centres = [], []
    for cell in cells:
        # Centred on the cell's centre (with 8x8 patches and a 2x2 grid, a patch corner: each
        # patch around it sees one quadrant of the shape) +- jitter; the config check keeps
        # the whole object inside its cell.
        size = rng.randint(cfg.min_size, cfg.max_size)
        row, col = divmod(cell, cfg.grid)
        cx = col * cell_px + cell_px // 2 + rng.randint(-cfg.jitter, cfg.jitter)
        cy = row * cell_px + cell_px // 2 + rng.randint(-cfg.jitter, cfg.jitter)
        sizes.append(size)
        centres.append((cx, cy))
    texture = rng.choice(TEXTURES)
    np_rng = np.random.default_rng(rng.getrandbits(64))
    pixels = render(cfg, classes, cells, sizes, centres, texture, np_rng)
    return {"objects": classes, "cells": cells, "sizes": sizes,
            "xs": [c[0] for c in centres], "ys": [c[1] for c in centres],
            "texture": texture, "pixels": pixels}


def caption(objects: Sequence[str]) -> str:
    """`a red circle and a blue square` (objects already in cell order)."""
    return " and ".join(f"a {name}" for name in objects)


def generate(cfg: Config, n: int, seed: int | str, *, split: str = "train",
             exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """`n` image rows of `split`; no image whose pixels are in `exclude` (a set of image_sha)."""
    from stages.tasks.images import encode_png, pixel_sha

    if n < 0:
        raise ValueError(f"n = {n}: expected >= 0")
    rng = random.Random(f"{FAMILY}:{split}:{seed}")
    p = cfg.cooccur_p if split == "train" else cfg.eval_cooccur_p
    seen = set(exclude)
    rows: list[dict[str, Any]] = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 2 * n + 100:
            raise ValueError(f"shapes: only {len(rows)} of {n} distinct images for split {split!r}")
        img = sample_image(cfg, rng, p)
        sha = pixel_sha(img["pixels"])
        if sha in seen:
            continue
        seen.add(sha)
        rows.append({
            "id": f"{FAMILY}-{split}-{len(rows):06d}", "family": FAMILY, "split": split,
            "image": encode_png(img["pixels"]), "image_sha": sha, "objects": img["objects"],
            "cells": img["cells"], "xs": img["xs"], "ys": img["ys"], "sizes": img["sizes"],
            "n_objects": len(img["objects"]), "texture": img["texture"],
            "query": CAPTION_QUERY, "target": caption(img["objects"]),
            "difficulty": len(img["objects"])})
    return rows


def generate_splits(cfg: Config, sizes: dict[str, int], seed: int
                    ) -> dict[str, list[dict[str, Any]]]:
    """Image rows per split, pixel-disjoint; drawn in the order of `sizes` (held-out first)."""
    out: dict[str, list[dict[str, Any]]] = {}
    used: set[str] = set()
    for split, n in sizes.items():
        out[split] = generate(cfg, n, seed, split=split, exclude=used)
        used.update(r["image_sha"] for r in out[split])
    return out


# --- questions (POPE style) -----------------------------------------------------------------

def train_statistics(train_objects: Iterable[Sequence[str]]) -> tuple[Counter, Counter]:
    """(class frequency, pair co-occurrence counts) over the TRAIN images' object lists."""
    freq: Counter = Counter()
    pairs: Counter = Counter()
    for objs in train_objects:
        freq.update(objs)
        for a in objs:
            for b in objs:
                if a != b:
                    pairs[(a, b)] += 1
    return freq, pairs


def negative(kind: str, present: Sequence[str], classes: Sequence[str], freq: Counter,
             cooc: Counter, rng: random.Random, popular_k: int) -> str | None:
    """One absent class of the given kind (None if every class is present)."""
    absent = [c for c in classes if c not in present]
    if not absent:
        return None
    if kind == "random":
        return rng.choice(absent)
    if kind == "popular":
        ranked = sorted(absent, key=lambda c: (-freq[c], c))
        return rng.choice(ranked[:popular_k])
    if kind == "adversarial":
        score = {c: sum(cooc[(p, c)] for p in present) for c in absent}
        best = max(score.values())
        return rng.choice(sorted(c for c in absent if score[c] == best))
    raise ValueError(f"unknown negative kind {kind!r}; known {list(NEGATIVES)}")


def question_text(name: str) -> str:
    return f"is there a {name} ?"


def questions(cfg: Config, images: Sequence[dict[str, Any]], freq: Counter, cooc: Counter,
              seed: int | str, split: str) -> list[dict[str, Any]]:
    """Per image: one positive, one negative per kind (train: `train_negatives` only)."""
    rng = random.Random(f"{FAMILY}:questions:{split}:{seed}")
    kinds = cfg.train_negatives if split == "train" else list(NEGATIVES)
    rows = []
    for img in images:
        present = list(img["objects"])
        asked = [("positive", rng.choice(present))]
        asked += [(k, negative(k, present, cfg.classes, freq, cooc, rng, cfg.popular_k))
                  for k in kinds]
        for j, (kind, name) in enumerate(asked):
            if name is None:
                continue
            label = int(kind == "positive")
            rows.append({"id": f"{img['id']}-q{j}", "image_id": img["id"], "split": split,
                         "object": name, "negative": kind, "query": question_text(name),
                         "target": "yes" if label else "no", "label": label})
    return rows


# --- checks ---------------------------------------------------------------------------------

def expectations(cfg: Config | None = None, split: str | None = None) -> "FrameSpec":
    """Data checks of an image table (pass the generating config for the value rules)."""
    from stages.core.checks import ColumnSpec, spec_from_schema

    rules: dict[str, dict[str, Any]] = {
        "id": {"unique": True}, "image_sha": {"unique": True}, "family": {"values": [FAMILY]},
        "texture": {"values": list(TEXTURES)}, "query": {"values": [CAPTION_QUERY]},
        "objects": {"min_len": 1}, "cells": {"min_len": 1},
    }
    if split is not None:
        rules["split"] = {"values": [split]}
    if cfg is not None:
        counts = list(range(cfg.min_objects, cfg.max_objects + 1))
        rules["n_objects"] = {"values": counts}
        rules["difficulty"] = {"values": counts}
        rules["objects"] = {"min_len": cfg.min_objects,
                            "elements": ColumnSpec(dtype=pl.String, values=tuple(cfg.classes))}
        rules["cells"] = {"min_len": cfg.min_objects,
                          "elements": ColumnSpec(dtype=pl.Int64, min=0, max=cfg.grid ** 2 - 1)}
        rules["sizes"] = {"elements": ColumnSpec(dtype=pl.Int64, min=cfg.min_size,
                                                 max=cfg.max_size)}
        rules["xs"] = {"elements": ColumnSpec(dtype=pl.Int64, min=0, max=cfg.image_size - 1)}
        rules["ys"] = {"elements": ColumnSpec(dtype=pl.Int64, min=0, max=cfg.image_size - 1)}
    return spec_from_schema(SCHEMA, **rules)


def question_expectations(cfg: Config | None = None, split: str | None = None) -> "FrameSpec":
    """Data checks of a question table: answers balanced (one positive per negative asked
    plus ... so yes/no differ by the number of kinds), values from the vocabulary."""
    from stages.core.checks import spec_from_schema

    kinds = ["positive", *NEGATIVES]
    rules: dict[str, dict[str, Any]] = {
        "id": {"unique": True}, "target": {"values": ["yes", "no"]}, "label": {"values": [0, 1]},
        "negative": {"values": kinds},
    }
    if split is not None:
        rules["split"] = {"values": [split]}
    if cfg is not None:
        rules["object"] = {"values": cfg.classes}
        rules["query"] = {"values": [question_text(c) for c in cfg.classes]}
    return spec_from_schema(QUESTION_SCHEMA, **rules)


def check_ground_truth(df: pl.DataFrame, cfg: Config, source: str) -> None:
    """Row-level truths GE cannot express: lists of equal length, distinct classes and cells,
    cells ascending (caption order), the caption equal to the object list."""
    from stages.core.checks import DataValidationError

    for row in df.select("id", "objects", "cells", "xs", "ys", "sizes", "n_objects",
                         "target").iter_rows(named=True):
        objs, cells = row["objects"], row["cells"]
        lengths = {len(objs), len(cells), len(row["xs"]), len(row["ys"]), len(row["sizes"]),
                   row["n_objects"]}
        problem = None
        if len(lengths) != 1:
            problem = "object lists of unequal length"
        elif len(set(objs)) != len(objs) or len(set(cells)) != len(cells):
            problem = "a class or a cell appears twice"
        elif cells != sorted(cells):
            problem = "objects not in cell order"
        elif row["target"] != caption(objs):
            problem = f"caption {row['target']!r} does not list the objects {objs}"
        if problem:
            raise DataValidationError(
                f"{source}: row {row['id']}: rule 'ground truth' failed: {problem}",
                source=source, column="objects", rule="ground truth")


# --- verifiers ------------------------------------------------------------------------------

def vocabulary(cfg: Config) -> tuple[set[str], set[str]]:
    return set(cfg.colours), set(cfg.shapes)


def class_names(colours: Iterable[str], shapes: Iterable[str]) -> list[str]:
    """The exact object vocabulary: every `<colour> <shape>` phrase (CHAIR counts only these;
    stages/evaluate/hallucination.py does the counting)."""
    return [f"{c} {s}" for c in sorted(colours) for s in sorted(shapes)]
