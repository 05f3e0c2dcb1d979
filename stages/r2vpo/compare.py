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

Claims (`stages.core.stats.claim`, paired by seed, 95% t interval; +1 reproduced, 0
inconclusive, -1 contradicted, with the minimum detectable effect), the method arm against the
clipped baseline:
- final accuracy higher, relative to the baseline's mean (paper: up to +17% average relative
  gain over clipping, arXiv 2601.03320 abstract);
- rollouts to reach the target fewer, relative to the baseline's mean (paper: ~50% fewer);
- control: the last-10% return higher in every environment (arXiv 2605.26784 abstract: beats
  PPO, no number given), and the gain larger on a sparse-reward environment than on its dense
  counterpart (same abstract: "especially with sparse rewards"), per seed
  (method - PPO on sparse) - (method - PPO on dense).

Outputs: `report/` (table.md, acc_vs_rollouts.png, control.png), `plots/acc_vs_rollouts.csv`
(mean curve per arm, for `dvc plots`), and the flat metrics for DVC and the README table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.core.checks import read_json_checked
from stages.core.config import check_arm, unique_arms
from stages.core import io, stats
from stages.core.stats import (Claim, check_budgets, claim_by_key, claim_metrics, mean_std,
                               read_claim)

# What must be equal across the LLM arms (the keys of `stages.train.grpo.GRPOParams.budget`).
BUDGET_KEYS = ("rounds", "prompts_per_round", "num_generations", "minibatches", "num_iterations",
               "max_completion_length")


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
    method: str = Field("r2vpo", description="the paper's method arm; the claims test it "
                                             "against `baseline`, paired by seed")
    paper_final_acc_gain: float | None = Field(
        0.17, ge=-1, description="the paper's final-accuracy gain of the method over clipping, "
                                 "relative to the baseline ((m - b) / b; None: not stated)")
    paper_rollouts_change: float | None = Field(
        -0.5, ge=-1, description="the paper's change in rollouts to reach the target, relative "
                                 "to the baseline (-0.5: half as many; None: not stated)")
    control_method: str = Field("r2vpo", description="the method's arm in the control curves")
    control_baseline: str = Field("ppo", description="the clipped arm in the control curves "
                                                     "(the paper states no control effect size)")

    @field_validator("arms")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        return unique_arms(value)

    @model_validator(mode="after")
    def _baseline_is_an_arm(self) -> "Config":
        check_arm("baseline", self.baseline, self.arms)
        check_arm("method", self.method, self.arms)
        if self.method == self.baseline:
            raise ValueError(f"method and baseline are both {self.method!r}")
        if self.control_method == self.control_baseline:
            raise ValueError(f"control_method and control_baseline are both "
                             f"{self.control_method!r}")
        return self


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


def seed_rollouts_to_reach(seeds: dict[int, list[tuple[float, float]]], level: float
                           ) -> dict[int, float | None]:
    """seed -> rollouts until `level` is first reached (None: never)."""
    return {seed: rollouts_to_reach(pts, level) for seed, pts in seeds.items()}


def budget_if_never(reach: dict[int, float | None], budget: float) -> dict[int, float]:
    """A seed that never reaches the level counts the arm's whole budget."""
    return {seed: budget if r is None else r for seed, r in reach.items()}


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
        reach = seed_rollouts_to_reach(seeds, level)
        m, s = mean_std(finals[arm])
        out[f"{arm}/final_acc_mean"], out[f"{arm}/final_acc_std"] = m, s
        out[f"{arm}/gain_vs_{baseline}"] = (m - base_mean) / base_mean if base_mean > 0 else 0.0
        r_m, r_s = mean_std(list(budget_if_never(reach, budget).values()))
        out[f"{arm}/rollouts_to_reach_mean"], out[f"{arm}/rollouts_to_reach_std"] = r_m, r_s
        out[f"{arm}/reached_frac"] = sum(r is not None for r in reach.values()) / len(reach)
        a_m, a_s = mean_std([auc(pts) for pts in seeds.values()])
        out[f"{arm}/auc_mean"], out[f"{arm}/auc_std"] = a_m, a_s
        out[f"{arm}/seeds"] = float(len(seeds))
    return out


