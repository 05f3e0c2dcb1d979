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
| `many` | 1-4 objects | `is there a and a and a ?` | yes if 3 or more objects (counting) |
| `colour_code` | 1 object | `describe a ?` | a shape word coding its colour (`CODE`) |
| `one` | 1-4 objects | `is there a ?` | yes if exactly one object (counting) |
| `same_colour` | 2-4 objects of one colour | `describe a and a .` | that colour |
| `two` | 1-4 objects | `is there a and a ?` | yes if exactly two objects (counting) |
| `warm` | 1 object | `is there a . ?` | yes if red, yellow or purple (`WARM`) |
| `shape` | 1 object | `describe the a ?` | its shape (4 words) |
| `has_colour` | 1-4 objects | `is there a <colour> ?` | yes / no (colour anywhere) |
| `has_shape` | 1-4 objects | `is there a <shape> ?` | yes / no (shape anywhere) |

`colour`, `many`, `same_colour`, `one` and `two` are the SAME pipeline's tasks: the frozen `vlm-shapes` checkpoints carry colour
and object count in the last prompt position, and an FFN adapter learns the colour tasks in tens
of steps (the counting tasks only partly). On that checkpoint a rank-20 LoRA left `colour_code`
and `warm` (colour mapped to other answer words) at chance after 80 steps, `shape` and
`has_colour` after 200; `has_shape` was not measured (pipelines/same/README.md). They are kept
for larger models. Same input, different answer
(`many` / `one` / `two`) is what makes naive tuning forget.

Queries are made of the tokenizer's own words: an unknown word would be `<unk>` for every task.
Yes/no tasks are balanced exactly: rows alternate between a `yes` and a `no` image.

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
TASKS = ("colour", "many", "same_colour", "one", "two", "colour_code", "warm", "shape",
         "has_colour", "has_shape")
YES_NO = ("has_colour", "has_shape", "many", "one", "two", "warm")
WARM = ("red", "yellow", "purple")
# colour_code: a fixed code from colour to a shape word (the same visual feature, new answers)
CODE = {"red": "square", "green": "triangle", "blue": "diamond", "yellow": "circle",
        "purple": "triangle"}
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
    if task == "colour_code":
        return "describe a ?"
    if task == "one":
        return "is there a ?"
    if task == "two":
        return "is there a and a ?"
    if task == "warm":
        return "is there a . ?"
    if task == "same_colour":
        return "describe a and a ."
    if task == "shape":
        return "describe the a ?"
    if task in ("has_colour", "has_shape"):
        if not asked:
            raise ValueError(f"task {task!r} needs the asked colour / shape")
        return f"is there a {asked} ?"
    if task == "many":
        return "is there a and a and a ?"
    raise ValueError(f"unknown task {task!r}; known {list(TASKS)}")


def answer_words(task: str, cfg: shapes.Config) -> list[str]:
    """Every answer a task can have (its chance level is 1 / len)."""
    if task in ("colour", "same_colour"):
        return list(cfg.colours)
    if task == "colour_code":
        return sorted({CODE[c] for c in cfg.colours})
    if task == "shape":
        return list(cfg.shapes)
    if task in YES_NO:
        return ["yes", "no"]
    raise ValueError(f"unknown task {task!r}; known {list(TASKS)}")


def answer(task: str, objects: list[str], asked: str | None = None) -> str:
    """The exact answer from an image's object list: the verifier of every task."""
    colours = [o.split(" ")[0] for o in objects]
    kinds = [o.split(" ")[1] for o in objects]
    if task in ("colour", "colour_code"):
        if len(objects) != 1:
            raise ValueError(f"task {task!r} needs one object, got {objects}")
        return colours[0] if task == "colour" else CODE[colours[0]]
    if task == "same_colour":
        if len(set(colours)) != 1:
            raise ValueError(f"task 'same_colour' needs objects of one colour, got {objects}")
        return colours[0]
    if task == "one":
        return "yes" if len(objects) == 1 else "no"
    if task == "two":
        return "yes" if len(objects) == 2 else "no"
    if task == "warm":
        if len(objects) != 1:
            raise ValueError(f"task 'warm' needs one object, got {objects}")
        return "yes" if colours[0] in WARM else "no"
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


def _classes(cfg: shapes.Config, task: str, rng: random.Random, yes: bool
             ) -> tuple[list[str], str | None]:
    """The classes of one image and the asked word; `yes`: the answer side of a yes/no task."""
    classes = cfg.classes
    hi = min(cfg.max_objects, cfg.grid ** 2)
    if task in ("colour", "colour_code", "shape"):
        return [rng.choice(classes)], None
    if task == "warm":
        warm = [c for c in classes if c.split(" ")[0] in WARM]
        cold = [c for c in classes if c.split(" ")[0] not in WARM]
        return [rng.choice(warm if yes else cold)], None
    if task == "many":
        n = rng.randint(MANY_AT, hi) if yes else rng.randint(1, MANY_AT - 1)
        return rng.sample(classes, n), None
    if task == "one":
        n = 1 if yes else rng.randint(2, hi)
        return rng.sample(classes, n), None
    if task == "two":
        n = 2 if yes else rng.choice([k for k in range(1, hi + 1) if k != 2])
        return rng.sample(classes, n), None
    if task == "same_colour":
        colour = rng.choice(list(cfg.colours))
        n = rng.randint(2, min(hi, len(cfg.shapes)))
        return [f"{colour} {s}" for s in rng.sample(list(cfg.shapes), n)], None
    words = list(cfg.colours) if task == "has_colour" else list(cfg.shapes)
    pos = 0 if task == "has_colour" else 1
    asked = rng.choice(words)
    want = yes
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


def sample(cfg: shapes.Config, task: str, rng: random.Random, yes: bool = True
           ) -> dict[str, Any]:
    """One image of `task` with its query and exact answer (`yes`: which answer a yes/no task
    gets)."""
    import numpy as np

    objects, asked = _classes(cfg, task, rng, yes)
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
        s = sample(cfg, task, rng, yes=len(rows) % 2 == 0)   # yes/no tasks: exactly balanced
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
            if task in YES_NO:
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
