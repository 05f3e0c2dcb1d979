"""Task family `shapes_tasks`: visual instruction tasks on the shapes world, one answer word each.

Continual instruction tuning (SAME) needs several tasks on the same images whose input and
answer structures differ, so that tuning on one overwrites another. This module draws them from
the shapes world (stages/tasks/shapes.py, unchanged: `sample_image` / `render` with the same
drawing as the `vlm-shapes` training images) and asks one question per image whose answer is one
word of the `vlm-shapes` vocabulary (a frozen model cannot learn new output words through
LoRA):

| task | images | query | answer |
|---|---|---|---|
| `colour` | 1 object | `describe a .` | its colour (5 words) |
| `shape` | 1 object | `describe a ?` | its shape (4 words) |
| `has_colour` | 1-4 objects | `is there a <colour> ?` | yes / no (colour anywhere) |
| `has_shape` | 1-4 objects | `is there a <shape> ?` | yes / no (shape anywhere) |
| `many` | 1-4 objects | `is there a and a and a ?` | yes if 3 or more objects (counting) |

Queries are made of the tokenizer's own words: an unknown word would be `<unk>` for every task.
Yes/no tasks are balanced by construction (the asked colour / shape is drawn present or absent
with probability 1/2; `many` draws 1-2 or 3-4 objects with probability 1/2).

Everything is deterministic in (seed, task, split); splits are pixel-disjoint within a task.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import polars as pl

from stages.tasks import shapes

if TYPE_CHECKING:
    from stages.core.checks import FrameSpec

FAMILY = "shapes_tasks"
TASKS = ("colour", "shape", "has_colour", "has_shape", "many")
SPLITS = ("test", "val", "train")          # held-out splits drawn first
MANY_AT = 3                                # `many`: yes when an image holds >= 3 objects

SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String,                 # colour-train-000012
    "task": pl.String,
    "split": pl.String,
    "image": pl.Binary,              # PNG, RGB
    "image_sha": pl.String,
    "objects": pl.List(pl.String),   # ground truth, cell order
    "n_objects": pl.Int64,
    "query": pl.String,
    "target": pl.String,             # one word
}


def query_of(task: str, asked: str | None = None) -> str:
    """The instruction of `task` (`asked`: the colour / shape of a has_* question)."""
    if task == "colour":
        return "describe a ."
    if task == "shape":
        return "describe a ?"
    if task in ("has_colour", "has_shape"):
        if not asked:
            raise ValueError(f"task {task!r} needs the asked colour / shape")
        return f"is there a {asked} ?"
    if task == "many":
        return "is there a and a and a ?"
    raise ValueError(f"unknown task {task!r}; known {list(TASKS)}")


def answer_words(task: str, cfg: shapes.Config) -> list[str]:
    """Every answer a task can have (its chance level is 1 / len)."""
    if task == "colour":
        return list(cfg.colours)
    if task == "shape":
        return list(cfg.shapes)
    if task in ("has_colour", "has_shape", "many"):
        return ["yes", "no"]
    raise ValueError(f"unknown task {task!r}; known {list(TASKS)}")


def answer(task: str, objects: list[str], asked: str | None = None) -> str:
    """The exact answer from an image's object list: the verifier of every task."""
    colours = [o.split(" ")[0] for o in objects]
    kinds = [o.split(" ")[1] for o in objects]
    if task == "colour":
        if len(objects) != 1:
            raise ValueError(f"task 'colour' needs one object, got {objects}")
        return colours[0]
    if task == "shape":
        if len(objects) != 1:
            raise ValueError(f"task 'shape' needs one object, got {objects}")
        return kinds[0]
    if task == "has_colour":
        return "yes" if asked in colours else "no"
    if task == "has_shape":
        return "yes" if asked in kinds else "no"
    if task == "many":
        return "yes" if len(objects) >= MANY_AT else "no"
    raise ValueError(f"unknown task {task!r}; known {list(TASKS)}")


