"""Stage `answer`: the learned reader answers every eval question from each arm's memory, through
the LLM backend (the local tiny Llama, or a served model at the `gpu` profile).

Per arm, corpus seed and noise level: accuracy (exact match of the answer), by question kind
(single, update = "later fact wins", hop), memory tokens in the reader's prompt (the memory block
counted with the reader's own tokenizer), the perfect reader's accuracy (the upper bound on that
memory: answer present and later than every stale value) and density:

    density     [reconstructed] (Acc_mem - Acc_nomem) per 1000 memory tokens (spec section 2)
    acc_per_1k  accuracy per 1000 memory tokens

and, per arm over every cell, accuracy by the line of the memory block that holds the answer
(`<arm>/line<1|2|3|4+|absent>/acc` and `/n`, `answer_line`): a small reader that copies from
the first lines best is told apart from a memory that ranks the answer low.

`paths.plugmem_answers` (parquet): seed, noise, arm, qid, kind, reply, correct, tokens, perfect.
One MLflow run per (arm, seed) with params arm / seed and the same metric set, step = noise.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.core.checks import read_parquet_checked
from stages.models.backend import BackendConfig, make_backend
from stages.plugmem import text
from stages.plugmem.graph import LINE_BUCKETS, answer_line, density, line_bucket
from stages.plugmem.memory import context_spec

SCHEMA = {"seed": pl.Int64, "noise": pl.Int64, "arm": pl.String, "qid": pl.String,
          "kind": pl.String, "reply": pl.String, "correct": pl.Int64, "tokens": pl.Int64,
          "perfect": pl.Int64}
METRICS = ("acc", "acc_single", "acc_update", "acc_hop", "tokens", "perfect", "density",
           "acc_per_1k")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reader: BackendConfig = Field(description="`local` = the folder of train_reader "
                                  "(paths.plugmem_reader), or a served model")
    max_new_tokens: int = Field(6, ge=1, le=512, description="answers are one word")
    num_threads: int = Field(1, ge=0, le=256)


def normalise(s: str) -> str:
    return s.strip().strip(".").strip().lower()


def cell_metrics(rows: pl.DataFrame, acc_none: float) -> dict[str, float]:
    out = {"acc": float(rows["correct"].mean()), "tokens": float(rows["tokens"].mean()),
           "perfect": float(rows["perfect"].mean())}
    for kind in ("single", "update", "hop"):
        k = rows.filter(pl.col("kind") == kind)
        out[f"acc_{kind}"] = float(k["correct"].mean()) if k.height else math.nan
    out["density"] = density(out["acc"], acc_none, out["tokens"])
    out["acc_per_1k"] = out["acc"] / out["tokens"] * 1000 if out["tokens"] > 0 else math.nan
    return out


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from transformers import AutoTokenizer

    from stages.models import base

    base.set_threads(cfg.num_threads)
    ctxs = read_parquet_checked(ctx.path("plugmem_contexts"), context_spec())
    ctxs = ctxs.filter(pl.col("split") == "eval")
    folder = ctx.path("plugmem_reader")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    bc = cfg.reader
    if bc.kind == "local":
        bc = bc.model_copy(update={"model": str(folder)})
    mems = [json.loads(m) for m in ctxs["memory"]]
    prompts = [text.reader_prompt(m, q) for m, q in zip(mems, ctxs["question"])]
    # the same prompt (e.g. `none` at every noise level) is generated once
    uniq = list(dict.fromkeys(prompts))
    outs = make_backend(bc, root=ctx.root).complete(uniq, max_new_tokens=cfg.max_new_tokens)
    reply = {p: o[0].text for p, o in zip(uniq, outs)}
    replies = [reply[p] for p in prompts]
    answers = ctxs.select("seed", "noise", "arm", "qid", "kind", "perfect").with_columns(
        reply=pl.Series(replies),
        correct=pl.Series([int(normalise(r) == normalise(a))
                           for r, a in zip(replies, ctxs["answer"])], dtype=pl.Int64),
        tokens=pl.Series([text.count_tokens(tokenizer, text.memory_block(m)) for m in mems],
                         dtype=pl.Int64)).select(list(SCHEMA))
    io.write_parquet(ctx.path("plugmem_answers"), answers)

    out: dict[str, float] = {}
    arms = list(dict.fromkeys(answers["arm"]))
    seeds, levels = sorted(set(answers["seed"])), sorted(set(answers["noise"]))
    for seed in seeds:
        for n in levels:
            cell = answers.filter((pl.col("seed") == seed) & (pl.col("noise") == n))
            acc_none = float(cell.filter(pl.col("arm") == "none")["correct"].mean())
            for arm in arms:
                m = cell_metrics(cell.filter(pl.col("arm") == arm), acc_none)
                out.update({f"{arm}/n{n}/s{seed}/{k}": v for k, v in m.items()})
    for arm in arms:
        for k in METRICS:
            vals = [out[f"{arm}/n{n}/s{s}/{k}"] for s in seeds for n in levels]
            vals = [v for v in vals if not math.isnan(v)]
            out[f"{arm}/{k}"] = float(np.mean(vals)) if vals else math.nan
            for n in levels:
                v = [out[f"{arm}/n{n}/s{s}/{k}"] for s in seeds]
                v = [x for x in v if not math.isnan(x)]
                out[f"{arm}/n{n}/{k}"] = float(np.mean(v)) if v else math.nan
        for seed in seeds:
            with ctx.method_run("answer", arm, int(seed), params={"arm": arm, "seed": int(seed)}
                                ) as r:
                for n in levels:
                    r.log_metrics({k: out[f"{arm}/n{n}/s{seed}/{k}"] for k in METRICS
                                   if not math.isnan(out[f"{arm}/n{n}/s{seed}/{k}"])}, step=n)
    buckets = pl.Series([line_bucket(answer_line(m, a)) for m, a in zip(mems, ctxs["answer"])])
    by_line = answers.select("arm", "correct").with_columns(bucket=buckets)
    for arm in arms:
        part = by_line.filter(pl.col("arm") == arm)
        for b in LINE_BUCKETS:
            hit = part.filter(pl.col("bucket") == b)["correct"]
            out[f"{arm}/line{b}/n"] = float(hit.len())
            if hit.len():
                out[f"{arm}/line{b}/acc"] = float(hit.mean())
    out["questions"] = float(answers.filter(pl.col("arm") == arms[0]).height)
    return out


def headline(details: dict[str, float]) -> dict[str, float]:
    return {k.replace("/", "_"): details[k] for k in ("plugmem/acc", "plugmem/tokens", "raw/acc",
                                                     "raw/tokens") if k in details}
