"""Stage `compare` of Refine-Prover: the arms side by side and the paper's claims under the house
claim rule (`stages.core.stats`: paired 95% CI, reproduced / contradicted / inconclusive, MDE).

Pairs are test problems: a problem's value is its mean over the training seeds (solved share,
output tokens), and the percentile bootstrap over problems gives the CI of method - baseline.
Claims (spec §4 predicted directions; paper effects at budget 64 from the spec's tables, in
solved-share units, Goedel-Prover-V2 on PutnamBench where given):

    value_vs_random/B<b>    value_tree > random_tree          (paper: 63 vs 63 of 657 at 64)
    random_vs_iid/B<b>      random_tree > iid                  (paper: 63 vs 32 problems)
    ei_vs_cold              random_tree > cold_refiner at max B (paper: 63 vs 47)
    cold_vs_untrained       cold_refiner > base_refiner at max B (paper: 47 vs 46)
    tokens_tree_vs_history  random_tree output tokens < long_history at max B

Outputs: `report/table.md` (solved share and output / input tokens per problem, per arm and
budget, mean over seeds), `report/curve.png` (solved against output tokens per problem) and
`plots/refine_prover_curve.csv`.

    python -m stages refine_prover compare
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io, stats

PUTNAM = 657     # PutnamBench problems: the paper's counts -> shares


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    search: str = Field("refine_prover_search", description="paths key of the search output")
    report: str = Field("refine_prover_report", description="paths key of the report folder")
    plot: str = Field("plots/refine_prover_curve.csv", description="plot CSV (pipeline-relative)")
    draws: int = Field(2000, ge=100, description="bootstrap draws")


def per_problem(frame: Any, arm: str, budget: int, col: str) -> dict[str, float]:
    import polars as pl

    part = frame.filter((pl.col("arm") == arm) & (pl.col("budget") == budget))
    agg = part.group_by("problem").agg(pl.col(col).cast(pl.Float64).mean())
    return dict(zip(agg["problem"].to_list(), agg[col].to_list()))


def paired(frame: Any, method: str, baseline: str, budget: int, col: str, direction: int,
           paper_effect: float | None, draws: int) -> stats.Claim:
    a = per_problem(frame, method, budget, col)
    b = per_problem(frame, baseline, budget, col)
    keys = sorted(set(a) & set(b))
    return stats.claim([a[k] for k in keys], [b[k] for k in keys], direction=direction,
                       paper_effect=paper_effect, method_ci="bootstrap", draws=draws)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked
    from stages.refine_prover.search import result_spec
    from stages.search.budget import compute_curve, plot_accuracy_vs_compute

    frame = read_parquet_checked(ctx.path(cfg.search) / "results.parquet", result_spec())
    arms = frame["arm"].unique(maintain_order=True).to_list()
    budgets = sorted(frame["budget"].unique().to_list())
    top = budgets[-1]
    metrics: dict[str, float] = {}

    def add(name: str, method: str, baseline: str, budget: int, col: str = "score",
            direction: int = 1, paper: float | None = None) -> None:
        if method in arms and baseline in arms:
            c = paired(frame, method, baseline, budget, col, direction, paper, cfg.draws)
            metrics.update(stats.claim_metrics(c, f"claim/{name}"))

    for b in budgets:
        add(f"value_vs_random/B{b}", "value_tree", "random_tree", b,
            paper=0.0 if b == 64 else None)
        add(f"random_vs_iid/B{b}", "random_tree", "iid", b,
            paper=(63 - 32) / PUTNAM if b == 64 else None)
    add("ei_vs_cold", "random_tree", "cold_refiner", top, paper=(63 - 47) / PUTNAM)
    add("cold_vs_untrained", "cold_refiner", "base_refiner", top, paper=(47 - 46) / PUTNAM)
    add("tokens_tree_vs_history", "random_tree", "long_history", top, col="output_tokens",
        direction=-1)
    metrics.update(stats.verdict_counts(metrics))

    curve = compute_curve(frame.drop("seed").to_dicts())
    lines = ["| arm | " + " | ".join(f"B={b} solved" for b in budgets)
             + f" | out tok/problem (B={top}) | in tok/problem (B={top}) |",
             "|---|" + "---|" * (len(budgets) + 2)]
    for arm in arms:
        part = curve.filter(pl.col("arm") == arm)
        acc = {r["budget"]: r for r in part.iter_rows(named=True)}
        lines.append(f"| {arm} | " + " | ".join(f"{acc[b]['accuracy']:.3f}" for b in budgets)
                     + f" | {acc[top]['output_tokens']:.0f} | {acc[top]['input_tokens']:.0f} |")
        for b in budgets:
            metrics[f"{arm}/B{b}/solved"] = float(acc[b]["accuracy"])
        metrics[f"{arm}/output_tokens"] = float(acc[top]["output_tokens"])
    out = ctx.path(cfg.report)
    with io.atomic_path(out, is_dir=True) as tmp:
        io.write_text(tmp / "table.md", "\n".join(lines) + "\n")
        plot_accuracy_vs_compute(curve, tmp / "curve.png", x="output_tokens", y="accuracy",
                                 title="Refine-Prover toy: solved vs output tokens")
        io.write_parquet(tmp / "curve.parquet", curve)
    csv = ctx.pipeline_dir / cfg.plot if hasattr(ctx, "pipeline_dir") else None
    if csv is not None:
        csv.parent.mkdir(parents=True, exist_ok=True)
        with io.atomic_path(csv) as tmp_csv:
            curve.select("arm", "budget", "accuracy", "output_tokens").write_csv(tmp_csv)
    return metrics


def headline(details: dict[str, float]) -> dict[str, float]:
    return stats.verdict_counts(details)


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """The README block, from the stages' metrics: arms per budget, the claims, the kernel's
    checks and the i.i.d. check."""
    m = metrics.get("compare", {})
    arms = sorted({k.split("/")[0] for k in m if k.count("/") == 2 and k.endswith("/solved")},
                  key=lambda a: ("iid", "random_tree", "value_tree", "long_history",
                                 "base_refiner", "cold_refiner").index(a)
                  if a in ("iid", "random_tree", "value_tree", "long_history", "base_refiner",
                           "cold_refiner") else 99)
    if not arms:
        return "_No results yet: run the pipeline._\n"
    budgets = sorted({int(k.split("/")[1][1:]) for k in m if k.count("/") == 2
                      and k.endswith("/solved")})
    lines = ["Solved share of the test statements (mean over training seeds) and output tokens "
             f"per problem at B = {budgets[-1]}:", "",
             "| arm | " + " | ".join(f"B = {b}" for b in budgets) + " | output tokens |",
             "|---|" + "---|" * (len(budgets) + 1)]
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(f"{m[f'{arm}/B{b}/solved']:.3f}"
                                                for b in budgets)
                     + f" | {m.get(f'{arm}/output_tokens', float('nan')):.0f} |")
    lines += ["", "Claims (house rule: paired over test problems, 95% bootstrap CI; paper "
              "effects = PutnamBench counts / 657):", "",
              "| claim | verdict | diff [95% CI] | MDE | paper |", "|---|---|---|---|---|"]
    names = sorted({k[:-len("/verdict")] for k in m if k.startswith("claim/")
                    and k.endswith("/verdict")})
    for name in names:
        c = stats.read_claim(m, name)
        if c is None:
            continue
        paper = "n/a" if c.paper_effect is None else f"{c.paper_effect:+.3f}"
        lines.append(f"| {name[6:]} | {c.name} | {c.diff:+.3f} [{c.low:+.3f}, {c.high:+.3f}] | "
                     f"{c.mde:.3f} | {paper} |")
    p = metrics.get("problems", {})
    s = metrics.get("search", {})
    t = metrics.get("train", {})
    lines += ["", "Kernel and models:", ""]
    if p:
        coq = (f"Coq `lia` agreement {p['coq_agreement']:.3f} on {p['coq_n']:.0f} proofs "
               f"({p['coq_unexplained']:.0f} unexplained)" if p.get("coq_ran")
               else "Coq cross-check skipped (no coqc)")
        lines.append(f"- {p.get('n_test', 0):.0f} test statements, all certified by z3; "
                     f"one-character tampering rejected {p['tamper_rejected_share']:.4f} of "
                     f"{p['tampered']:.0f} (the rest stay entailed, z3); {coq}.")
    if s:
        lines.append(f"- Base prover's wrong samples: {s['real_failures/wrong_proofs']:.0f} "
                     f"distinct wrong proofs on {s['real_failures/signatures']:.0f} first-error "
                     f"signatures ({s['real_failures/proofs_per_signature']:.1f} per signature; "
                     f"{s['real_failures/shared_share']:.2f} share one).")
        if "iid_check/max_abs_z" in s:
            undefined = s.get("iid_check/undefined") or 0
            unchecked = s.get("iid_check/unchecked") or 0
            lines.append(f"- i.i.d. check (per problem, solved at B against 1 - C(n-k, B)/C(n, B) "
                         f"from k of n separate samples; t statistic over problems): max |z| over "
                         f"seeds and budgets = {s['iid_check/max_abs_z']:.2f}"
                         + (f"; {undefined:.0f} (seed, budget) cells with a constant non-zero "
                            "difference (no spread): untestable there" if undefined else "")
                         + (f"; {unchecked:.0f} (seed, budget) cells with B above the rate "
                            "samples n: not checkable" if unchecked else "") + ".")
    if t:
        lines.append(f"- Base prover acceptance on train statements "
                     f"{t.get('mean/base_train_accept', float('nan')):.3f}; refiner repair "
                     f"acceptance in the last expert-iteration round "
                     f"{t.get('mean/ei2_repair_accept', float('nan')):.3f}; value model AUC "
                     f"(train logs) {t.get('mean/value_auc_train', float('nan')):.2f}.")
        degenerate = t.get("mean/value_degenerate") or 0
        if degenerate:
            lines.append(f"- **Value model degenerate** in {degenerate:.0%} of the seeds: its "
                         "training labels had one class only (no accepted expansion, or no "
                         "failed one), so V is the constant 0.5 there and `value_tree` is "
                         "best-first on the visit-count re-ranking alone; `value_vs_random` "
                         "says nothing about the value model in those seeds.")
    return "\n".join(lines) + "\n"