def _classes(cfg: shapes.Config, task: str, rng: random.Random) -> tuple[list[str], str | None]:
    """The classes of one image and the asked word, balanced yes / no where the task has it."""
    classes = cfg.classes
    if task in ("colour", "shape"):
        return [rng.choice(classes)], None
    if task == "many":
        hi = min(cfg.max_objects, cfg.grid ** 2)
        n = rng.randint(MANY_AT, hi) if rng.random() < 0.5 else rng.randint(1, MANY_AT - 1)
        return rng.sample(classes, n), None
    words = list(cfg.colours) if task == "has_colour" else list(cfg.shapes)
    pos = 0 if task == "has_colour" else 1
    asked = rng.choice(words)
    want = rng.random() < 0.5
    pool = [c for c in classes if c.split(" ")[pos] != asked]      # images without it
    for _ in range(100):
        n = rng.randint(cfg.min_objects, cfg.max_objects)
        if want:
            first = rng.choice([c for c in classes if c.split(" ")[pos] == asked])
            rest = rng.sample([c for c in classes if c != first], n - 1)
            return [first, *rest], asked
        if len(pool) >= n:
            return rng.sample(pool, n), asked
    raise ValueError(f"task {task!r}: cannot draw an image without {asked!r}")


def sample(cfg: shapes.Config, task: str, rng: random.Random) -> dict[str, Any]:
    """One image of `task` with its query and exact answer."""
    import numpy as np

    objects, asked = _classes(cfg, task, rng)
    cells = sorted(rng.sample(range(cfg.grid ** 2), len(objects)))
    cell_px = cfg.image_size // cfg.grid
    sizes, centres = [], []
    for cell in cells:            # as shapes.sample_image: centred in the cell +- jitter
        row, col = divmod(cell, cfg.grid)
        sizes.append(rng.randint(cfg.min_size, cfg.max_size))
        centres.append((col * cell_px + cell_px // 2 + rng.randint(-cfg.jitter, cfg.jitter),
                        row * cell_px + cell_px // 2 + rng.randint(-cfg.jitter, cfg.jitter)))
    texture = rng.choice(shapes.TEXTURES)
    pixels = shapes.render(cfg, objects, cells, sizes, centres, texture,
                           np.random.default_rng(rng.getrandbits(64)))
    return {"objects": objects, "pixels": pixels, "query": query_of(task, asked),
            "target": answer(task, objects, asked)}


def generate(cfg: shapes.Config, task: str, n: int, seed: int, split: str,
             exclude: set[str]) -> list[dict[str, Any]]:
    """`n` rows of one task and split, none of whose pixels are in `exclude` (updated)."""
    from stages.tasks.images import encode_png, pixel_sha

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known {list(TASKS)}")
    rng = random.Random(f"{FAMILY}:{task}:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 3 * n + 100:
            raise ValueError(f"{task}: only {len(rows)} of {n} distinct images for {split!r}")
        s = sample(cfg, task, rng)
        sha = pixel_sha(s["pixels"])
        if sha in exclude:
            continue
        exclude.add(sha)
        rows.append({"id": f"{task}-{split}-{len(rows):06d}", "task": task, "split": split,
                     "image": encode_png(s["pixels"]), "image_sha": sha,
                     "objects": s["objects"], "n_objects": len(s["objects"]),
                     "query": s["query"], "target": s["target"]})
    return rows


def expectations(cfg: shapes.Config | None, task: str | None = None,
                 split: str | None = None) -> "FrameSpec":
    """Data checks of one task table (answers from the task's words, yes/no balanced)."""
    from stages.core.checks import spec_from_schema

    rules: dict[str, dict[str, Any]] = {"id": {"unique": True}, "image_sha": {"unique": True},
                                        "task": {"values": list(TASKS)},
                                        "objects": {"min_len": 1}}
    if task is not None:
        rules["task"] = {"values": [task]}
        if cfg is not None:
            rules["target"] = {"values": answer_words(task, cfg)}
            if task in ("has_colour", "has_shape", "many"):
                rules["target"]["max_imbalance"] = 3.0
    if split is not None:
        rules["split"] = {"values": [split]}
    return spec_from_schema(SCHEMA, **rules)


def check_answers(df: pl.DataFrame, source: str) -> None:
    """Every target recomputed from the object list (the exact verifier)."""
    from stages.core.checks import DataValidationError

    for row in df.select("id", "task", "objects", "query", "target").iter_rows(named=True):
        words = row["query"].split()
        asked = words[3] if row["task"] in ("has_colour", "has_shape") else None
        if answer(row["task"], list(row["objects"]), asked) != row["target"]:
            raise DataValidationError(
                f"{source}: row {row['id']}: rule 'exact answer' failed: target "
                f"{row['target']!r} for objects {list(row['objects'])} and {row['query']!r}",
                source=source, column="target", rule="exact answer")
