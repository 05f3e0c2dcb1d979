"""Stage `compare` of CoT-FSM: the paper's claims by the house rule, plus McNemar's test.

Claims (arXiv 2510.22437; effects from the secondary note's MATH-500 / GPT-L row, spec §1) at
the largest budget of the grid, paired per (seed, problem): the same test problem, the same
model and the same sampling stream under both arms (`steer_eval`):

    qvalue_vs_default       Q-value steering raises accuracy over no steering
    qvalue_vs_greedy        ... over greedy steering
    qvalue_vs_weighted      ... over weighted steering
    weighted_vs_greedy      weighted >= greedy (the paper's ordering)
    qvalue_fewer_interventions
                            Q-value makes >= 10x fewer interventions than greedy: per problem
                            interventions(qvalue) - interventions(greedy) / 10 < 0

Accuracy claims use the percentile bootstrap over the pooled pairs (`stats.claim`); beside each,
the exact McNemar test on its discordant pairs (b: method right and baseline wrong, c: the
reverse; two-sided binomial p of b out of b + c), the test the spec names. Every budget's
table comes from `steer_eval`'s details.

    python -m stages cotfsm compare
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io, stats

# name -> (method, baseline, column, direction, Config field of the paper's effect, text)
CLAIMS: dict[str, tuple[str, str, str, int, str | None, str]] = {
    "qvalue_vs_default": ("qvalue", "default", "correct", +1, "paper_gain_vs_default",
                          "Q-value steering raises accuracy over the unsteered model"),
    "qvalue_vs_greedy": ("qvalue", "greedy", "correct", +1, "paper_gain_vs_greedy",
                         "Q-value steering beats greedy steering"),
    "qvalue_vs_weighted": ("qvalue", "weighted", "correct", +1, "paper_gain_vs_weighted",
                           "Q-value steering beats weighted steering"),
    "weighted_vs_greedy": ("weighted", "greedy", "correct", +1, "paper_weighted_vs_greedy",
                           "weighted steering beats greedy steering"),
    "qvalue_fewer_interventions": ("qvalue", "greedy", "interventions", -1, None,
                                   "Q-value steering makes >= 10x fewer interventions than "
                                   "greedy (qvalue - greedy / 10 < 0 per problem)"),
}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    results: str = Field("cotfsm_results", description="paths key of steer_eval's folder")
    report: str = Field("cotfsm_report", description="paths key of the report folder")
    paper_gain_vs_default: float | None = Field(None, ge=-1, le=1)
    paper_gain_vs_greedy: float | None = Field(None, ge=-1, le=1)
    paper_gain_vs_weighted: float | None = Field(None, ge=-1, le=1)
    paper_weighted_vs_greedy: float | None = Field(None, ge=-1, le=1)
    fewer_interventions_factor: float = Field(10.0, gt=1, description="the paper's 'x fewer'")


def mcnemar(method: list[bool], baseline: list[bool]) -> tuple[int, int, float]:
    """Exact McNemar: (b, c, two-sided p) over paired binary outcomes."""
    from scipy.stats import binomtest

    if len(method) != len(baseline):
        raise ValueError(f"McNemar needs paired outcomes: {len(method)} vs {len(baseline)}")
    b = sum(1 for m, o in zip(method, baseline) if m and not o)
    c = sum(1 for m, o in zip(method, baseline) if o and not m)
    return b, c, (float(binomtest(b, b + c, 0.5).pvalue) if b + c else 1.0)


def results_spec() -> Any:
    import polars as pl

    from stages.core.checks import spec_from_schema

    return spec_from_schema({"seed": pl.Int64, "arm": pl.String, "budget": pl.Int64,
                             "problem": pl.String, "correct": pl.Boolean,
                             "interventions": pl.Int64, "nfe": pl.Int64},
                            interventions={"min": 0}, nfe={"min": 0})


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked

    frame = read_parquet_checked(ctx.path(cfg.results) / "results.parquet", results_spec())
    budget = int(frame["budget"].max())
    at = frame.filter(pl.col("budget") == budget).sort(["seed", "problem"])
    m: dict[str, float] = {"claim_budget": float(budget)}
    for name, (method, base, col, direction, field, _) in CLAIMS.items():
        mine = at.filter(pl.col("arm") == method)
        other = at.filter(pl.col("arm") == base)
        if mine.height == 0 or other.height == 0:
            continue
        if mine.select("seed", "problem").rows() != other.select("seed", "problem").rows():
            raise ValueError(f"claim {name}: {method} and {base} ran on different "
                             f"(seed, problem) pairs")
        if col == "correct":
            a = [float(v) for v in mine["correct"]]
            b = [float(v) for v in other["correct"]]
            bb, cc, p = mcnemar(mine["correct"].to_list(), other["correct"].to_list())
            m |= {f"mcnemar/{name}/b": float(bb), f"mcnemar/{name}/c": float(cc),
                  f"mcnemar/{name}/p": p}
        else:
            a = [float(v) for v in mine[col]]
            b = [float(v) / cfg.fewer_interventions_factor for v in other[col]]
        paper = getattr(cfg, field) if field else None
        got = stats.claim(a, b, direction=direction, paper_effect=paper, method_ci="bootstrap")
        m |= stats.claim_metrics(got, f"claim/{name}")
    details = ctx.stage_metrics("steer_eval")
    with io.atomic_path(ctx.path(cfg.report), is_dir=True) as tmp:
        io.write_text(tmp / "table.md", results_table({"steer_eval": details, "compare": m}))
    return m


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README tables from steer_eval's and compare's details (and fit_fsm's, when present)."""
    s, c = metrics.get("steer_eval", {}), metrics.get("compare", {})
    budgets = sorted({int(k.split("/")[1][1:]) for k in s if k.endswith("/acc_mean")})
    arms = [a for a in ("default", "greedy", "weighted", "qvalue")
            if any(k.startswith(f"{a}/") for k in s)]
    if not budgets:
        return "_No results yet: run the pipeline._\n"
    lines: list[str] = []
    f = metrics.get("fit_fsm", {})
    seeds = sorted({k.split("/")[0] for k in f if k.endswith("/layer")})
    if seeds:
        cells = []
        for sd in seeds:
            layer = int(f[f"{sd}/layer"])
            cells.append(f"{sd}: layer {layer}, g_curr {f[f'{sd}/L{layer}/probe_curr_acc']:.2f}, "
                         f"g_next {f[f'{sd}/L{layer}/probe_next_acc']:.2f}, unsteered fit "
                         f"accuracy {f[f'{sd}/fit/acc']:.3f}")
        lines += ["Offline fit (val accuracy of the probes against the noisy labels): "
                  + "; ".join(cells) + ".", ""]
    lines += ["Accuracy (mean ± std over training seeds) / interventions per problem / decoded "
              "tokens per problem (nfe), per budget (nfe a problem may decode):", "",
              "| arm | " + " | ".join(f"B = {b}" for b in budgets) + " |",
              "|---|" + "---|" * len(budgets)]
    for arm in arms:
        cells = []
        for b in budgets:
            k = f"{arm}/B{b}"
            cells.append(f"{s[f'{k}/acc_mean']:.3f} ± {s[f'{k}/acc_std']:.3f} / "
                         f"{s[f'{k}/interventions_mean']:.2f} / {s[f'{k}/nfe_mean']:.0f}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines.append("")
    claims = []
    for name, spec in CLAIMS.items():
        got = stats.read_claim(c, f"claim/{name}")
        if got is None:
            continue
        extra = ""
        if f"mcnemar/{name}/p" in c:
            extra = (f"; McNemar b = {c[f'mcnemar/{name}/b']:.0f}, c = "
                     f"{c[f'mcnemar/{name}/c']:.0f}, p = {c[f'mcnemar/{name}/p']:.3g}")
        claims.append(f"- {spec[5]}: {got.sentence()}{extra}")
    if claims:
        lines += [f"Claims at B = {c.get('claim_budget', float('nan')):.0f}, by the house rule "
                  "(paired 95% bootstrap CI of method - baseline over (seed, problem) pairs: "
                  "reproduced when it excludes 0 in the paper's direction, contradicted when it "
                  "excludes 0 the other way, else inconclusive; MDE = the "
                  "smallest true difference these pairs detect with 80% power):", ""] + claims
        lines.append("")
    return "\n".join(lines)


def headline(metrics: dict[str, float]) -> dict[str, float]:
    return stats.verdict_counts(metrics)
