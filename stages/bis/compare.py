"""Stage `compare` of the BIS pipeline: every subset's PRM side by side, mean and std over seeds.

Per arm (mean ± population std over training seeds; a random arm also redraws its subset per
seed): test step F1 and best-of-N accuracy (`evaluate`), training steps (the single-pass budget,
so they scale with rho), and the steps it takes to reach the full-data PRM's final validation F1
(from the validation curve logged during training; a seed that never reaches it is counted in
`reached_frac`, not averaged in). The paper's claims are checked as measured booleans:

- BIS-10% matches or beats full data (`bis_10/f1 >= full/f1`);
- BIS-10% beats Random-10% (`bis_10/gain_vs_random` = relative F1 gain; paper: +4.1%).

Outputs: `report/table.md`, `report/val_f1_curves.png`, `plots/val_f1.csv` (mean validation F1
per arm and step, for `dvc plots`) and the flat metrics for DVC and the README table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    subsets: str = Field("subsets", description="paths key of the select output (arms.json)")
    prms: str = Field("prms", description="paths key of the train_prm output (curves)")
    evaluation: str = Field("prm_eval", description="paths key of the evaluate output")
    full_arm: str = Field("full", description="the full-data arm (the reference)")
    report: str = Field("report", description="paths key of the report folder")
    plot: str = Field("plots/val_f1.csv", description="plot CSV, relative to the pipeline folder")


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std (ddof=0); NaN for no values."""
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def steps_to_reach(curve: list[tuple[int, float]], level: float) -> int | None:
    """First training step whose validation F1 is >= level (None: never)."""
    for step, value in sorted(curve):
        if value >= level:
            return step
    return None


def summarize(arms: list[dict[str, Any]], evaluation: pl.DataFrame, curves: pl.DataFrame,
              full_arm: str) -> dict[str, float]:
    """Flat metrics `<arm>/<name>` for every arm, plus the claim checks."""
    names = [a["name"] for a in arms]
    if full_arm not in names:
        raise ValueError(f"full_arm {full_arm!r} is not an arm of select: {names}")
    finals = curves.sort("step").group_by(["arm", "seed"], maintain_order=True).last()
    full_level = float(finals.filter(pl.col("arm") == full_arm)["val_f1"].mean())
    m: dict[str, float] = {"full_val_f1": full_level}
    for arm in names:
        ev = evaluation.filter(pl.col("arm") == arm)
        if ev.is_empty():
            raise ValueError(f"arm {arm!r} has no evaluation rows: was it trained?")
        for key in ("f1", "f1_wrong", "best_of_n"):
            m[f"{arm}/{key}_mean"], m[f"{arm}/{key}_std"] = mean_std(ev[key].to_list())
        reach, steps = [], []
        for seed in ev["seed"].to_list():
            c = curves.filter((pl.col("arm") == arm) & (pl.col("seed") == seed))
            points = list(zip(c["step"].to_list(), c["val_f1"].to_list()))
            steps.append(max(s for s, _ in points))
            got = steps_to_reach(points, full_level)
            if got is not None:
                reach.append(float(got))
        m[f"{arm}/train_steps"] = float(max(steps))
        m[f"{arm}/reached_frac"] = len(reach) / len(steps)
        m[f"{arm}/steps_to_full_mean"] = mean_std(reach)[0]
    full = m[f"{full_arm}/f1_mean"]
    for a in arms:
        if a["rule"] in ("full", "random"):
            continue
        rand = next((b["name"] for b in arms if b["rule"] == "random" and b["rho"] == a["rho"]),
                    None)
        m[f"{a['name']}/gain_vs_full"] = m[f"{a['name']}/f1_mean"] - full
        if rand is not None:
            r = m[f"{rand}/f1_mean"]
            m[f"{a['name']}/gain_vs_random"] = (m[f"{a['name']}/f1_mean"] - r) / r if r else math.nan
    if "bis_10" in names:
        m["claim_bis10_matches_full"] = float(m["bis_10/f1_mean"] >= full)
        if "bis_10/gain_vs_random" in m:
            m["claim_bis10_beats_random10"] = float(m["bis_10/gain_vs_random"] > 0)
    return m


def mean_curves(curves: pl.DataFrame) -> pl.DataFrame:
    """Mean validation F1 per arm and step over seeds (the `dvc plots` CSV)."""
    return (curves.group_by(["arm", "step"]).agg(pl.col("val_f1").mean())
            .sort(["arm", "step"]))


