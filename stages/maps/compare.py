"""Stage `compare`: the paper's claims on the simulated runs, by the house rule (stages.core.stats).

Every claim pairs runs on the same trace (same workload, seed and rate: common random numbers)
and tests the relative difference (method - baseline) / mean(baseline) with the paired t CI
(`claim_by_key(relative=True)`), with its MDE; the paper's effect where it states one as an
average (an "up to" number is a maximum over loads, not comparable with a mean over pairs: then
the direction alone is tested).

- `maps_vs_rr_mean`: MAPS < round-robin on mean E2E, over both synthetic workloads x seeds x
  rates (paper: -42.6% aggregated over both workloads and all loads);
- `maps_vs_rr_p99`: the same on P99 E2E (paper: up to -84.8%: direction only);
- `coverage`: empirical coverage of L̂_up (MAPS) minus the target 1 - α, over the same pairs
  (paper: 91% at α = 0.1, i.e. +0.01);
- `mq_vs_mc`: MAPS (MQ routing) < MAPS with MC routing on mean E2E (paper: MC up to 1.36x mean:
  direction only);
- `queue_vs_rr`: time-weighted queue length, MAPS vs round-robin, on `sharegpt` at the moderate
  loads (paper: -62.9% vs vLLM at 10 and 12.5 req/s);
- ablations on `sharegpt`, direction only except UAC (paper: removing UAC costs +18.4% mean,
  i.e. MAPS is 1/1.184 - 1 = -15.5% relative to no-UAC): `uac`, `sjf` (vs FCFS), and the
  real-predictor workload `own` (MAPS vs round-robin, mean E2E).
Plots: mean and P99 E2E against the arrival rate (req/s) per arm, one CSV per workload and
statistic (columns load, rate, one per arm; dvc plots).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stages.maps.simulate import runs_spec
from stages.core.checks import read_parquet_checked
from stages.core import io, stats



# Durations returned here are results (simulated or the measurement this stage exists to make),
# not this machine's wall time: only `*seconds`/`wall_*` keys are kept out of DVC
# (stages/core/io.py `is_timing_key`).
TIMES_ARE_RESULTS = True

class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    runs_path: str = Field("maps_runs", description="paths key: simulate's runs parquet")
    alpha: float = Field(0.1, gt=0, lt=1, description="UAC alpha (target 1 - alpha)")
    claim_workloads: list[str] = Field(default_factory=lambda: ["sharegpt", "bursty"],
                                       min_length=1)
    moderate_loads: list[float] = Field(default_factory=lambda: [0.65, 0.8], min_length=1,
                                        description="load factors of the queue-length claim")
    paper_mean_reduction: float = Field(-0.426, description="paper: mean E2E, MAPS vs RR")
    paper_coverage_margin: float = Field(0.01, description="paper: 0.91 - 0.90")
    paper_queue_reduction: float = Field(-0.629, description="paper: queue length vs vLLM")
    paper_uac_effect: float = Field(-0.155, description="paper: 1/1.184 - 1, MAPS vs no UAC")
    plot_prefix: str = Field("plots/maps_e2e_", description="CSV per workload, in this folder")


CLAIMS = {
    "maps_vs_rr_mean": "MAPS < round-robin, mean E2E (relative)",
    "maps_vs_rr_p99": "MAPS < round-robin, P99 E2E (relative)",
    "coverage": "coverage of L̂_up minus 1 - α",
    "mq_vs_mc": "MQ < MC routing, mean E2E (relative)",
    "queue_vs_rr": "MAPS < round-robin, queue length at moderate load (relative)",
    "uac": "MAPS < MAPS without UAC, mean E2E (relative)",
    "sjf": "SJF < FCFS, P99 E2E (relative)",
    "own_vs_rr_mean": "real predictor (own): MAPS < round-robin, mean E2E (relative)",
}


def _values(df, arm: str, col: str, workloads, loads=None) -> dict[tuple, float]:
    import polars as pl

    g = df.filter((pl.col("arm") == arm) & pl.col("workload").is_in(workloads))
    if loads is not None:
        g = g.filter(pl.col("load").is_in(loads))
    return {(w, s, r): float(v) for w, s, r, v in
            g.select("workload", "seed", "rate_index", col).iter_rows()}


METHOD_METRICS = ("e2e_mean_s", "e2e_p99_s", "ttft_mean_s", "tpot_mean_s", "queue_len",
                  "preemptions", "rate")


def log_method_runs(ctx: Any, df: Any) -> None:
    """One MLflow run per (workload, arm, seed), the workload as the run's group: one step per
    rate index and the same metric set for every arm, so MLflow's Compare view shows the arms
    of a workload side by side (`coverage` too, for the arms with a conformal bound)."""
    for (w, arm, seed), g in (df.sort(["workload", "arm", "seed", "rate_index"])
                              .group_by(["workload", "arm", "seed"], maintain_order=True)):
        with ctx.method_run(str(w), str(arm), int(seed),
                            params={"arm": arm, "workload": w, "seed": int(seed)}) as r:
            for row in g.iter_rows(named=True):
                values = {k: float(row[k]) for k in METHOD_METRICS if k in row}
                if "coverage" in row and row["coverage"] is not None \
                        and math.isfinite(row["coverage"]):
                    values["coverage"] = float(row["coverage"])
                r.log_metrics(values, step=int(row["rate_index"]))


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    df = read_parquet_checked(ctx.path(cfg.runs_path), runs_spec())
    arms = set(df["arm"].unique())
    wls = [w for w in cfg.claim_workloads if w in set(df["workload"].unique())]
    m: dict[str, float] = {}

    def put(name: str, method: str, base: str, col: str, workloads, *, paper=None, loads=None,
            relative=True) -> None:
        if method not in arms or base not in arms or not workloads:
            return
        c = stats.claim_by_key(_values(df, method, col, workloads, loads),
                               _values(df, base, col, workloads, loads), direction=-1,
                               paper_effect=paper, relative=relative)
        m.update(stats.claim_metrics(c, f"claim/{name}"))

    put("maps_vs_rr_mean", "maps", "round_robin", "e2e_mean_s", wls, paper=cfg.paper_mean_reduction)
    put("maps_vs_rr_p99", "maps", "round_robin", "e2e_p99_s", wls)
    put("mq_vs_mc", "maps", "maps_mc", "e2e_mean_s", wls)
    put("queue_vs_rr", "maps", "round_robin", "queue_len", ["sharegpt"],
        paper=cfg.paper_queue_reduction, loads=cfg.moderate_loads)
    put("uac", "maps", "maps_no_uac", "e2e_mean_s", ["sharegpt"], paper=cfg.paper_uac_effect)
    put("sjf", "maps", "maps_fcfs", "e2e_p99_s", ["sharegpt"])
    put("own_vs_rr_mean", "maps", "round_robin", "e2e_mean_s", ["own"])
    if "maps" in arms:
        cov = _values(df, "maps", "coverage", wls)
        c = stats.claim_by_key(cov, {k: 1.0 - cfg.alpha for k in cov}, direction=1,
                               paper_effect=cfg.paper_coverage_margin)
        m.update(stats.claim_metrics(c, "claim/coverage"))
        for w in sorted(df["workload"].unique()):
            v = list(_values(df, "maps", "coverage", [w]).values())
            if v:
                m[f"{w}/maps/coverage"] = float(np.mean(v))
    m["target_coverage"] = 1.0 - cfg.alpha
    log_method_runs(ctx, df)
    # per (workload, arm, load): means over seeds, the table and the plots
    agg = (df.group_by(["workload", "arm", "load"])
           .agg(pl.col("e2e_mean_s").mean(), pl.col("e2e_p99_s").mean(),
                pl.col("queue_len").mean(), pl.col("preemptions").mean(),
                pl.col("e2e_p99_long_s").mean(), pl.col("rate").first())
           .sort(["workload", "arm", "load"]))
    for w, arm, load, mean, p99, q, pre, p99l, _ in agg.iter_rows():
        key = f"{w}/{arm}/load{load:g}"
        m.update({f"{key}/e2e_mean_s": mean, f"{key}/e2e_p99_s": p99, f"{key}/queue_len": q,
                  f"{key}/preemptions": pre, f"{key}/e2e_p99_long_s": p99l})
    for w in sorted(agg["workload"].unique()):
        for stat in ("e2e_mean_s", "e2e_p99_s"):
            wide = (agg.filter(pl.col("workload") == w)
                    .pivot(on="arm", index=["load", "rate"], values=stat).sort("load"))
            path = ctx.pipeline_dir / f"{cfg.plot_prefix}{w}_{stat.split('_')[1]}.csv"
            io.write_text(path, wide.write_csv())
    return {k: float(v) for k, v in m.items() if not isinstance(v, float) or math.isfinite(v)}


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README block: motivation, predictor, E2E per arm and load, the claims."""
    c = metrics.get("compare", {})
    if not any(k.startswith("claim/") for k in c):
        return "_No results yet: run the pipeline._\n"
    lines: list[str] = []
    mot = metrics.get("motivation", {})
    if mot:
        n_dec = len({k.split("/")[0] for k in mot if k.startswith("d") and "/" in k})
        lines += [f"**Appendix A (motivation)**: round-robin over {n_dec} PS decoders at rho = {mot['rho']:g}: the most-pressured decoder is above "
                  f"theta = {mot['theta']:g} for f_hp = {mot['hp_f_hp']:.0%} of "
                  f"{mot['horizon_s']:.0f} s (T_hp {mot['hp_T_hp']:.0f} s, B_hp "
                  f"{mot['hp_B_hp']:.0f} intervals, longest C_hp {mot['hp_C_hp']:.0f} s); skew "
                  f"f_hp(max) - f_hp(min) = {mot['f_hp_skew']:.2f}. Paper: one decoder ~80% of "
                  f"the time above theta ({'seen' if mot['persistent_skew'] else 'not seen'}: "
                  f"f_hp >= 0.75), longest interval > 280 s "
                  f"({'seen' if mot.get('longest_over_280s') else 'not seen'}).", ""]
    p = metrics.get("predictor", {})
    if p:
        lines += [f"**Predictor** (base model's hidden state -> length, test split, n = "
                  f"{p['n_test']:.0f}): MAE {p['test_mae']:.2f} tokens (constant median: "
                  f"{p['test_mae_constant']:.2f}), Acc-10 {p.get('test_acc_10', math.nan):.2f}, "
                  f"Acc-50 {p.get('test_acc_50', math.nan):.2f}, Acc-100 "
                  f"{p.get('test_acc_100', math.nan):.2f}; q_α = {p['q_alpha']:.1f}; coverage "
                  f"{p['test_coverage']:.3f} (95% CI {p['test_coverage_ci_low']:.3f}-"
                  f"{p['test_coverage_ci_high']:.3f}) vs the conformal bounds "
                  f"[{p['coverage_lower_bound']:.3f}, {p['coverage_upper_bound']:.3f}] "
                  f"(n_cal = {p['n_cal']:.0f}).", ""]
    for w in ("sharegpt", "bursty", "own"):
        keys = [k for k in c if k.startswith(f"{w}/") and k.endswith("/e2e_mean_s")]
        if not keys:
            continue
        loads = sorted({float(k.split("/")[2][4:]) for k in keys})
        arms = sorted({k.split("/")[1] for k in keys}, key=lambda a: (a != "round_robin", a))
        lines += [f"**{w}**: mean / P99 E2E (s), mean over seeds, by load (fraction of the "
                  "profile-derived capacity).", "",
                  "| arm | " + " | ".join(f"load {x:g}" for x in loads) + " |",
                  "|---|" + "---|" * len(loads)]
        for a in arms:
            cells = [f"{c[f'{w}/{a}/load{x:g}/e2e_mean_s']:.2f} / "
                     f"{c[f'{w}/{a}/load{x:g}/e2e_p99_s']:.2f}"
                     if f"{w}/{a}/load{x:g}/e2e_mean_s" in c else "-" for x in loads]
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        if f"{w}/maps/coverage" in c:
            lines.append(f"\nMAPS coverage of L̂_up on {w}: {c[f'{w}/maps/coverage']:.3f} "
                         f"(target {c['target_coverage']:.2f}).")
        lines.append("")
    lines += ["**Claims** (paired t CI of the relative difference over (workload, seed, rate) "
              "pairs; house rule):", ""]
    for name, text in CLAIMS.items():
        cl = stats.read_claim(c, f"claim/{name}")
        if cl is not None:
            lines.append(f"- {text}: {cl.sentence('{:+.3f}')}")
    return "\n".join(lines) + "\n"


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many claims are reproduced / inconclusive / contradicted; each claim and
    every arm's latencies in details/compare.json and the README."""
    return stats.verdict_counts(metrics)
