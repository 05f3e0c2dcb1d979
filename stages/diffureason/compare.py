"""Stage `compare` of DiffuReason: the arms side by side on the NFE grid and the paper's
predictions under the house claim rule (`stages.core.stats`: paired 95% CI, reproduced /
contradicted / inconclusive, MDE beside the effect).

Pairs are test problems: a problem's value is its accuracy averaged over the training seeds,
and the percentile bootstrap over problems gives the CI of method - baseline at the same
budget (the same NFE cap per problem; what each arm really spent is in the table). No effect
sizes are public (spec §1), so no claim carries a paper effect. Claims (spec §4):

    dr_vs_vanilla/x<m>      DiffuReason > vanilla decoding                 at every multiplier
    dr_vs_best_of_n/x<m>    DiffuReason > best-of-N + majority vote        at every multiplier
    revise_helps/x<m>       DiffuReason > DiffuReason without revise       at every multiplier
    revise_helps_hard       ... on the hardest problems (most steps) at the top multiplier
    dr_vs_ar_mcts/x<m>      DiffuReason > AR + MCTS with the same value    at equal NFE (the
                            paper's 'better accuracy/efficiency balance'; wall clock is logged
                            to MLflow only, per the metrics contract)

At 1x every search arm is vanilla decoding by construction (no simulation fits): those claims
are ties and come out inconclusive, as they should.

Outputs: `report/table.md`, `report/curve.png` (accuracy against NFE per problem),
`report/curve.parquet` and `plots/diffureason_curve.csv` (accuracy and NFE per arm and
multiplier).

    python -m stages diffureason compare
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io, stats

ORDER = ("vanilla", "best_of_n", "diffureason", "no_revise", "ar_mcts")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    search: str = Field("diffureason_search", description="paths key of the search output")
    report: str = Field("diffureason_report", description="paths key of the report folder")
    plot: str = Field("plots/diffureason_curve.csv", description="plot CSV (pipeline-relative)")
    draws: int = Field(2000, ge=100, description="bootstrap draws")


def per_problem(frame: Any, arm: str, mult: int, col: str = "score") -> dict[str, float]:
    import polars as pl

    part = frame.filter((pl.col("arm") == arm) & (pl.col("mult") == mult))
    agg = part.sort("seed").group_by("problem", maintain_order=True).agg(
        pl.col(col).cast(pl.Float64).mean())
    return dict(zip(agg["problem"].to_list(), agg[col].to_list()))


def paired(frame: Any, method: str, baseline: str, mult: int, draws: int) -> stats.Claim:
    a = per_problem(frame, method, mult)
    b = per_problem(frame, baseline, mult)
    keys = sorted(set(a) & set(b))
    if not keys:
        raise ValueError(f"no problem has both {method!r} and {baseline!r} at x{mult}")
    return stats.claim([a[k] for k in keys], [b[k] for k in keys], method_ci="bootstrap",
                       draws=draws)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked
    from stages.diffureason.search import result_spec
    from stages.search.budget import compute_curve, plot_accuracy_vs_compute

    frame = read_parquet_checked(ctx.path(cfg.search) / "results.parquet", result_spec())
    arms = [a for a in ORDER if a in set(frame["arm"].to_list())]
    mults = sorted(frame["mult"].unique().to_list())
    top = mults[-1]
    metrics: dict[str, float] = {}

    def add(name: str, method: str, baseline: str, mult: int, sub: Any = None) -> None:
        if method in arms and baseline in arms:
            c = paired(sub if sub is not None else frame, method, baseline, mult, cfg.draws)
            metrics.update(stats.claim_metrics(c, f"claim/{name}"))

    for m in mults:
        add(f"dr_vs_vanilla/x{m}", "diffureason", "vanilla", m)
        add(f"dr_vs_best_of_n/x{m}", "diffureason", "best_of_n", m)
        add(f"revise_helps/x{m}", "diffureason", "no_revise", m)
        add(f"dr_vs_ar_mcts/x{m}", "diffureason", "ar_mcts", m)
    hardest = int(frame["steps"].max())
    add("revise_helps_hard", "diffureason", "no_revise", top,
        sub=frame.filter(pl.col("steps") == hardest))
    metrics.update(stats.verdict_counts(metrics))

    curve = compute_curve(frame.drop("seed", "mult", "steps").to_dicts())
    V = int(frame["budget"].min() // min(mults))
    curve = curve.with_columns((pl.col("budget") // V).alias("mult"))
    lines = ["| arm | " + " | ".join(f"x{m} acc (NFE)" for m in mults) + " |",
             "|---|" + "---|" * len(mults)]
    for arm in arms:
        part = {r["mult"]: r for r in curve.filter(pl.col("arm") == arm).iter_rows(named=True)}
        lines.append(f"| {arm} | " + " | ".join(f"{part[m]['accuracy']:.3f} "
                                                f"({part[m]['nfe']:.0f})" for m in mults) + " |")
        for m in mults:
            metrics[f"{arm}/x{m}/accuracy"] = float(part[m]["accuracy"])
            metrics[f"{arm}/x{m}/nfe"] = float(part[m]["nfe"])
    # per-seed accuracy spread at the top multiplier (seeds are the training repeats)
    for arm in arms:
        # sorted: polars' group order varies run to run, and the float sums would follow it
        per_seed = (frame.filter((pl.col("arm") == arm) & (pl.col("mult") == top))
                    .group_by("seed").agg(pl.col("score").mean()).sort("seed")["score"]
                    .to_list())
        metrics[f"{arm}/x{top}/seed_sd"] = stats.mean_std(per_seed)[1]
    metrics["vanilla_nfe"] = float(V)
    metrics["hardest_steps"] = float(hardest)
    out = ctx.path(cfg.report)
    with io.atomic_path(out, is_dir=True) as tmp:
        io.write_text(tmp / "table.md", "\n".join(lines) + "\n")
        plot_accuracy_vs_compute(curve, tmp / "curve.png", x="nfe", y="accuracy",
                                 title="DiffuReason toy: accuracy vs NFE per problem")
        io.write_parquet(tmp / "curve.parquet", curve)
    csv = ctx.pipeline_dir / cfg.plot
    csv.parent.mkdir(parents=True, exist_ok=True)
    with io.atomic_path(csv) as tmp_csv:
        curve.select("arm", "mult", "accuracy", "nfe").write_csv(tmp_csv)
    return metrics


def headline(details: dict[str, float]) -> dict[str, float]:
    return stats.verdict_counts(details)


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """The README block from the stages' metrics: accuracy (NFE) per arm and multiplier, the
    claims, the models' greedy accuracy and the value's AUC."""
    m = metrics.get("compare", {})
    arms = [a for a in ORDER if f"{a}/x1/accuracy" in m or any(
        k.startswith(f"{a}/x") for k in m)]
    mults = sorted({int(k.split("/")[1][1:]) for k in m
                    if k.count("/") == 2 and k.endswith("/accuracy")})
    if not arms or not mults:
        return "_No results yet: run the pipeline._\n"
    V = m.get("vanilla_nfe", float("nan"))
    lines = [f"Accuracy on the test problems (mean over training seeds) and mean NFE spent per "
             f"problem, at budgets of 1x / 4x / 16x vanilla decoding's NFE (V = {V:.0f}):", "",
             "| arm | " + " | ".join(f"x{k}" for k in mults) + " |",
             "|---|" + "---|" * len(mults)]
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(
            f"{m.get(f'{arm}/x{k}/accuracy', float('nan')):.3f} "
            f"({m.get(f'{arm}/x{k}/nfe', float('nan')):.0f})" for k in mults) + " |")
    lines += ["", "Claims (house rule: paired over test problems, seed-mean per problem, 95% "
              "bootstrap CI; no paper effect sizes are public):", "",
              "| claim | verdict | diff [95% CI] | MDE |", "|---|---|---|---|"]
    names = sorted({k[:-len("/verdict")] for k in m if k.startswith("claim/")
                    and k.endswith("/verdict")})
    for name in names:
        c = stats.read_claim(m, name)
        if c is not None:
            lines.append(f"| {name[6:]} | {c.name} | {c.diff:+.3f} [{c.low:+.3f}, "
                         f"{c.high:+.3f}] | {c.mde:.3f} |")
    t, s, p = metrics.get("train", {}), metrics.get("search", {}), metrics.get("problems", {})
    lines += ["", "Models and value:", ""]
    if t:
        lines.append(f"- Greedy validation accuracy (mean over seeds): diffusion LM "
                     f"{t.get('mdlm_val_greedy_acc', float('nan')):.3f}, AR twin "
                     f"{t.get('ar_val_greedy_acc', float('nan')):.3f}"
                     + (f"; the best constant answer scores {p['majority_answer_rate']:.3f}"
                        if "majority_answer_rate" in p else "") + ".")
    if "value_auc" in s:
        lines.append(f"- Self-consistency value vs correctness of its majority answer (every "
                     f"non-terminal value of the searches): AUC {s['value_auc']:.3f}.")
    return "\n".join(lines) + "\n"