def llm_claims(curves: dict[str, dict[int, list[tuple[float, float]]]], level: float,
               method: str, baseline: str, paper_final_acc_gain: float | None = None,
               paper_rollouts_change: float | None = None) -> dict[str, float]:
    """The paper's two LLM claims, `method` vs `baseline` paired by seed, each relative to the
    baseline's mean: final accuracy higher, rollouts to reach `level` fewer (module docstring)."""
    def finals(arm: str) -> dict[int, float]:
        return {seed: pts[-1][1] for seed, pts in curves[arm].items()}

    def reach(arm: str) -> dict[int, float]:
        budget = max(pts[-1][0] for pts in curves[arm].values())
        return budget_if_never(seed_rollouts_to_reach(curves[arm], level), budget)

    pair = f"{method}_vs_{baseline}"
    acc = claim_by_key(finals(method), finals(baseline), direction=1,
                       paper_effect=paper_final_acc_gain, relative=True)
    rollouts = claim_by_key(reach(method), reach(baseline), direction=-1,
                            paper_effect=paper_rollouts_change, relative=True)
    return {**claim_metrics(acc, f"claim/final_acc/{pair}"),
            **claim_metrics(rollouts, f"claim/rollouts_to_reach/{pair}")}


def _load_curves(runs: Path, arms: list[str]) -> tuple[dict, dict, Any]:
    import polars as pl

    from stages.core.checks import read_parquet_checked

    spec = curve_spec()
    curves: dict[str, dict[int, list[tuple[float, float]]]] = {}
    budgets: dict[str, dict[str, Any]] = {}
    frames = []
    for arm in arms:
        folder = runs / arm
        if not (folder / "budget.json").is_file():
            raise FileNotFoundError(f"{folder}: no budget.json; run stage {arm!r}")
        df = read_parquet_checked(folder / "curve.parquet", spec)
        budgets[arm] = read_json_checked(folder / "budget.json")
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


def control_last10(df: Any) -> dict[tuple[str, str], dict[int, float]]:
    """(env, arm) -> seed -> mean dense return over the last 10% of the seed's evaluations (at
    least the last one)."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for (env, arm), g in df.group_by(["env", "arm"], maintain_order=True):
        out[(env, arm)] = {}
        for (seed,), s in g.group_by("seed", maintain_order=True):
            s = s.sort("env_steps")
            k = max(1, len(s) // 10)
            out[(env, arm)][int(seed)] = float(s["dense_return"].tail(k).mean())
    return out


def control_summary(df: Any) -> dict[str, float]:
    """Per env and arm: mean ± std over seeds of `control_last10`."""
    out: dict[str, float] = {}
    for (env, arm), lasts in control_last10(df).items():
        m, sd = mean_std(list(lasts.values()))
        key = env.replace(":", "_")
        out[f"control/{key}/{arm}/return_last10_mean"] = m
        out[f"control/{key}/{arm}/return_last10_std"] = sd
    return out


def control_claims(lasts: dict[tuple[str, str], dict[int, float]], method: str,
                   baseline: str) -> dict[str, float]:
    """Per environment: `method`'s last-10% return above `baseline`'s, paired by seed; per
    sparse environment `sparse:<env>` whose dense `<env>` also ran: the per-seed gain
    (method - baseline) larger there than on the dense one (module docstring)."""
    out: dict[str, float] = {}
    envs = list(dict.fromkeys(env for env, _ in lasts))
    pair = f"{method}_vs_{baseline}"
    gains = {}
    for env in envs:
        if (env, method) not in lasts or (env, baseline) not in lasts:
            raise ValueError(f"control curves of {env!r} lack arm {method!r} or {baseline!r} "
                             f"(arms: {sorted(a for e, a in lasts if e == env)})")
        m, b = lasts[(env, method)], lasts[(env, baseline)]
        c = claim_by_key(m, b, direction=1)
        out.update(claim_metrics(c, f"claim/control/{env.replace(':', '_')}/{pair}"))
        gains[env] = {seed: m[seed] - b[seed] for seed in m if seed in b}
    for env in envs:
        dense = env.removeprefix("sparse:")
        if env.startswith("sparse:") and dense in gains:
            c = claim_by_key(gains[env], gains[dense], direction=1)
            out.update(claim_metrics(c, f"claim/control_sparse_gap/{env.replace(':', '_')}/"
                                        f"{pair}"))
    return out


def curve_spec() -> Any:
    """An LLM arm's curve.parquet (stages.train.grpo), one row per evaluation point of a seed:
    what the summaries rely on."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    return FrameSpec({"seed": ColumnSpec(dtype=pl.Int64),
                      "round": ColumnSpec(dtype=pl.Float64, min=0),
                      "rollouts": ColumnSpec(dtype=pl.Float64, min=0),
                      "eval_acc": ColumnSpec(dtype=pl.Float64, min=0.0, max=1.0)})