def _plot(curves: pl.DataFrame, full_level: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in curves["arm"].unique(maintain_order=True).to_list():
        c = curves.filter(pl.col("arm") == arm)
        ax.plot(c["step"].to_list(), c["val_f1"].to_list(), marker=".", label=arm)
    ax.axhline(full_level, color="grey", ls="--", lw=1, label="full data, final")
    ax.set_xlabel("PRM training steps (single pass)")
    ax.set_ylabel("validation step F1 (mean over seeds)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    arms = json.loads((ctx.path(cfg.subsets) / "arms.json").read_text())
    evaluation = pl.read_parquet(ctx.path(cfg.evaluation) / "evaluation.parquet")
    curves = pl.read_parquet(ctx.path(cfg.prms) / "curves.parquet")
    m = summarize(arms, evaluation, curves, cfg.full_arm)
    refs = json.loads((ctx.path(cfg.evaluation) / "references.json").read_text())
    m |= {f"bon_{k}": float(v) for k, v in refs.items() if k in ("random", "majority", "oracle")}
    mean = mean_curves(curves)
    with io.atomic_path(ctx.path(cfg.report), is_dir=True) as tmp:
        _plot(mean, m["full_val_f1"], tmp / "val_f1_curves.png")
        io.write_text(tmp / "table.md", results_table({"compare": m}))
    plot = ctx.pipeline_dir / cfg.plot
    plot.parent.mkdir(parents=True, exist_ok=True)
    with io.atomic_path(plot) as tmp:
        mean.write_csv(tmp)
    return m


def _arm_lines(m: dict[str, Any]) -> list[str]:
    """One row per arm of a compare-metrics dict, then the references and the claim checks."""
    arms = [k.split("/")[0] for k in m if k.endswith("/f1_mean")]

    def pm(arm: str, key: str, fmt: str = ".3f") -> str:
        return f"{m[f'{arm}/{key}_mean']:{fmt}} ± {m[f'{arm}/{key}_std']:{fmt}}"

    def opt(arm: str, key: str, fmt: str) -> str:
        v = m.get(f"{arm}/{key}")
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{fmt}}"

    lines = ["| subset | test step F1 | wrong-step F1 | best-of-N acc | train steps | "
             "steps to full-data F1 (seeds reaching) | F1 vs random at same rho |",
             "|---|---|---|---|---|---|---|"]
    for a in arms:
        lines.append(f"| {a} | {pm(a, 'f1')} | {pm(a, 'f1_wrong')} | {pm(a, 'best_of_n')} "
                     f"| {m[f'{a}/train_steps']:.0f} "
                     f"| {opt(a, 'steps_to_full_mean', '.0f')} ({m[f'{a}/reached_frac']:.0%}) "
                     f"| {opt(a, 'gain_vs_random', '+.1%')} |")
    lines += ["", f"Best-of-N without a PRM on the same test problems: random pick "
                  f"{m.get('bon_random', math.nan):.3f}, majority vote "
                  f"{m.get('bon_majority', math.nan):.3f}, oracle (pass@N) "
                  f"{m.get('bon_oracle', math.nan):.3f}. Full-data final validation F1 (the "
                  f"'reach' level): {m.get('full_val_f1', math.nan):.3f}."]
    if "claim_bis10_matches_full" in m:
        lines += ["", f"Claim 'BIS-10% matches or beats full data': "
                      f"{'reproduced' if m['claim_bis10_matches_full'] else 'not reproduced'}; "
                      f"'BIS-10% beats Random-10%': "
                      f"{'reproduced' if m.get('claim_bis10_beats_random10') else 'not reproduced'}"
                      "."]
    return lines


def _corpus(wrong: float, mc_negative: float, mixed: float, mc_mixed: float,
            agreement: float) -> str:
    return (f"PRM corpus: {wrong:.1%} of steps wrong (exact verifier), {mc_negative:.1%} negative "
            f"by MC label; {mixed:.1%} of rollouts mixed (exact), {mc_mixed:.1%} by MC label; MC "
            f"label agreement {agreement:.1%} (paper's corpus: 3.6% wrong steps, 7.7% mixed "
            f"rollouts).")


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README tables from the compare stage's metrics: arms as rows, nothing typed by hand.

    A second regime's metrics (`metrics/regime_*.json`: a compare dict plus `corpus/*`, `regime/*`
    and `source`, kept from a committed run at other problem settings) get their own table."""
    m = metrics.get("compare", {})
    if not any(k.endswith("/f1_mean") for k in m):
        return "_No results yet: run the pipeline._\n"
    lines: list[str] = []
    mc, ro = metrics.get("mc_annotate", {}), metrics.get("rollouts", {})
    if "true_wrong_share" in mc and "train_mixed_share" in ro:
        lines += [_corpus(mc["true_wrong_share"], mc["negative_step_share"],
                          ro["train_mixed_share"], mc["mixed_rollout_share"],
                          mc["label_agreement"]), ""]
    lines += _arm_lines(m)
    for name in sorted(k for k in metrics if k.startswith("regime_")):
        r = metrics[name]
        lines += ["", f"Second regime: problems with {r['regime/min_operands']:.0f}-"
                      f"{r['regime/max_operands']:.0f} operands (from {r.get('source', name)}).",
                  "", _corpus(r["corpus/true_wrong_share"], r["corpus/mc_negative_share"],
                              r["corpus/true_mixed_share"], r["corpus/mc_mixed_share"],
                              r["corpus/label_agreement"]), ""]
        lines += _arm_lines(r)
    return "\n".join(lines) + "\n"
