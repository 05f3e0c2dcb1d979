"""Stage `compare` of the BIS pipeline (arXiv 2602.04145): every subset's PRM side by side, mean
and std over seeds.

Per arm (mean ± population std over training seeds; a random arm also redraws its subset per
seed): test step F1 and best-of-N accuracy (`evaluate`), training steps (the single-pass budget,
so they scale with rho), and the steps it takes to reach the full-data PRM's final validation F1
(from the validation curve logged during training; a seed that never reaches it is counted in
`reached_frac`, not averaged in).

The paper's claims (`claims` in params.yaml: an arm against another on a metric, with the
paper's effect from its Table 1 / ablation tables) go through the house claim rule
(`stats.claim`): the difference of the two arms' values paired over training seeds (the same
seed on both sides), its t interval (few pairs), the verdict and the minimum detectable effect,
as `claim/<method>_vs_<baseline>/<metric>/*`. E.g. BIS-10% vs full data (paper: +0.34 F1
points) and BIS-10% vs Random-10% (paper: +2.6 points, "a relative 4.1%").

Outputs: `report/table.md`, `report/val_f1_curves.png`, `plots/val_f1.csv` (mean validation F1
per arm and step, for `dvc plots`) and the flat metrics for DVC and the README table.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Sequence

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core.checks import read_json_checked
from stages.core import io, stats

METRICS = {"f1": "test step F1", "best_of_n": "best-of-N accuracy"}


class PaperClaim(BaseModel):
    """One claim of the paper: arm `method` scores higher than arm `baseline` on `metric`."""

    model_config = ConfigDict(extra="forbid")

    method: str = Field(..., description="the arm the paper says is better (an arm of select)")
    baseline: str = Field(..., description="the arm it is compared with (an arm of select)")
    metric: Literal["f1", "best_of_n"] = Field("f1", description="test step F1 or best-of-N "
                                               "accuracy (`evaluate`)")
    paper_effect: float | None = Field(..., ge=-1, le=1, description="the paper's method minus "
                                       "baseline, signed, in this metric's units (a fraction: "
                                       "1 point = 0.01); null when it gives no single number")

    @property
    def prefix(self) -> str:
        return f"claim/{self.method}_vs_{self.baseline}/{self.metric}"


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    subsets: str = Field("subsets", description="paths key of the select output (arms.json)")
    prms: str = Field("prms", description="paths key of the train_prm output (curves)")
    evaluation: str = Field("prm_eval", description="paths key of the evaluate output")
    full_arm: str = Field("full", description="the full-data arm (the reference)")
    report: str = Field("report", description="paths key of the report folder")
    plot: str = Field("plots/val_f1.csv", description="plot CSV, relative to the pipeline folder")
    claims: list[PaperClaim] = Field(default_factory=list, description="the paper's claims tested "
                                     "here, each paired over training seeds")

    @model_validator(mode="after")
    def _distinct(self) -> "Config":
        prefixes = [c.prefix for c in self.claims]
        if len(set(prefixes)) != len(prefixes):
            raise ValueError(f"claims repeat a (method, baseline, metric): {prefixes}")
        return self


def steps_to_reach(curve: list[tuple[int, float]], level: float) -> int | None:
    """First training step whose validation F1 is >= level (None: never)."""
    for step, value in sorted(curve):
        if value >= level:
            return step
    return None


def paper_claims(claims: Sequence[PaperClaim], evaluation: pl.DataFrame) -> dict[str, float]:
    """Each claim by the house rule: method's minus baseline's value, paired over the training
    seeds both arms ran (t interval over seeds)."""
    m: dict[str, float] = {}
    arms = set(evaluation["arm"].to_list())
    for c in claims:
        missing = [a for a in (c.method, c.baseline) if a not in arms]
        if missing:
            raise ValueError(f"compare.claims: {c.prefix} names arm(s) {missing} that were not "
                             f"evaluated (arms: {sorted(arms)})")
        method, baseline = (dict(evaluation.filter(pl.col("arm") == a)
                                 .select("seed", c.metric).iter_rows())
                            for a in (c.method, c.baseline))
        try:
            claim = stats.claim_by_key(method, baseline, direction=1,
                                       paper_effect=c.paper_effect)
        except ValueError as err:
            raise ValueError(f"compare.claims: {c.prefix} ({c.method} vs {c.baseline}): "
                             f"{err}") from None
        m |= stats.claim_metrics(claim, c.prefix)
    return m


def summarize(arms: list[dict[str, Any]], evaluation: pl.DataFrame, curves: pl.DataFrame,
              full_arm: str, claims: Sequence[PaperClaim] = ()) -> dict[str, float]:
    """Flat metrics `<arm>/<name>` for every arm, plus the paper's claims (`paper_claims`)."""
    names = [a["name"] for a in arms]
    if full_arm not in names:
        raise ValueError(f"full_arm {full_arm!r} is not an arm of select: {names}")
    finals = curves.sort(["arm", "seed", "step"]).group_by(["arm", "seed"],
                                                           maintain_order=True).last()
    full_level = float(finals.filter(pl.col("arm") == full_arm)["val_f1"].mean())
    m: dict[str, float] = {"full_val_f1": full_level}
    for arm in names:
        ev = evaluation.filter(pl.col("arm") == arm)
        if ev.is_empty():
            raise ValueError(f"arm {arm!r} has no evaluation rows: was it trained?")
        for key in ("f1", "f1_wrong", "best_of_n"):
            m[f"{arm}/{key}_mean"], m[f"{arm}/{key}_std"] = stats.mean_std(ev[key].to_list())
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
        m[f"{arm}/steps_to_full_mean"] = stats.mean_std(reach)[0]
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
    return m | paper_claims(claims, evaluation)


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


