"""Stage `compare` of an RL pipeline: arms side by side, same budget, mean and std over seeds.

Reads `<runs>/<arm>/curve.parquet` (held-out greedy accuracy against rollouts consumed, one curve
per seed) and `<runs>/<arm>/budget.json` of every arm, and, when given, the control curves of
`stages.r2vpo.control`. It refuses to compare arms whose budgets differ (rounds, prompts per
round, G, minibatches, passes, completion length): a comparison at unequal budget is not one.

Per arm (mean ± population std over seeds):
- `final_acc`: held-out accuracy at the end of training;
- `gain_vs_<baseline>`: final_acc relative to the baseline arm's, (a - b) / b;
- `rollouts_to_reach`: rollouts consumed until accuracy first reaches
  `start + reach_frac * (best - start)`, where start is the mean accuracy before training and best
  the best arm's mean final accuracy: `reach_frac` (80%) of the best *improvement*. (The spec's
  "80% of the best final accuracy" is below the starting point when RL starts from a model that
  already solves many prompts, and every arm would "reach" it at 0 rollouts.) A seed that never
  reaches it counts the full budget and `reached_frac` says how many seeds did; when no arm
  improves on the start, the level is the start itself;
- `auc`: mean accuracy over the evaluation points (area under the curve / its width), a
  threshold-free sample-efficiency score.
Control: mean dense return over the last 10% of evaluations, per environment and arm.

Outputs: `report/` (table.md, acc_vs_rollouts.png, control.png), `plots/acc_vs_rollouts.csv`
(mean curve per arm, for `dvc plots`), and the flat metrics for DVC and the README table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.core import io


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str] = Field(min_length=1, description="RL stages to compare (their <runs>/<arm>)")
    baseline: str = Field(description="the arm the gains are relative to")
    runs: str = Field("runs", description="paths key of the runs folder")
    control: str | None = Field("control_curves", description="paths key of the control curves "
                                                              "parquet (None: no control arm)")
    report: str = Field("report", description="paths key of the report folder")
    plot: str = Field("plots/acc_vs_rollouts.csv", description="plot CSV, relative to the "
                                                               "pipeline folder")
    reach_frac: float = Field(0.8, gt=0, le=1, description="sample-efficiency threshold, as a "
                                                           "share of the best final accuracy")

    @field_validator("arms")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"arms {value} list an arm twice")
        return value

    @model_validator(mode="after")
    def _baseline_is_an_arm(self) -> "Config":
        if self.baseline not in self.arms:
            raise ValueError(f"baseline {self.baseline!r} is not one of the arms {self.arms}")
        return self


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std (ddof=0): the seeds are the whole population we ran."""
    if not values:
        raise ValueError("mean_std of no values")
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def rollouts_to_reach(points: list[tuple[float, float]], level: float) -> float | None:
    """First rollout count at which accuracy >= level, from (rollouts, acc) sorted by rollouts."""
    for rollouts, acc in points:
        if acc >= level - 1e-12:
            return rollouts
    return None


def auc(points: list[tuple[float, float]]) -> float:
    """Trapezoid area under accuracy vs rollouts divided by the rollout span (a mean accuracy)."""
    if len(points) < 2:
        return points[0][1] if points else 0.0
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(points, points[1:]))
    span = points[-1][0] - points[0][0]
    return area / span if span > 0 else points[-1][1]


def check_budgets(budgets: dict[str, dict[str, Any]]) -> None:
    """Raise ValueError naming the arm and the key when arms were run at different budgets."""
    keys = ("rounds", "prompts_per_round", "num_generations", "minibatches", "num_iterations",
            "max_completion_length")
    first_arm, first = next(iter(budgets.items()))
    for arm, budget in budgets.items():
        for key in keys:
            if budget.get(key) != first.get(key):
                raise ValueError(f"arm {arm!r} ran with {key} = {budget.get(key)} but "
                                 f"{first_arm!r} with {first.get(key)}: budgets must be equal "
                                 f"(set it in the shared anchor of params.yaml)")


