"""Stage `judge_outcomes` of RACER: both judges on every router item, offline (spec §2, §5).

For each item of train / val / test_iid / test_hard, the direct judge (Phi_0) and the reasoning
judge (Phi_1) are called through the backend interface (`stages.models.backend`: local Hugging
Face folders here, a served model on the `gpu` profile) with greedy decoding. Recorded per judge:
the text, `correct` = the verdict (stated value == proposed answer) equals the exact label
(r_i(a)), and the generated tokens (c_i(a), reasoning tokens included: spec §6). An output that
commits to no value (empty, truncated, garbage) is MALFORMED: counted (`<judge>/malformed`), scored as incorrect (the judge gave no usable
verdict), and never stops the run. The cost unit for the router is the mean direct-judge
tokens on the train split (`cost_unit.json`): costs are ratios to all-direct (spec §6).

    python -m stages racer judge_outcomes
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.models.backend import BackendConfig
from stages.racer.judges import SPLITS, item_spec, parse_verdict

JUDGES = ("direct", "reasoning")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: str = Field("racer_items", description="paths key of the items folder")
    out: str = Field("racer_outcomes", description="paths key of the outcomes folder")
    direct: BackendConfig = Field(description="backend of the non-reasoning judge; a local "
                                              "model may be '<paths key>/<subfolder>'")
    reasoning: BackendConfig = Field(description="backend of the reasoning judge")
    direct_max_new_tokens: int = Field(8, ge=1, le=32768, description="direct judge budget")
    reasoning_max_new_tokens: int = Field(96, ge=1, le=131072,
                                          description="reasoning judge budget (CoT + verdict)")
    max_items: int | None = Field(None, ge=1, description="use at most this many items per split")
    num_threads: int = Field(0, ge=0, le=256, description="torch CPU threads (0: all cores)")


def outcome_spec() -> Any:
    import polars as pl

    from stages.core.checks import spec_from_schema

    schema: dict[str, Any] = {"id": pl.String, "split": pl.String, "difficulty": pl.Int64,
                              "label": pl.Boolean}
    for j in JUDGES:
        schema |= {f"{j}_text": pl.String, f"{j}_malformed": pl.Boolean,
                   f"{j}_correct": pl.Boolean, f"{j}_tokens": pl.Int64}
    return spec_from_schema(schema, id={"unique": True},
                            **{f"{j}_tokens": {"min": 0} for j in JUDGES})


def read_outcomes(path: Path) -> Any:
    from stages.core.checks import read_parquet_checked

    return read_parquet_checked(path, outcome_spec())


def score(label: bool, proposed: int, text: str) -> tuple[bool, bool]:
    """(correct, malformed) of one judge output against the exact label."""
    verdict = parse_verdict(text, proposed)
    if verdict is None:
        return False, True
    return (verdict == "yes") == bool(label), False


def resolve_backend(cfg: BackendConfig, ctx: Any) -> BackendConfig:
    """A local model given as '<paths key>/<sub>' becomes that absolute folder."""
    if cfg.kind != "local":
        return cfg
    head, _, tail = cfg.model.partition("/")
    if head in ctx.paths:
        path = ctx.paths[head] / tail if tail else ctx.paths[head]
        return cfg.model_copy(update={"model": str(path)})
    return cfg


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked, validate_frame
    from stages.models.backend import make_backend
    from stages.models.base import set_threads

    set_threads(cfg.num_threads)
    spec = item_spec(2, 8)
    items = {s: read_parquet_checked(ctx.path(cfg.items) / f"{s}.parquet", spec)
             for s in SPLITS}
    if cfg.max_items:
        items = {s: df.head(cfg.max_items) for s, df in items.items()}
    budgets = {"direct": cfg.direct_max_new_tokens, "reasoning": cfg.reasoning_max_new_tokens}
    metrics: dict[str, float] = {}
    frames = {s: df.select("id", "split", "difficulty", "label") for s, df in items.items()}
    for judge in JUDGES:
        backend = make_backend(resolve_backend(getattr(cfg, judge), ctx), root=ctx.root)
        for split, df in items.items():
            outs = backend.complete(df["prompt"].to_list(), max_new_tokens=budgets[judge],
                                    temperature=0.0, n=1, seed=ctx.seed)
            texts = [o[0].text for o in outs]
            scored = [score(lab, prop, t) for lab, prop, t in
                      zip(df["label"].to_list(), df["proposed"].to_list(), texts)]
            frames[split] = frames[split].with_columns(
                pl.Series(f"{judge}_text", texts, dtype=pl.String),
                pl.Series(f"{judge}_malformed", [m for _, m in scored], dtype=pl.Boolean),
                pl.Series(f"{judge}_correct", [c for c, _ in scored], dtype=pl.Boolean),
                pl.Series(f"{judge}_tokens", [o[0].n_tokens for o in outs], dtype=pl.Int64))
        del backend
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        for split, df in frames.items():
            validate_frame(df, outcome_spec(), f"{cfg.out}/{split}.parquet")
            io.write_parquet(tmp / f"{split}.parquet", df)
            for judge in JUDGES:
                metrics[f"{split}/{judge}/acc"] = float(df[f"{judge}_correct"].mean())
                metrics[f"{split}/{judge}/tokens"] = float(df[f"{judge}_tokens"].mean())
                metrics[f"{split}/{judge}/malformed"] = float(df[f"{judge}_malformed"].sum())
            metrics[f"{split}/oracle_acc"] = float(
                (df["direct_correct"] | df["reasoning_correct"]).mean())
        unit = float(frames["train"]["direct_tokens"].mean())
        io.write_json(tmp / "cost_unit.json", {"tokens": unit, "split": "train",
                                               "judge": "direct"})
    metrics["cost_unit_tokens"] = unit
    every = pl.concat(list(frames.values()))
    for judge in JUDGES:
        metrics[f"{judge}/malformed"] = float(every[f"{judge}_malformed"].sum())
        by = every.group_by("difficulty").agg(pl.col(f"{judge}_correct").mean().alias("a"),
                                              pl.col(f"{judge}_tokens").mean().alias("t"))
        for d, a, t in by.sort("difficulty").iter_rows():
            metrics[f"{judge}/acc_d{d}"] = float(a)
            metrics[f"{judge}/cost_ratio_d{d}"] = float(t) / unit
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: each judge's accuracy on the shifted test split (`<judge>_acc_hard`); every
    split, difficulty and token count stays in details/judge_outcomes.json."""
    return {f"{j}_acc_hard": metrics[f"test_hard/{j}/acc"] for j in ("direct", "reasoning")
            if f"test_hard/{j}/acc" in metrics}
