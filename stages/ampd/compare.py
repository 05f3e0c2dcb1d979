"""Stage `compare`: SLO attainment against session rate for every arm, the local fraction, the
reorder gain, the crossover, and the paper's claims by the house rule (stages/core/stats.py).

Per (arm, load): mean and 95% t interval over seeds of session attainment (every round of a
session within TTFT and P90-ITL SLO), round attainment and the local-prefill fraction. Claims,
paired by seed (the same traces on both sides: common random numbers), each seed's value the
mean over the rate grid unless said otherwise:

- `reorder_ge_<x>`, `planned_ge_<x>` for x in dynamo, local, colocated: (e)/(f) >= (a), (b),
  (c) [spec §4]; `rates_below` counts the loads where the paired CI says the AMPD arm is worse;
- `gain_vs_dynamo`: the full system's (f) relative gain over (a), (f - a) / mean(a); the paper
  reports +67.29% on average [secondary];
- `local_fraction_low` / `_high`: arm (e)'s share of prefills run locally, one-sample CIs
  against 13.9% (above) and 31.7% (below) [secondary]; `local_fraction` is reproduced when both
  are, contradicted when either is;
- `reorder_gain`: (e - d) / mean(d), the paper's +13.42-14.81% (its midpoint 0.141) [secondary];
- `crossover_low`: (b) - (a) at the lowest load (the paper: always-local wins there);
  `crossover_high`: ITL attainment of (b) - (a) at the highest load (it loses on ITL there);
  the crossover appears when both are reproduced.

Outputs: metrics, `report/` (table.md, attainment.png), `plots/attainment.csv` (a DVC plot: load
against every arm's mean attainment), an MLflow run per (arm, seed) with one step per load.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.ampd.simulate import runs_spec
from stages.ampd.planner import PLAN_KEYS
from stages.ampd.workload import GRID_KEYS
from stages.core.checks import read_json_checked, read_parquet_checked
from stages.core import io, stats

from .arms import ARM_LETTERS, ARMS

BASELINES = ("dynamo", "local", "colocated")
CLAIM_TEXT = {
    "gain_vs_dynamo": "AMPD (f) gains over Dynamo-like (a), relative, mean over rates",
    "reorder_gain": "reordering adds attainment: (e) vs (d), relative, mean over rates",
    "local_fraction": "(e) runs 13.9-31.7% of prefills locally",
    "crossover_low": "crossover, low load: always-local (b) beats (a) on attainment",
    "crossover_high": "crossover, high load: always-local (b) loses to (a) on ITL attainment",
}



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    paper_gain_vs_dynamo: float = Field(0.6729, description="[secondary] average relative "
                                        "SLO-attainment gain over Dynamo")
    paper_reorder_gain: float = Field(0.141, description="[secondary] reordering adds "
                                      "13.42-14.81% (midpoint)")
    paper_local_fraction: tuple[float, float] = Field((0.139, 0.317), description="[secondary] "
                                                      "share of prefills run locally")
    plot: str = Field("plots/attainment.csv", description="the DVC plot, relative to the "
                      "pipeline folder")


def _ci(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% t interval over seeds (NaN half-width for one seed)."""
    v = stats.finite(values)
    if not v:
        return math.nan, math.nan
    mean = sum(v) / len(v)
    if len(v) < 2:
        return mean, math.nan
    from scipy.stats import t

    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1))
    return mean, float(t.ppf(0.975, len(v) - 1)) * sd / math.sqrt(len(v))


def by_seed(runs: Any, arm: str, col: str, load_index: int | None = None) -> dict[int, float]:
    """{seed: value} of `arm`: at one load, or the mean over the rate grid."""
    import polars as pl

    f = runs.filter(pl.col("arm") == arm)
    if load_index is not None:
        f = f.filter(pl.col("load_index") == load_index)
    # sorted: polars' group_by order varies run to run, and sums over seeds in another order
    # differ in the last bit (the same inputs must give the same bytes)
    g = f.group_by("seed").agg(pl.col(col).mean()).sort("seed")
    return dict(zip(g["seed"].to_list(), g[col].to_list()))


