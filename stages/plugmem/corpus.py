"""Stage `corpus`: the LongMemEval-lite chats and two-hop passage sets of every seed
(`stages.plugmem.world`), and the word-level tokenizer both learned models use.

Splits: `train` seeds (the structurer's and the reader's training data), `val` seeds (the
thresholds are recalibrated there, never on `eval`), `eval` seeds (the arms are compared on
them, paired over seed x noise level). Layout of `paths.plugmem_corpus`:

    obs.parquet        split, seed, sample, session, turn, text, chunk, noise_rank, fact, tags
                       (JSON list), oracle (the paper's `**Statement:**` text, or NONE)
    questions.parquet  split, seed, sample, qid, kind (single|update|hop), question, answer,
                       stale (JSON list: the asked value's earlier values)
    tokenizer/         the word-level tokenizer (stages.plugmem.text)
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.core.checks import ColumnSpec, FrameSpec
from stages.plugmem import text, world

OBS_SCHEMA = {"split": pl.String, "seed": pl.Int64, "sample": pl.String, "session": pl.Int64,
              "turn": pl.Int64, "text": pl.String, "chunk": pl.String, "noise_rank": pl.Int64,
              "fact": pl.String, "tags": pl.String, "oracle": pl.String}
Q_SCHEMA = {"split": pl.String, "seed": pl.Int64, "sample": pl.String, "qid": pl.String,
            "kind": pl.String, "question": pl.String, "answer": pl.String, "stale": pl.String}
SPLITS = ("train", "val", "eval")


def obs_spec() -> FrameSpec:
    cols = {k: ColumnSpec(dtype=v) for k, v in OBS_SCHEMA.items()}
    cols["split"] = ColumnSpec(dtype=pl.String, values=SPLITS)
    cols["noise_rank"] = ColumnSpec(dtype=pl.Int64, min=-1)
    return FrameSpec(cols, min_rows=1)


def question_spec() -> FrameSpec:
    cols = {k: ColumnSpec(dtype=v) for k, v in Q_SCHEMA.items()}
    cols["split"] = ColumnSpec(dtype=pl.String, values=SPLITS)
    cols["kind"] = ColumnSpec(dtype=pl.String, values=("single", "update", "hop"))
    return FrameSpec(cols, min_rows=1)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seeds: list[int] = Field(min_length=2, description="eval corpus seeds (paired CIs)")
    val_seeds: list[int] = Field(min_length=1, description="threshold recalibration seeds")
    train_seeds: list[int] = Field(min_length=1, description="structurer / reader training")
    n_chats: int = Field(ge=1, le=10_000, description="users (multi-session chats) per seed")
    n_hops: int = Field(ge=0, le=10_000, description="two-hop questions per seed")
    n_train_chats: int = Field(ge=1, le=100_000, description="users per train seed")
    n_train_hops: int = Field(ge=0, le=100_000, description="two-hop questions per train seed")
    n_sessions: int = Field(ge=1, le=100, description="sessions per user")
    n_attrs: int = Field(ge=1, le=len(world.ATTRS), description="planted attributes per user")
    noise_levels: list[int] = Field(min_length=1, description="distractors per session / "
                                    "passage set; the haystack at a level holds those below")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        groups = (self.seeds, self.val_seeds, self.train_seeds)
        flat = [s for g in groups for s in g]
        if len(set(flat)) != len(flat):
            raise ValueError(f"corpus: seeds, val_seeds and train_seeds must be distinct and "
                             f"disjoint: {groups}")
        if sorted(set(self.noise_levels)) != self.noise_levels or self.noise_levels[0] < 0:
            raise ValueError(f"corpus.noise_levels {self.noise_levels}: increasing, >= 0")
        return self


def build(cfg: Config) -> tuple[pl.DataFrame, pl.DataFrame]:
    obs_rows, q_rows = [], []
    for split, seeds in (("train", cfg.train_seeds), ("val", cfg.val_seeds), ("eval", cfg.seeds)):
        chats = cfg.n_train_chats if split == "train" else cfg.n_chats
        hops = cfg.n_train_hops if split == "train" else cfg.n_hops
        for seed in seeds:
            obs, qs = world.generate(seed, n_chats=chats, n_hops=hops, n_sessions=cfg.n_sessions,
                                     n_attrs=cfg.n_attrs, max_noise=max(cfg.noise_levels))
            obs_rows += [{"split": split, "seed": seed, "sample": o.sample, "session": o.session,
                          "turn": o.turn, "text": o.text, "chunk": o.chunk,
                          "noise_rank": o.noise_rank, "fact": o.fact, "tags": json.dumps(o.tags),
                          "oracle": world.oracle_text(o.fact, o.tags)} for o in obs]
            q_rows += [{"split": split, "seed": seed, "sample": q.sample, "qid": q.qid,
                        "kind": q.kind, "question": q.question, "answer": q.answer,
                        "stale": json.dumps(q.stale)} for q in qs]
    return pl.DataFrame(obs_rows, schema=OBS_SCHEMA), pl.DataFrame(q_rows, schema=Q_SCHEMA)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    obs, qs = build(cfg)
    tok = text.build_word_tokenizer([*obs["chunk"], *obs["oracle"], *qs["question"],
                                     *qs["answer"]])
    with io.atomic_path(ctx.path("plugmem_corpus"), is_dir=True) as tmp:
        obs.write_parquet(tmp / "obs.parquet")
        qs.write_parquet(tmp / "questions.parquet")
        tok.save_pretrained(str(tmp / "tokenizer"))
    out: dict[str, float] = {"vocab": float(len(tok))}
    for split in SPLITS:
        o, q = obs.filter(pl.col("split") == split), qs.filter(pl.col("split") == split)
        out[f"{split}/observations"] = float(o.height)
        out[f"{split}/facts"] = float((o["fact"] != "").sum())
        for kind in ("single", "update", "hop"):
            out[f"{split}/q_{kind}"] = float((q["kind"] == kind).sum())
    return out


def headline(details: dict[str, float]) -> dict[str, float]:
    """One key: the pipeline's `dvc metrics show` must stay under 250 characters a line."""
    return {"eval_questions": sum(v for k, v in details.items() if k.startswith("eval/q_"))}