def summarize(curves: dict[str, dict[int, list[tuple[float, float]]]], baseline: str,
              reach_frac: float) -> dict[str, float]:
    """Flat metrics from arm -> seed -> [(rollouts, acc)] curves (see the module docstring)."""
    finals = {arm: [pts[-1][1] for pts in seeds.values()] for arm, seeds in curves.items()}
    best = max(mean_std(v)[0] for v in finals.values())
    start = mean_std([pts[0][1] for seeds in curves.values() for pts in seeds.values()])[0]
    level = start + reach_frac * max(0.0, best - start)
    base_mean = mean_std(finals[baseline])[0]
    out: dict[str, float] = {"reach_level": level, "start_acc": start, "best_final_acc": best}
    for arm, seeds in curves.items():
        budget = max(pts[-1][0] for pts in seeds.values())
        reach = [rollouts_to_reach(pts, level) for pts in seeds.values()]
        m, s = mean_std(finals[arm])
        out[f"{arm}/final_acc_mean"], out[f"{arm}/final_acc_std"] = m, s
        out[f"{arm}/gain_vs_{baseline}"] = (m - base_mean) / base_mean if base_mean > 0 else 0.0
        r_m, r_s = mean_std([budget if r is None else r for r in reach])
        out[f"{arm}/rollouts_to_reach_mean"], out[f"{arm}/rollouts_to_reach_std"] = r_m, r_s
        out[f"{arm}/reached_frac"] = sum(r is not None for r in reach) / len(reach)
        a_m, a_s = mean_std([auc(pts) for pts in seeds.values()])
        out[f"{arm}/auc_mean"], out[f"{arm}/auc_std"] = a_m, a_s
        out[f"{arm}/seeds"] = float(len(seeds))
    return out


def _load_curves(runs: Path, arms: list[str]) -> tuple[dict, dict, Any]:
    import polars as pl

    curves: dict[str, dict[int, list[tuple[float, float]]]] = {}
    budgets: dict[str, dict[str, Any]] = {}
    frames = []
    for arm in arms:
        folder = runs / arm
        if not (folder / "curve.parquet").is_file() or not (folder / "budget.json").is_file():
            raise FileNotFoundError(f"{folder}: no curve.parquet/budget.json; run stage {arm!r}")
        df = pl.read_parquet(folder / "curve.parquet")
        missing = {"seed", "rollouts", "eval_acc"} - set(df.columns)
        if missing or df.is_empty():
            raise ValueError(f"{folder / 'curve.parquet'}: missing columns {sorted(missing)} "
                             f"or no rows")
        budgets[arm] = json.loads((folder / "budget.json").read_text())
        frames.append(df.with_columns(pl.lit(arm).alias("arm")))
        curves[arm] = {int(seed): sorted(zip(g["rollouts"].to_list(), g["eval_acc"].to_list()))
                       for (seed,), g in df.group_by("seed", maintain_order=True)}
    return curves, budgets, pl.concat(frames, how="diagonal_relaxed")


