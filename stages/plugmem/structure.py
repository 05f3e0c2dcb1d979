"""Stage `structure`: the learned structurer writes the facts of every validation and eval
observation (PlugMem's per-step fact extraction, arXiv 2603.03296 section 3.1), through the LLM
backend (the local tiny Llama, or a served model at the `gpu` profile).

Each distinct observation text is structured once (a lower noise level's haystack is a subset of
a higher one's). A reply is parsed with `stages.plugmem.graph.parse_structured`; one that does
not match `**Statement:** ... **Tags:** [...]` / `NONE` is a parse failure and adds nothing to
memory (counted, never silent). Reported against the oracle parser: parse rate, exact facts,
and how often a fact's value (its last tag) survives.

`paths.plugmem_structured` (parquet): text, reply, parsed (0/1), facts (JSON list of
[statement, tags]).
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.core.checks import ColumnSpec, FrameSpec, read_parquet_checked
from stages.models.backend import BackendConfig, make_backend
from stages.plugmem import text
from stages.plugmem.corpus import obs_spec
from stages.plugmem.graph import ParseError, parse_structured

SCHEMA = {"text": pl.String, "reply": pl.String, "parsed": pl.Int64, "facts": pl.String}


def structured_spec() -> FrameSpec:
    cols = {k: ColumnSpec(dtype=v) for k, v in SCHEMA.items()}
    cols["parsed"] = ColumnSpec(dtype=pl.Int64, min=0, max=1)
    cols["text"] = ColumnSpec(dtype=pl.String, unique=True)
    return FrameSpec(cols, min_rows=1)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    structurer: BackendConfig = Field(description="`local` = the folder of train_structurer "
                                      "(paths.plugmem_structurer), or a served model")
    max_new_tokens: int = Field(48, ge=4, le=4096, description="per observation (the longest "
                                "oracle fact is ~40 tokens)")
    num_threads: int = Field(1, ge=0, le=256)


def structure(backend: Any, texts: list[str], max_new_tokens: int) -> pl.DataFrame:
    outs = backend.complete([text.structurer_prompt(t) for t in texts],
                            max_new_tokens=max_new_tokens)
    rows = []
    for t, o in zip(texts, outs):
        reply = o[0].text.strip()
        try:
            facts, ok = parse_structured(reply), 1
        except ParseError:
            facts, ok = [], 0
        rows.append({"text": t, "reply": reply, "parsed": ok,
                     "facts": json.dumps([[s, tags] for s, tags in facts])})
    return pl.DataFrame(rows, schema=SCHEMA)


def quality(obs: pl.DataFrame, got: pl.DataFrame) -> dict[str, float]:
    """Against the oracle parser, over distinct observations."""
    o = obs.unique("text", keep="first").join(got, on="text")
    exact = value = facts = none_ok = nones = 0
    for fact, tags, reply_facts, parsed in zip(o["fact"], o["tags"], o["facts"], o["parsed"]):
        mine = json.loads(reply_facts)
        if not fact:
            nones += 1
            none_ok += bool(parsed) and not mine          # a parsed NONE, not a failed parse
            continue
        facts += 1
        exact += any(s == fact for s, _ in mine)
        gold_value = json.loads(tags)[-1]
        value += any(t and t[-1] == gold_value for _, t in mine)
    return {"parse_rate": float(o["parsed"].mean()),
            "fact_exact": exact / max(facts, 1), "value_kept": value / max(facts, 1),
            "none_right": none_ok / max(nones, 1), "observations": float(o.height)}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.models import base

    base.set_threads(cfg.num_threads)
    obs = read_parquet_checked(ctx.path("plugmem_corpus") / "obs.parquet", obs_spec())
    obs = obs.filter(pl.col("split") != "train")
    texts = list(dict.fromkeys(obs["text"]))
    bc = cfg.structurer
    if bc.kind == "local":
        bc = bc.model_copy(update={"model": str(ctx.path("plugmem_structurer"))})
    got = structure(make_backend(bc, root=ctx.root), texts, cfg.max_new_tokens)
    io.write_parquet(ctx.path("plugmem_structured"), got)
    out: dict[str, float] = {}
    for split in ("val", "eval"):
        q = quality(obs.filter(pl.col("split") == split), got)
        out.update({f"{split}/{k}": v for k, v in q.items()})
    return out


def headline(details: dict[str, float]) -> dict[str, float]:
    return {k: details[f"eval/{k}"] for k in ("parse_rate", "fact_exact", "value_kept")}