def control_spec() -> Any:
    """The control curves (stages.r2vpo.control) as the summaries read them: per env, arm, seed
    and env step the dense return (never NaN); the diagnostics columns are not read here."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    return FrameSpec({"env": ColumnSpec(dtype=pl.String), "arm": ColumnSpec(dtype=pl.String),
                      "seed": ColumnSpec(dtype=pl.Int64),
                      "env_steps": ColumnSpec(dtype=pl.Int64, min=0),
                      "dense_return": ColumnSpec(dtype=pl.Float64)})


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked

    curves, budgets, frame = _load_curves(ctx.path(cfg.runs), cfg.arms)
    check_budgets(budgets, BUDGET_KEYS)
    metrics = summarize(curves, cfg.baseline, cfg.reach_frac)
    metrics.update(llm_claims(curves, metrics["reach_level"], cfg.method, cfg.baseline,
                              cfg.paper_final_acc_gain, cfg.paper_rollouts_change))
    mean_curve = (frame.group_by(["arm", "round"], maintain_order=True)
                  .agg(pl.col("rollouts").mean(), pl.col("eval_acc").mean(),
                       pl.col("eval_acc").std(ddof=0).alias("eval_acc_std"))
                  .sort(["arm", "rollouts"]))
    control = None
    if cfg.control:
        control = read_parquet_checked(ctx.path(cfg.control), control_spec())
        metrics.update(control_summary(control))
        metrics.update(control_claims(control_last10(control), cfg.control_method,
                                      cfg.control_baseline))
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
    return "\n".join(lines + claims_table(m)) + "\n"


# claim kind -> (README wording from method a, baseline b and environment env; number format)
CLAIM_TEXT = {
    "final_acc": ("{a} vs {b}: final accuracy, change relative to {b} (paper: higher)",
                  "{:+.1%}"),
    "rollouts_to_reach": ("{a} vs {b}: rollouts to reach the target, change relative to {b} "
                          "(paper: fewer)", "{:+.1%}"),
    "control": ("{a} vs {b} on {env}: return over the last 10% of evaluations (paper: higher)",
                "{:+.1f}"),
    "control_sparse_gap": ("{a} - {b} return on {env} minus on its dense version (paper: the "
                           "gain is largest with sparse rewards)", "{:+.1f}"),
}


def claims_table(m: dict[str, Any]) -> list[str]:
    """README lines: every claim in `m` with its verdict sentence (`Claim.sentence`)."""
    prefixes = [k[:-len("/verdict")] for k in m if k.startswith("claim/")
                and k.endswith("/verdict")]
    kinds = list(CLAIM_TEXT)
    prefixes.sort(key=lambda p: (kinds.index(p.split("/")[1]) if p.split("/")[1] in kinds
                                 else len(kinds), p))
    if not prefixes:
        return []
    lines = ["", "Claims, paired by seed (difference method - baseline with its 95% t interval; "
             "MDE: the smallest true difference these seeds would detect with 80% power):", "",
             "| claim | verdict |", "|---|---|"]
    for prefix in prefixes:
        parts = prefix.split("/")
        a, _, b = parts[-1].partition("_vs_")
        text, fmt = CLAIM_TEXT.get(parts[1], (parts[1] + ": {a} vs {b}", "{:+.3f}"))
        c: Claim | None = read_claim(m, prefix)
        env = parts[2] if len(parts) > 3 else ""
        lines.append(f"| {text.format(a=a, b=b, env=env)} | {c.sentence(fmt) if c else 'n/a'} |")
    return lines


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many claims are reproduced / inconclusive / contradicted; each claim and
    every arm's numbers in details/compare.json."""
    return stats.verdict_counts(metrics)