def summarize(runs: Any, grid: dict[str, Any], cfg: Config) -> dict[str, float]:
    arms = [a for a in ARMS if a in set(runs["arm"].to_list())]
    loads = grid["loads"]
    m: dict[str, float] = {"slo_ttft_s": grid["slo"]["ttft_s"], "slo_itl_s": grid["slo"]["itl_s"],
                           "capacity_sessions_per_s": grid["capacity"]["cluster"],
                           "seeds": float(len(grid["seeds"]))}
    for i, load in enumerate(loads):
        m[f"load/{i}"] = load
        m[f"rate/{i}"] = grid["rates"][i]
    for arm in arms:
        for col in ("attainment", "round_attainment", "itl_attainment", "ttft_attainment",
                    "local_fraction"):
            for i in range(len(loads)):
                mean, half = _ci(list(by_seed(runs, arm, col, i).values()))
                m[f"{arm}/{col}/{i}/mean"] = mean
                if math.isfinite(half):
                    m[f"{arm}/{col}/{i}/ci"] = half
            mean, half = _ci(list(by_seed(runs, arm, col).values()))
            m[f"{arm}/{col}/mean"] = mean
            if math.isfinite(half):
                m[f"{arm}/{col}/ci"] = half
        hist = by_seed(runs, arm, "local_fraction_history")
        m[f"{arm}/local_fraction_history/mean"] = _ci(list(hist.values()))[0]

    def put(name: str, c: stats.Claim) -> None:
        m.update(stats.claim_metrics(c, f"claim/{name}"))

    for ampd in ("reorder", "planned"):
        if ampd not in arms:
            continue
        for base in BASELINES:
            if base not in arms:
                continue
            put(f"{ampd}_ge_{base}", stats.claim_by_key(by_seed(runs, ampd, "attainment"),
                                                        by_seed(runs, base, "attainment")))
            below = sum(stats.claim_by_key(by_seed(runs, ampd, "attainment", i),
                                           by_seed(runs, base, "attainment", i)).verdict == -1
                        for i in range(len(loads)))
            m[f"claim/{ampd}_ge_{base}/rates_below"] = float(below)
    full = "planned" if "planned" in arms else "reorder"
    if full in arms and "dynamo" in arms:
        put("gain_vs_dynamo", stats.claim_by_key(
            by_seed(runs, full, "attainment"), by_seed(runs, "dynamo", "attainment"),
            relative=True, paper_effect=cfg.paper_gain_vs_dynamo))
    if "reorder" in arms and "routing" in arms:
        put("reorder_gain", stats.claim_by_key(
            by_seed(runs, "reorder", "attainment"), by_seed(runs, "routing", "attainment"),
            relative=True, paper_effect=cfg.paper_reorder_gain))
    if "reorder" in arms:
        frac = by_seed(runs, "reorder", "local_fraction")
        low, high = cfg.paper_local_fraction
        lo = stats.claim_by_key(frac, {s: low for s in frac}, direction=1)
        hi = stats.claim_by_key(frac, {s: high for s in frac}, direction=-1)
        put("local_fraction_low", lo)
        put("local_fraction_high", hi)
        both = 1 if lo.verdict == hi.verdict == 1 else (-1 if -1 in (lo.verdict, hi.verdict)
                                                        else 0)
        m["claim/local_fraction/verdict"] = float(both)
        m["claim/local_fraction/mean"] = sum(frac.values()) / len(frac)
    if "local" in arms and "dynamo" in arms:
        first, last = 0, len(loads) - 1
        put("crossover_low", stats.claim_by_key(by_seed(runs, "local", "attainment", first),
                                                by_seed(runs, "dynamo", "attainment", first)))
        put("crossover_high", stats.claim_by_key(
            by_seed(runs, "local", "itl_attainment", last),
            by_seed(runs, "dynamo", "itl_attainment", last), direction=-1))
        m["crossover_appears"] = float(m["claim/crossover_low/verdict"] == 1
                                       and m["claim/crossover_high/verdict"] == 1)
    return m


def log_method_runs(ctx: Any, runs: Any) -> None:
    """One MLflow run per (arm, seed): one step per load, the same metric set for every arm."""
    for (arm, seed), g in runs.sort("load_index").group_by(["arm", "seed"], maintain_order=True):
        with ctx.method_run("simulate", arm, int(seed), params={
                "arm": arm, "letter": ARM_LETTERS[arm], "seed": int(seed)}) as r:
            for row in g.iter_rows(named=True):
                r.log_metrics({"attainment": row["attainment"],
                               "round_attainment": row["round_attainment"],
                               "local_fraction": row["local_fraction"],
                               "rate": row["rate"]}, step=int(row["load_index"]))