def _plot_curves(mean_curve: Any, path: Path, x: str, y: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (arm,), g in mean_curve.group_by("arm", maintain_order=True):
        g = g.sort(x)
        ax.plot(g[x], g[y], marker="o", label=arm)
        if f"{y}_std" in g.columns:
            lo = (g[y] - g[f"{y}_std"]).to_list()
            hi = (g[y] + g[f"{y}_std"]).to_list()
            ax.fill_between(g[x].to_list(), lo, hi, alpha=0.15)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def control_summary(df: Any) -> dict[str, float]:
    """Per env and arm: mean ± std over seeds of the mean dense return over the last 10% of
    evaluations (at least the last one)."""
    out: dict[str, float] = {}
    for (env, arm), g in df.group_by(["env", "arm"], maintain_order=True):
        lasts = []
        for (_,), s in g.group_by("seed", maintain_order=True):
            s = s.sort("env_steps")
            k = max(1, len(s) // 10)
            lasts.append(float(s["dense_return"].tail(k).mean()))
        m, sd = mean_std(lasts)
        key = env.replace(":", "_")
        out[f"control/{key}/{arm}/return_last10_mean"] = m
        out[f"control/{key}/{arm}/return_last10_std"] = sd
    return out


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    curves, budgets, frame = _load_curves(ctx.path(cfg.runs), cfg.arms)
    check_budgets(budgets)
    metrics = summarize(curves, cfg.baseline, cfg.reach_frac)
    mean_curve = (frame.group_by(["arm", "round"], maintain_order=True)
                  .agg(pl.col("rollouts").mean(), pl.col("eval_acc").mean(),
                       pl.col("eval_acc").std(ddof=0).alias("eval_acc_std"))
                  .sort(["arm", "rollouts"]))
    control = None
    if cfg.control:
        control = pl.read_parquet(ctx.path(cfg.control))
        metrics.update(control_summary(control))
    plot_csv = ctx.pipeline_dir / cfg.plot
    with io.atomic_path(plot_csv) as tmp:
        mean_curve.select("arm", "rollouts", "eval_acc", "eval_acc_std").write_csv(tmp)
    with io.atomic_path(ctx.path(cfg.report), is_dir=True) as tmp:
        _plot_curves(mean_curve, tmp / "acc_vs_rollouts.png", "rollouts", "eval_acc",
                     f"{ctx.pipeline}: held-out accuracy vs rollouts (mean over seeds)")
        if control is not None:
            for env in control["env"].unique(maintain_order=True).to_list():
                c = (control.filter(pl.col("env") == env)
                     .group_by(["arm", "env_steps"], maintain_order=True)
                     .agg(pl.col("dense_return").mean(),
                          pl.col("dense_return").std(ddof=0).alias("dense_return_std")))
                _plot_curves(c, tmp / f"control_{env.replace(':', '_')}.png", "env_steps",
                             "dense_return", f"{env}: return vs env steps")
        (tmp / "table.md").write_text(results_table({"compare": metrics}))
    return metrics


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README table from the compare stage's metrics: arms as rows, nothing typed by hand."""
    m = metrics.get("compare", {})
    arms = sorted({k.split("/")[0] for k in m if k.endswith("/final_acc_mean")},
                  key=lambda a: list(m).index(f"{a}/final_acc_mean"))
    if not arms:
        return "_No results yet: run the pipeline._\n"
    gain_key = next((k.split("/", 1)[1] for k in m if "/gain_vs_" in k), "gain")
    lines = [f"Held-out greedy accuracy before training: {m.get('start_acc', float('nan')):.3f}; "
             f"target for 'rollouts to reach': {m.get('reach_level', float('nan')):.3f}.", "",
             "| arm | final accuracy | " + gain_key.replace("_", " ") +
             " | rollouts to reach target | seeds reaching it | AUC |",
             "|---|---|---|---|---|---|"]
    for a in arms:
        lines.append(
            f"| {a} | {m[f'{a}/final_acc_mean']:.3f} ± {m[f'{a}/final_acc_std']:.3f} "
            f"| {m[f'{a}/{gain_key}']:+.1%} "
            f"| {m[f'{a}/rollouts_to_reach_mean']:.0f} ± {m[f'{a}/rollouts_to_reach_std']:.0f} "
            f"| {m[f'{a}/reached_frac']:.0%} "
            f"| {m[f'{a}/auc_mean']:.3f} ± {m[f'{a}/auc_std']:.3f} |")
    control = sorted({tuple(k.split("/")[1:3]) for k in m if k.startswith("control/")})
    if control:
        lines += ["", "| environment | arm | return, last 10% of evaluations |", "|---|---|---|"]
        for env, arm in control:
            lines.append(f"| {env} | {arm} | {m[f'control/{env}/{arm}/return_last10_mean']:.1f}"
                         f" ± {m[f'control/{env}/{arm}/return_last10_std']:.1f} |")
    return "\n".join(lines) + "\n"