def input_spec(table: Literal["evaluation", "curves"]) -> Any:
    """What run() reads: `evaluation` (stage evaluate: per arm and seed the test F1s and
    best-of-N accuracy) or `curves` (train_prm: validation F1 per training step)."""
    from stages.core.checks import ColumnSpec, FrameSpec

    share = ColumnSpec(dtype=pl.Float64, min=0.0, max=1.0)  # an F1 or an accuracy, never NaN
    key = {"arm": ColumnSpec(dtype=pl.String), "seed": ColumnSpec(dtype=pl.Int64)}
    if table == "evaluation":
        return FrameSpec({**key, "val_f1": share, "f1": share, "f1_wrong": share,
                          "best_of_n": share})
    return FrameSpec({**key, "step": ColumnSpec(dtype=pl.Int64, min=0), "val_f1": share})


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    arms = read_json_checked(ctx.path(cfg.subsets) / "arms.json", kind=list)
    from stages.core.checks import read_parquet_checked

    evaluation = read_parquet_checked(ctx.path(cfg.evaluation) / "evaluation.parquet",
                                      input_spec("evaluation"))
    curves = read_parquet_checked(ctx.path(cfg.prms) / "curves.parquet", input_spec("curves"))
    m = summarize(arms, evaluation, curves, cfg.full_arm, cfg.claims)
    refs = read_json_checked(ctx.path(cfg.evaluation) / "references.json")
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
    claimed = claim_lines(m)
    return lines + (["", *claimed] if claimed else [])


def claim_lines(m: dict[str, Any]) -> list[str]:
    """The paper's claims found in a compare-metrics dict, one sentence each."""
    prefixes = sorted(k.removesuffix("/verdict") for k in m
                      if k.startswith("claim/") and k.endswith("/verdict"))
    if not prefixes:
        return []
    lines = ["The paper's claims, method minus baseline paired over training seeds, mean [95% t "
             "interval], verdict by the house rule (paper's effect in the same units):", ""]
    for prefix in prefixes:
        pair, metric = prefix.removeprefix("claim/").rsplit("/", 1)
        method, baseline = pair.split("_vs_", 1)
        c = stats.read_claim(m, prefix)
        assert c is not None
        lines.append(f"- {method} above {baseline}, {METRICS.get(metric, metric)}: "
                     f"{c.sentence()}")
    return lines


def _corpus(wrong: float, mc_negative: float, mixed: float, mc_mixed: float,
            agreement: float) -> str:
    return (f"PRM corpus: {wrong:.1%} of steps wrong (exact verifier), {mc_negative:.1%} negative "
            f"by MC label; {mixed:.1%} of rollouts mixed (exact), {mc_mixed:.1%} by MC label; MC "
            f"label agreement {agreement:.1%} (paper's corpus: 3.6% wrong steps, 7.7% mixed "
            f"rollouts).")


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README tables from the compare stage's metrics: arms as rows, nothing typed by hand.

    A second regime's metrics (`details/regime_*.json`: a compare dict plus `corpus/*`, `regime/*`
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
        if not claim_lines(r):
            lines += ["", "The paper's claims are not tested in this regime: the paired test "
                          "needs each seed's values, which its record does not keep."]
    return "\n".join(lines) + "\n"


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many claims are reproduced / inconclusive / contradicted; each claim and
    every arm's numbers in details/compare.json."""
    return stats.verdict_counts(metrics)
