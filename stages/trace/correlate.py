"""Stage `correlate` of the TRACE pipeline: does TRACE track accuracy across generators?

Paper: across 7 reasoning models, mean TRACE vs benchmark accuracy, Pearson r = 0.74 (perplexity
r ~ 0.3, length r ~ 0.1 [secondary]). Here (spec §4 "Correlation study"), over the generator
conditions of stage `score` (policy checkpoint x temperature):

- Pearson and Spearman r (stages.core.stats) of mean TRACE vs accuracy, with a percentile
  bootstrap 95% CI over conditions (`stats.percentile_ci`; few points, so Spearman too); the
  same for the baselines, each oriented so that higher should mean better: negative perplexity
  (-exp(mean NLL)) and response length;
- TRACE vs each baseline: a paired bootstrap 95% CI of r(TRACE) - r(baseline) (both r on the
  same resampled conditions) and the sd of its draws (`diff_boot_sd/*`, `boot_sd/*` for each r:
  the spread stage `compare` turns into a minimum detectable effect); "TRACE tracks accuracy
  better" needs that CI above 0 (the claim rule of `compare`), not only a higher point
  estimate (with 8 conditions the single-score CIs are wide and overlap);
- per sample: point-biserial r (Pearson with the 0/1 correctness) of each score;
- best-of-N reranking inside each condition: pick the sample with the highest TRACE vs a random
  pick (the expected accuracy of one sample) vs the longest, and the oracle (pass@N).

    python -m stages trace correlate
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io, stats
from stages.core.checks import ColumnSpec, FrameSpec, read_parquet_checked

SCORES = ("trace", "neg_ppl", "length")
SAMPLE_COLUMNS = {"condition", "id", "sample", "mix", "steps", "temperature", "correct", "nll",
                  "trace", "length"}                    # what stage `score` writes and this reads


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scores: str = Field("scores", description="paths key of the score output")
    bootstrap: int = Field(1000, ge=0, le=1_000_000, description="bootstrap resamples over "
                                                                 "conditions (0: none)")
    plot: str = Field("plots/trace_vs_acc.csv", description="plot CSV, relative to the pipeline")


class Bootstrap(NamedTuple):
    """A percentile 95% bootstrap CI and the sd of the finite draws it was read from."""

    low: float
    high: float
    sd: float


def bootstrap(n_points: int, stat: Callable[[list[int]], float], draws: int, seed: int = 0
              ) -> Bootstrap:
    """`stats.percentile_ci` of `stat(picked indices)` (the same draws), plus the population sd
    of its finite draws: the spread the compare stage turns into a minimum detectable effect
    (2.8 sd, stats.claim_from_ci)."""
    seen: list[float] = []

    def recorded(p: list[int]) -> float:
        v = stat(p)
        if math.isfinite(v):
            seen.append(v)
        return v
    low, high = stats.percentile_ci(n_points, recorded, draws, seed)
    return Bootstrap(low, high, stats.mean_std(seen)[1])


def bootstrap_ci(x: Sequence[float], y: Sequence[float], n: int, seed: int = 0) -> Bootstrap:
    """Percentile 95% CI of Pearson r over resampled (x, y) points."""
    return bootstrap(len(x), lambda p: stats.pearson([x[i] for i in p], [y[i] for i in p]), n,
                     seed)


def bootstrap_diff_ci(x: Sequence[float], z: Sequence[float], y: Sequence[float], n: int,
                      seed: int = 0) -> Bootstrap:
    """Paired percentile 95% CI of r(x, y) - r(z, y): each draw resamples the points once and
    computes both r on them, so what the two scores share cancels."""
    def diff(p: list[int]) -> float:
        ys = [y[i] for i in p]
        return stats.pearson([x[i] for i in p], ys) - stats.pearson([z[i] for i in p], ys)
    return bootstrap(len(x), diff, n, seed)


def per_condition(samples: pl.DataFrame) -> pl.DataFrame:
    """Mean accuracy and scores per generator condition."""
    return (samples.with_columns((-pl.col("nll").exp()).alias("neg_ppl"))
            .group_by("condition", maintain_order=True)
            .agg(pl.col("correct").cast(pl.Float64).mean().alias("acc"),
                 *[pl.col(s).cast(pl.Float64).mean() for s in SCORES],
                 pl.col("mix").first(), pl.col("steps").first(), pl.col("temperature").first())
            .sort("condition"))


def best_of_n(samples: pl.DataFrame) -> dict[str, float]:
    """Accuracy when each prompt's samples are reranked by TRACE / by length, against a random
    pick (its expectation: the share of the prompt's samples that are right) and the oracle."""
    got: dict[str, list[float]] = {"trace": [], "random": [], "length": [], "oracle": []}
    for _, g in samples.group_by(["condition", "id"], maintain_order=True):
        rows = g.to_dicts()
        if len(rows) < 2:
            continue
        got["trace"].append(max(rows, key=lambda r: (r["trace"], -r["sample"]))["correct"])
        got["length"].append(max(rows, key=lambda r: (r["length"], -r["sample"]))["correct"])
        got["random"].append(sum(r["correct"] for r in rows) / len(rows))
        got["oracle"].append(any(r["correct"] for r in rows))
    return {f"bon_{k}": sum(v) / len(v) for k, v in got.items() if v}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    path = ctx.path(cfg.scores) / "samples.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; run stage `score` first")
    # typed where the maths needs it; every listed column present and not null (NaN included)
    spec = FrameSpec({c: ColumnSpec() for c in SAMPLE_COLUMNS}
                     | {"correct": ColumnSpec(dtype=pl.Boolean), "nll": ColumnSpec(min=0.0)})
    samples = read_parquet_checked(path, spec)
    cond = per_condition(samples)
    acc = cond["acc"].to_list()
    m: dict[str, float] = {"conditions": float(cond.height)}
    per_sample = samples.with_columns((-pl.col("nll").exp()).alias("neg_ppl"))
    correct = per_sample["correct"].cast(pl.Float64).to_list()
    for s in SCORES:
        xs = cond[s].to_list()
        m[f"pearson/{s}"] = stats.pearson(xs, acc)
        m[f"spearman/{s}"] = stats.spearman(xs, acc)
        if cfg.bootstrap:
            m[f"ci_low/{s}"], m[f"ci_high/{s}"], m[f"boot_sd/{s}"] = bootstrap_ci(
                xs, acc, cfg.bootstrap, ctx.seed)
        m[f"point_biserial/{s}"] = stats.pearson(per_sample[s].cast(pl.Float64).to_list(),
                                                 correct)
    if cfg.bootstrap:
        for s in SCORES[1:]:
            m[f"diff_ci_low/{s}"], m[f"diff_ci_high/{s}"], m[f"diff_boot_sd/{s}"] = \
                bootstrap_diff_ci(cond["trace"].to_list(), cond[s].to_list(), acc,
                                  cfg.bootstrap, ctx.seed)
        # the spec's predicted order continues r(PPL) > r(length): the same paired test
        (m["diff_ci_low/neg_ppl_vs_length"], m["diff_ci_high/neg_ppl_vs_length"],
         m["diff_boot_sd/neg_ppl_vs_length"]) = bootstrap_diff_ci(
            cond["neg_ppl"].to_list(), cond["length"].to_list(), acc, cfg.bootstrap, ctx.seed)
    m |= best_of_n(samples)
    for r in cond.iter_rows(named=True):
        m[f"{r['condition']}/acc"] = r["acc"]
        m[f"{r['condition']}/trace"] = r["trace"]
    plot = ctx.pipeline_dir / cfg.plot
    plot.parent.mkdir(parents=True, exist_ok=True)
    with io.atomic_path(plot) as tmp:
        cond.select("condition", "mix", "steps", "temperature", "acc", *SCORES).write_csv(tmp)
    print(f"correlate: {cond.height} conditions, Pearson r(TRACE, acc) = "
          f"{m['pearson/trace']:.3f} (PPL {m['pearson/neg_ppl']:.3f}, "
          f"length {m['pearson/length']:.3f})")
    return m


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: Pearson r of each score with accuracy across conditions (`r_<score>`);
    CIs, rank and per-sample correlations, best-of-N in details/correlate.json."""
    return {f"r_{s}": metrics[f"pearson/{s}"] for s in ("trace", "neg_ppl", "length")
            if f"pearson/{s}" in metrics}
