"""Stage `databases`: hidden narratives -> one SQLite database per entity, its hidden note and
its checklist (`stages.ddr.world`). Every item's gold SQL is run on its database before the
stage finishes (derivability by construction, DDR spec section 6's last pitfall).

Layout of `paths.ddr_databases`:

    eval/seed<k>/patient<e>.sqlite     the database seeds the arms are compared on
    train/seed<k>/patient<e>.sqlite    other seeds: the imitation expert's databases
    checklist.parquet                  split, seed, entity, item_id, question, aspect, binding,
                                       answer, kind, gold_sql
    notes.parquet                      split, seed, entity, note (hidden from every explorer)
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.core.checks import ColumnSpec, FrameSpec
from stages.ddr import world


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seeds: list[int] = Field(min_length=2, description="database seeds the arms are compared "
                             "on (paired CIs over them)")
    train_seeds: list[int] = Field(min_length=1, description="seeds of the expert's databases "
                                   "(disjoint from `seeds`)")
    n_entities: int = Field(ge=1, le=10_000, description="entities (patients) per eval seed")
    n_train_entities: int = Field(ge=1, le=100_000, description="entities per train seed")
    n_labs: int = Field(3, ge=1, le=len(world.LABS), description="lab series per patient")

    @model_validator(mode="after")
    def _disjoint(self) -> "Config":
        both = set(self.seeds) & set(self.train_seeds)
        if both:
            raise ValueError(f"databases: seeds {sorted(both)} are both eval and train seeds")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"databases.seeds {self.seeds}: repeated seed")
        return self


CHECKLIST_SCHEMA = {"split": pl.String, "seed": pl.Int64, "entity": pl.Int64,
                    "item_id": pl.String, "question": pl.String, "aspect": pl.String,
                    "binding": pl.String, "answer": pl.String, "kind": pl.String,
                    "gold_sql": pl.String}


def checklist_spec() -> FrameSpec:
    cols = {k: ColumnSpec(dtype=v) for k, v in CHECKLIST_SCHEMA.items()}
    cols["split"] = ColumnSpec(dtype=pl.String, values=("eval", "train"))
    cols["kind"] = ColumnSpec(dtype=pl.String, values=("numeric", "categorical"))
    cols["entity"] = ColumnSpec(dtype=pl.Int64, min=0)
    return FrameSpec(cols, min_rows=1)


def db_path(root: Any, split: str, seed: int, entity: int) -> Any:
    return root / split / f"seed{seed}" / f"patient{entity}.sqlite"


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    items, notes = [], []
    with io.atomic_path(ctx.path("ddr_databases"), is_dir=True) as tmp:
        for split, seeds, n in (("eval", cfg.seeds, cfg.n_entities),
                                ("train", cfg.train_seeds, cfg.n_train_entities)):
            for seed in seeds:
                for e in range(n):
                    story = world.sample_narrative(seed, e, cfg.n_labs)
                    path = db_path(tmp, split, seed, e)
                    world.write_database(story, path)
                    its = world.checklist(story)
                    world.check_derivable(path, its)
                    items += [{"split": split, **it.row(seed, e)} for it in its]
                    notes.append({"split": split, "seed": seed, "entity": e,
                                  "note": world.note(story)})
        df = pl.DataFrame(items, schema=CHECKLIST_SCHEMA)
        df.write_parquet(tmp / "checklist.parquet")
        pl.DataFrame(notes).write_parquet(tmp / "notes.parquet")
    ev = df.filter(pl.col("split") == "eval")
    per = ev.group_by("seed", "entity").len()["len"]
    return {"eval_entities": float(per.len()), "eval_items": float(ev.height),
            "train_entities": float(len(cfg.train_seeds) * cfg.n_train_entities),
            "items_per_entity_min": float(per.min()), "items_per_entity_max": float(per.max()),
            "gold_sql_checked": float(df.height)}


def headline(details: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the eval checklist's size (every number in details/databases.json)."""
    return {"items": details["eval_items"]}
