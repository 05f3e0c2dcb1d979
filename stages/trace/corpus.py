"""Stage `corpus` of the TRACE pipeline: Toulmin-argued arithmetic traces and tagger sentences.

    <out>/sft.parquet            one good + one trace of each poorly structured kind per problem
                                 (prompt, target, kind, correct, sentences, gold labels)
    <out>/train.parquet          RL prompts (arith schema: the exact verifier checks them)
    <out>/test.parquet           held-out prompts: CoT sampling for `score`, RL evaluation
    <out>/sentences_train.parquet, sentences_test.parquet   labelled sentences for the tagger

Problems are arith questions (stages/tasks/toulmin.py) disjoint from every shared split and from
each other. Every file is checked before it is written; every SFT target passes the exact answer
check against its own `correct` flag.

    python -m stages trace corpus
"""

from __future__ import annotations

from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.core.checks import DataValidationError, spec_from_schema, validate_frame
from stages.tasks import arith, load_split
from stages.tasks import toulmin as toulmin_family  # not `toulmin`: a Config field
from stages.trace.trace import labels_str

SFT_SCHEMA = {"id": pl.String, "question": pl.String, "prompt": pl.String, "target": pl.String,
              "answer": pl.Int64, "kind": pl.String, "correct": pl.Boolean,
              "sentences": pl.List(pl.String), "labels": pl.List(pl.String)}
SENT_SCHEMA = {"text": pl.String, "labels": pl.String, "split": pl.String}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    toulmin: toulmin_family.Config = Field(default_factory=toulmin_family.Config,
                                    description="trace templates, error rates, problem knobs")
    n_sft: int = Field(2000, ge=1, le=10_000_000, description="SFT problems (x5 traces each)")
    n_rl: int = Field(500, ge=1, le=10_000_000, description="RL training prompts")
    n_test: int = Field(200, ge=1, le=1_000_000, description="held-out prompts")
    n_sentences: int = Field(5000, ge=8, le=10_000_000, description="tagger training sentences")
    n_sentences_test: int = Field(200, ge=8, le=1_000_000,
                                  description="held-out tagger sentences (spec: 200)")
    exclude_tasks: str | None = Field("tasks", description="paths key of the shared task folder "
                                      "whose questions are excluded (None: nothing)")
    out: str = Field("corpus", description="paths key of the output folder")


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    acfg = cfg.toulmin.arith
    seen: set[str] = set()
    if cfg.exclude_tasks:
        for split in ("train", "val", "test"):
            seen.update(load_split(ctx.path(cfg.exclude_tasks), "arith", split)["question"])
    seed = f"trace:{ctx.seed}"
    split_rows: dict[str, list[dict[str, Any]]] = {}
    for split, n in (("test", cfg.n_test), ("train", cfg.n_rl), ("sft", cfg.n_sft)):
        rows = arith.generate(acfg, n, seed, split=split, exclude=seen)
        seen.update(r["question"] for r in rows)
        split_rows[split] = rows
    sft = pl.DataFrame(toulmin_family.traces(cfg.toulmin, split_rows["sft"], seed), schema=SFT_SCHEMA)
    bad = [r["question"] for r in sft.iter_rows(named=True)
           if toulmin_family.verify_answer(r, r["target"]) != r["correct"]]
    if bad:
        raise DataValidationError(f"{cfg.out}/sft.parquet: column 'correct': rule 'verifies' "
                                  f"failed for {bad[:3]}", source=cfg.out, column="correct",
                                  rule="verifies")
    validate_frame(sft, spec_from_schema(SFT_SCHEMA, kind={"values": list(toulmin_family.KINDS)}),
                   f"{cfg.out}/sft.parquet")
    sents = {s: pl.DataFrame(toulmin_family.sentences(cfg.toulmin, n, seed, s), schema=SENT_SCHEMA)
             for s, n in (("train", cfg.n_sentences), ("test", cfg.n_sentences_test))}
    allowed = sorted({labels_str(s) for s in toulmin_family.COMPOUND + toulmin_family.SINGLE})
    out = ctx.path(cfg.out)
    metrics: dict[str, float] = {}
    with io.atomic_path(out, is_dir=True) as tmp:
        for split in ("train", "test"):
            df = pl.DataFrame(split_rows[split], schema=arith.SCHEMA)
            validate_frame(df, arith.expectations(acfg, split), f"{cfg.out}/{split}.parquet")
            io.write_parquet(tmp / f"{split}.parquet", df)
            metrics[f"n_{split}"] = float(df.height)
        io.write_parquet(tmp / "sft.parquet", sft)
        for split, df in sents.items():
            validate_frame(df, spec_from_schema(SENT_SCHEMA, labels={"values": allowed}),
                           f"{cfg.out}/sentences_{split}.parquet")
            io.write_parquet(tmp / f"sentences_{split}.parquet", df)
            metrics[f"n_sentences_{split}"] = float(df.height)
    metrics["n_sft_traces"] = float(sft.height)
    metrics["sft_correct_share"] = float(sft["correct"].mean())
    for kind in toulmin_family.KINDS:
        metrics[f"correct_share/{kind}"] = float(sft.filter(pl.col("kind") == kind)["correct"].mean())
    metrics["mean_target_chars"] = float(sft["target"].str.len_chars().mean())
    metrics["max_total_chars"] = float((sft["prompt"].str.len_chars()
                                        + sft["target"].str.len_chars()).max())
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: problems per split; the corpus composition stays in details/corpus.json."""
    return {k: metrics[k] for k in ("n_train", "n_test") if k in metrics}