def plot_rows(m: dict[str, float]) -> list[dict[str, float]]:
    loads = sorted(int(k.split("/")[1]) for k in m if k.startswith("load/"))
    arms = [a for a in ARMS if f"{a}/attainment/mean" in m]
    return [{"load": m[f"load/{i}"], "rate": m[f"rate/{i}"],
             **{a: m[f"{a}/attainment/{i}/mean"] for a in arms}} for i in loads]


def _png(m: dict[str, float], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted(int(k.split("/")[1]) for k in m if k.startswith("load/"))
    x = [m[f"load/{i}"] for i in loads]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm in ARMS:
        if f"{arm}/attainment/mean" not in m:
            continue
        y = [m[f"{arm}/attainment/{i}/mean"] for i in loads]
        err = [m.get(f"{arm}/attainment/{i}/ci", 0.0) for i in loads]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"({ARM_LETTERS[arm]}) {arm}")
    ax.set_xlabel("session rate / reference capacity")
    ax.set_ylabel("SLO attainment (sessions, every round)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rounds_spec():
    """What compare reads from rounds.parquet (one row per arm, seed, load, session and round)."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    return FrameSpec(columns={"arm": ColumnSpec(dtype=pl.String),
                              "seed": ColumnSpec(min=0), "load_index": ColumnSpec(min=0),
                              "overtaken": ColumnSpec(min=0)})


def overtake_shares(rounds: Any) -> dict[str, float]:
    """`<arm>/overtaken/<i>`: the share of rounds that a later arrival overtook at least once in a
    prefill queue, at load i, over all seeds (and `<arm>/overtaken` over every load), for the arms
    that reorder. It says how often reordering acted at all: a reorder gain of exactly 0 with
    almost no overtakes where SLOs are attainable is a test with nothing to measure, not evidence
    against the reordering."""
    import polars as pl

    m: dict[str, float] = {}
    moved = rounds.with_columns((pl.col("overtaken") > 0).cast(pl.Float64).alias("moved"))
    for arm in ("reorder", "planned"):
        r = moved.filter(pl.col("arm") == arm)
        if r.is_empty():
            continue
        for (i,), g in sorted(r.group_by("load_index"), key=lambda kv: kv[0][0]):
            m[f"{arm}/overtaken/{int(i)}"] = float(g["moved"].mean())
        m[f"{arm}/overtaken"] = float(r["moved"].mean())
    return m


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    grid = read_json_checked(ctx.path("ampd_workload") / "grid.json", GRID_KEYS)
    runs = read_parquet_checked(ctx.path("ampd_sim") / "runs.parquet", runs_spec())
    plan_path = ctx.path("ampd_plan") / "plan.json"
    plan = read_json_checked(plan_path, PLAN_KEYS) if plan_path.is_file() else None
    m = summarize(runs, grid, cfg)
    m.update(overtake_shares(read_parquet_checked(ctx.path("ampd_sim") / "rounds.parquet",
                                                  rounds_spec())))
    if plan is not None:
        m["plan/prefill_replicas"] = float(sum(plan["prefill"].values()))
        m["plan/decode_replicas"] = float(sum(plan["decode"].values()))
        m["plan/gpus"] = float(plan["gpus"])
    log_method_runs(ctx, runs)
    rows = plot_rows(m)
    with io.atomic_path(ctx.path("ampd_report"), is_dir=True) as tmp:
        io.write_text(tmp / "table.md", results_table({"compare": m}))
        _png(m, tmp / "attainment.png")
    io.write_text(ctx.pipeline_dir / cfg.plot,
                  pl.DataFrame(rows).write_csv())
    return m


# --- README ---------------------------------------------------------------------------------------

def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if v is None or not math.isfinite(v) else fmt.format(v)


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """The README block, from the compare (and plan) metrics alone."""
    m = metrics.get("compare", {})
    if "seeds" not in m:
        return "_No results yet: run the pipeline._\n"
    loads = sorted(int(k.split("/")[1]) for k in m if k.startswith("load/"))
    arms = [a for a in ARMS if f"{a}/attainment/mean" in m]
    lines = [f"SLOs: TTFT <= {m['slo_ttft_s']:.4g} s, P90 ITL <= {m['slo_itl_s']:.4g} s; "
             f"reference capacity {m['capacity_sessions_per_s']:.3g} sessions/s; "
             f"{m['seeds']:.0f} seeds. Session SLO attainment (every round meets both), mean ± "
             "95% CI over seeds:", "",
             "| arm | " + " | ".join(f"load {m[f'load/{i}']:g} ({m[f'rate/{i}']:.3g}/s)"
                                    for i in loads) + " | mean | local prefills |",
             "|---|" + "---|" * (len(loads) + 2)]
    for a in arms:
        cells = [f"{_f(m.get(f'{a}/attainment/{i}/mean'))} ± "
                 f"{_f(m.get(f'{a}/attainment/{i}/ci'), '{:.3f}')}" for i in loads]
        lines.append(f"| ({ARM_LETTERS[a]}) {a} | " + " | ".join(cells)
                     + f" | {_f(m.get(f'{a}/attainment/mean'))} | "
                     f"{_f(m.get(f'{a}/local_fraction/mean'), '{:.1%}')} |")
    lines += ["", "ITL attainment (rounds with P90 ITL within the SLO), mean over seeds:", "",
              "| arm | " + " | ".join(f"load {m[f'load/{i}']:g}" for i in loads) + " |",
              "|---|" + "---|" * len(loads)]
    for a in arms:
        lines.append(f"| ({ARM_LETTERS[a]}) {a} | " + " | ".join(
            _f(m.get(f"{a}/itl_attainment/{i}/mean")) for i in loads) + " |")
    if "plan/gpus" in m:
        lines += ["", f"Replica plan of arm (f): {m['plan/prefill_replicas']:.0f} prefill + "
                      f"{m['plan/decode_replicas']:.0f} decode replicas on {m['plan/gpus']:.0f} "
                      "GPUs."]
    lines += ["", "Claims (paired by seed; the house rule of stages/core/stats.py):", ""]
    for ampd in ("reorder", "planned"):
        for base in BASELINES:
            c = stats.read_claim(m, f"claim/{ampd}_ge_{base}")
            if c is not None:
                below = m.get(f"claim/{ampd}_ge_{base}/rates_below", 0)
                lines.append(f"- ({ARM_LETTERS[ampd]}) {ampd} >= ({ARM_LETTERS[base]}) {base}, "
                             f"attainment over rates: {c.sentence()}; worse at "
                             f"{below:.0f} of {len(loads)} rates")
    for name in ("gain_vs_dynamo", "reorder_gain"):
        c = stats.read_claim(m, f"claim/{name}")
        if c is not None:
            lines.append(f"- {CLAIM_TEXT[name]}: {c.sentence('{:+.1%}')}")
    if "reorder/overtaken" in m:
        by_load = ", ".join(_f(m.get(f"reorder/overtaken/{i}"), "{:.2%}") for i in loads)
        lines.append(f"  - how often (e) reordered at all: {_f(m['reorder/overtaken'], '{:.2%}')} "
                     f"of rounds were overtaken in a prefill queue (by load: {by_load})")
    if "claim/local_fraction/verdict" in m:
        verdict = stats.VERDICTS[int(m["claim/local_fraction/verdict"])]
        lo, hi = (stats.read_claim(m, f"claim/local_fraction_{s}") for s in ("low", "high"))
        lines.append(f"- {CLAIM_TEXT['local_fraction']}: **{verdict}** (mean "
                     f"{m['claim/local_fraction/mean']:.1%}; above 13.9%: {lo.name}, MDE "
                     f"{_f(lo.mde, '{:.1%}')}; below 31.7%: {hi.name})")
    for name in ("crossover_low", "crossover_high"):
        c = stats.read_claim(m, f"claim/{name}")
        if c is not None:
            lines.append(f"- {CLAIM_TEXT[name]}: {c.sentence()}")
    if "crossover_appears" in m:
        lines.append(f"- the crossover appears: **{'yes' if m['crossover_appears'] else 'no'}**")
    return "\n".join(lines) + "\n"


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many claims are reproduced / inconclusive / contradicted; each claim and
    every arm's attainment in details/compare.json and the README."""
    return stats.verdict_counts(metrics)
