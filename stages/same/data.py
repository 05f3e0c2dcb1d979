"""Stage `tasks` of SAME: the five sequential visual instruction tasks, train / val / test each.

    <paths.same_tasks>/<task>/{train,val,test}.parquet      one image, query and answer word a row

The tasks (stages/tasks/shapes_tasks.py) are drawn from the shapes world with the drawing the
`vlm-shapes` checkpoints were trained on, so the frozen encoder sees familiar images, and every
answer is one word of that model's vocabulary. Held-out splits are drawn first; splits are
pixel-disjoint within a task. Each table passes its great-expectations suite and every answer is
recomputed from the object list before the folder is replaced in one rename.

    python -m stages same tasks
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.tasks import shapes as shapes_family
from stages.tasks import shapes_tasks


class Sizes(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train: int = Field(ge=1, le=1_000_000, description="train rows per task")
    val: int = Field(ge=1, le=100_000, description="validation rows per task (unused by arms)")
    test: int = Field(ge=1, le=100_000, description="test rows per task (reported numbers)")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out: str = Field("same_tasks", description="path key of the task folder")
    tasks: list[str] = Field(default_factory=lambda: list(shapes_tasks.TASKS[:5]), min_length=2,
                             description="tasks to draw (names from shapes_tasks.TASKS)")
    shapes: shapes_family.Config = Field(default_factory=shapes_family.Config,
                                         description="shapes world (as the vlm pipeline's)")
    sizes: Sizes = Field(default_factory=lambda: Sizes(train=800, val=100, test=200),
                         description="rows per task and split")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        bad = sorted(set(self.tasks) - set(shapes_tasks.TASKS))
        if bad:
            raise ValueError(f"tasks {bad}: known {list(shapes_tasks.TASKS)}")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks {self.tasks} list a task twice")
        if ({"many", "one", "same_colour"} & set(self.tasks)
                and self.shapes.max_objects < shapes_tasks.MANY_AT):
            raise ValueError(f"tasks 'many', 'one' and 'same_colour' need shapes.max_objects >= "
                             f"{shapes_tasks.MANY_AT}")
        return self


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import validate_frame

    out = ctx.path(cfg.out)
    metrics: dict[str, float] = {"tasks": float(len(cfg.tasks))}
    with io.atomic_path(out, is_dir=True) as tmp:
        for task in cfg.tasks:
            used: set[str] = set()
            for split in shapes_tasks.SPLITS:
                rows = shapes_tasks.generate(cfg.shapes, task, getattr(cfg.sizes, split),
                                             ctx.seed, split, used)
                df = pl.DataFrame(rows, schema=shapes_tasks.SCHEMA)
                name = f"{out.name}/{task}/{split}.parquet"
                validate_frame(df, shapes_tasks.expectations(cfg.shapes, task, split), name)
                shapes_tasks.check_answers(df, name)
                io.write_parquet(tmp / task / f"{split}.parquet", df)
                metrics[f"{task}/{split}_rows"] = float(df.height)
                top = df["target"].value_counts(sort=True)["count"][0]
                metrics[f"{task}/{split}_majority"] = float(top / df.height)
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: tasks and test rows (per task and split in details/tasks.json)."""
    return {"tasks": metrics["tasks"],
            "test_rows": sum(v for k, v in metrics.items() if k.endswith("/test_rows"))}
