"""Stage `compare` of EDCO: curricula side by side at equal budget, and the estimator's check.

Reads `<runs>/<arm>/curve.parquet` (held-out accuracy after every round, one curve per seed) and
`budget.json` of every SFT arm (`stages.edco.sft`) and RL arm (`stages.edco.rl`),
and `<estimator>/summary.json` of `entropy_estimate`. Refuses arms whose budgets differ (SFT:
rounds, N, batch size, steps per round, optimiser settings, pool size; RL: rounds, N, GRPO
iterations and batch shape), naming the arm and the key: a comparison at unequal budget is not
one.

Per arm (mean ± population std over seeds): final held-out accuracy, its difference to the
baseline arm in points (paper: EDCO +6.5 over Random, RL on Datacom), accuracy on rows with `*`
(the new operator), the mean accuracy over rounds 1..R (area under the curve), and per round the
selection's share of label-noise rows (spec "noise magnet"; the pool's base rate is printed
next to it) and rows new to the curriculum. Estimator: Spearman rho of each prefix length's
score against the full-answer score, and the wall-time reduction (paper: 83.5%).

Claims (`stages.core.stats.claim`, final held-out accuracy paired by seed, 95% t interval, as
a fraction (0.065 = 6.5 points); +1 reproduced, 0 inconclusive, -1 contradicted, with the
minimum detectable effect): RL, EDCO above Random (paper: +6.5 points, Datacom, arXiv
2601.03725); SFT, EDCO above Random, and the order EDCO >= PPL >= Random (EDCO above the
static perplexity order, which is above Random; the paper gives no SFT baseline numbers).

Outputs: report/ (table.md, acc_by_round.png), plots/acc_by_round.csv, flat metrics.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.core.checks import read_json_checked
from stages.core.config import check_arm, disjoint_arms, unique_arms
from stages.core import io, stats
from stages.core.stats import (Claim, check_budgets, claim_by_key, claim_metrics, mean_std,
                               read_claim)

SFT_BUDGET_KEYS = ("rounds", "top_n", "batch_size", "steps_per_round", "lr", "warmup",
                   "min_lr_ratio", "weight_decay", "pool_size")
RL_BUDGET_KEYS = ("rounds", "top_n", "iterations_per_round", "prompts_per_round",
                  "num_generations", "minibatches", "num_iterations", "max_completion_length",
                  "lr", "pool_size")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sft_arms: list[str] = Field(min_length=1, description="curriculum-SFT stages (<runs>/<arm>)")
    sft_baseline: str = Field("sft_random", description="SFT arm the differences are taken to")
    rl_arms: list[str] = Field(default_factory=list, description="curriculum-RL stages")
    rl_baseline: str | None = Field("rl_random", description="RL arm the differences are "
                                                             "taken to")
    runs: str = Field("runs", description="paths key of the runs folder")
    estimator: str | None = Field("estimator", description="paths key of entropy_estimate's "
                                                           "folder (None: no estimator table)")
    pool: str = Field("edco_pool", description="paths key of the pool (noise base rate)")
    report: str = Field("report", description="paths key of the report folder")
    plot: str = Field("plots/acc_by_round.csv", description="plot CSV, relative to the "
                                                            "pipeline folder")
    sft_method: str = Field("sft_edco", description="the paper's method among `sft_arms`; the "
                                                    "claims test it against `sft_baseline`")
    sft_ppl: str | None = Field("sft_ppl", description="the static perplexity order among "
                                                       "`sft_arms` (claims: EDCO >= PPL >= "
                                                       "the baseline; None: untested)")
    rl_method: str | None = Field("rl_edco", description="the paper's method among `rl_arms`")
    paper_sft_gain: float | None = Field(
        None, ge=-1, le=1, description="the paper's final-accuracy gain of EDCO over the SFT "
                                       "baseline, as a fraction (None: not stated)")
    paper_rl_gain: float | None = Field(
        0.065, ge=-1, le=1, description="the paper's final-accuracy gain of EDCO over the RL "
                                        "baseline, as a fraction (0.065: 6.5 points)")

    @field_validator("sft_arms", "rl_arms")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        return unique_arms(value)

    @model_validator(mode="after")
    def _baselines(self) -> "Config":
        check_arm("sft_baseline", self.sft_baseline, self.sft_arms)
        check_arm("rl_baseline", self.rl_baseline, self.rl_arms)
        check_arm("sft_method", self.sft_method, self.sft_arms, self.sft_baseline)
        check_arm("sft_ppl", self.sft_ppl, self.sft_arms, self.sft_baseline)
        check_arm("rl_method", self.rl_method, self.rl_arms, self.rl_baseline)
        if self.sft_ppl is not None and self.sft_ppl == self.sft_method:
            raise ValueError(f"sft_ppl and sft_method are both {self.sft_ppl!r}")
        disjoint_arms(self.sft_arms, self.rl_arms, "SFT and RL")
        return self


def summarize_arms(frames: dict[str, Any], baseline: str, prefix: str) -> dict[str, float]:
    """arm -> curve frame (seed, round, acc, acc_mul, noisy_frac, ...) -> flat metrics
    `<prefix>/<arm>/...` (module docstring)."""
    import polars as pl

    out: dict[str, float] = {}
    finals: dict[str, list[float]] = {}
    for order, (arm, frame) in enumerate(frames.items()):
        last_round = frame["round"].max()
        final = frame.filter(pl.col("round") == last_round).sort("seed")
        trained = frame.filter(pl.col("round") > 0)
        finals[arm] = final["acc"].to_list()
        p = f"{prefix}/{arm}"
        for key in ("acc", "acc_mul", "acc_plus_minus"):
            out[f"{p}/{key}_mean"], out[f"{p}/{key}_std"] = mean_std(final[key].to_list())
        auc = [float(g["acc"].mean())
               for _, g in trained.group_by("seed", maintain_order=True)]
        out[f"{p}/auc_mean"], out[f"{p}/auc_std"] = mean_std(auc)
        for key in ("noisy_frac", "mul_share", "mean_difficulty", "frac_reward_zero_std"):
            if key in frame.columns:
                out[f"{p}/{key}"] = mean_std(trained[key].to_list())[0]
        for (rnd,), g in trained.group_by("round", maintain_order=True):
            r = int(rnd)
            out[f"{p}/r{r}/acc_mean"], out[f"{p}/r{r}/acc_std"] = mean_std(g["acc"].to_list())
            out[f"{p}/r{r}/noisy_frac"] = mean_std(g["noisy_frac"].to_list())[0]
            out[f"{p}/r{r}/new_items"] = mean_std(g["new_items"].to_list())[0]
            if "mean_score" in g.columns:  # mean entropy (or loss) of the selection
                out[f"{p}/r{r}/mean_score"] = mean_std(g["mean_score"].to_list())[0]
        out[f"{p}/unique_items"] = mean_std(final["unique_items"].to_list())[0]
        out[f"{p}/seeds"] = float(final.height)
        out[f"{p}/order"] = float(order)
    base = mean_std(finals[baseline])[0]
    for arm, accs in finals.items():
        out[f"{prefix}/{arm}/delta_vs_{baseline}"] = mean_std(accs)[0] - base
    start = [float(f.filter(pl.col("round") == 0.0)["acc"][0]) for f in frames.values()]
    out[f"{prefix}/initial_acc"] = mean_std(start)[0]
    return out


def final_by_seed(frame: Any) -> dict[int, float]:
    """seed -> held-out accuracy after the last round of an arm's curve."""
    final = frame.filter(frame["round"] == frame["round"].max())
    return dict(zip((int(s) for s in final["seed"]), final["acc"].to_list()))


def accuracy_claims(finals: dict[str, dict[int, float]], pairs: list[tuple[str, str]],
                    prefix: str, paper: dict[tuple[str, str], float | None] | None = None
                    ) -> dict[str, float]:
    """For each (method, baseline) in `pairs`: final accuracy higher, paired by seed, as a
    fraction; `paper` gives the paper's effect of a pair, if any. finals: arm -> seed -> acc."""
    out: dict[str, float] = {}
    for method, baseline in pairs:
        c = claim_by_key(finals[method], finals[baseline], direction=1,
                         paper_effect=(paper or {}).get((method, baseline)))
        out.update(claim_metrics(c, f"claim/{prefix}/acc/{method}_vs_{baseline}"))
    return out


def _load_arm(folder: Path, arm: str) -> tuple[Any, dict[str, Any]]:

    if not (folder / "curve.parquet").is_file() or not (folder / "budget.json").is_file():
        raise FileNotFoundError(f"{folder}: no curve.parquet/budget.json; run stage {arm!r}")
    from stages.core.checks import ColumnSpec, FrameSpec, read_parquet_checked

    frame = read_parquet_checked(folder / "curve.parquet", FrameSpec({
        "seed": ColumnSpec(min=0), "round": ColumnSpec(min=0),
        "acc": ColumnSpec(min=0.0, max=1.0),
        # NaN at round 0: nothing selected yet
        "noisy_frac": ColumnSpec(min=0.0, max=1.0, nullable=True),
        "new_items": ColumnSpec(min=0, nullable=True)}))
    return frame, read_json_checked(folder / "budget.json")


def _plot(mean_curve: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = mean_curve["kind"].unique(maintain_order=True).to_list()
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        sub = mean_curve.filter(mean_curve["kind"] == kind)
        for (arm,), g in sub.group_by("arm", maintain_order=True):
            g = g.sort("round")
            ax.plot(g["round"], g["acc"], marker="o", label=arm)
            ax.fill_between(g["round"].to_list(), (g["acc"] - g["acc_std"]).to_list(),
                            (g["acc"] + g["acc_std"]).to_list(), alpha=0.15)
        ax.set_xlabel("curriculum round")
        ax.set_ylabel("held-out accuracy (new domain)")
        ax.set_title(f"EDCO {kind}: accuracy after every round (mean ± std over seeds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.edco.pool import read_pool

    runs = ctx.path(cfg.runs)
    metrics: dict[str, float] = {}
    curves = []
    # (method, baseline) of each claim, and the paper's effect where it gives one
    claims = {"sft": [(cfg.sft_method, cfg.sft_baseline)], "rl": []}
    paper = {(cfg.sft_method, cfg.sft_baseline): cfg.paper_sft_gain}
    if cfg.sft_ppl is not None:
        claims["sft"] += [(cfg.sft_method, cfg.sft_ppl), (cfg.sft_ppl, cfg.sft_baseline)]
    if cfg.rl_method is not None and cfg.rl_arms:
        claims["rl"] = [(cfg.rl_method, cfg.rl_baseline)]
        paper[(cfg.rl_method, cfg.rl_baseline)] = cfg.paper_rl_gain
    for kind, arms, keys, baseline in (("sft", cfg.sft_arms, SFT_BUDGET_KEYS, cfg.sft_baseline),
                                       ("rl", cfg.rl_arms, RL_BUDGET_KEYS, cfg.rl_baseline)):
        if not arms:
            continue
        frames, budgets = {}, {}
        for arm in arms:
            frames[arm], budgets[arm] = _load_arm(runs / arm, arm)
        check_budgets(budgets, keys)
        metrics.update(summarize_arms(frames, baseline, kind))
        metrics.update(accuracy_claims({a: final_by_seed(f) for a, f in frames.items()},
                                       claims[kind], kind, paper))
        metrics[f"{kind}/top_n"] = float(budgets[baseline]["top_n"])
        metrics[f"{kind}/rounds"] = float(budgets[baseline]["rounds"])
        for arm, f in frames.items():
            curves.append(f.select("seed", "round", "acc")
                          .with_columns(pl.lit(arm).alias("arm"), pl.lit(kind).alias("kind")))
    pool = read_pool(ctx.path(cfg.pool) / "pool.parquet")
    metrics["pool/noisy_frac"] = float(pool["noisy"].mean())
    metrics["pool/mul_share"] = float(pool["question"].str.contains("*", literal=True).mean())
    metrics["pool/size"] = float(pool.height)
    if cfg.estimator:
        summary = read_json_checked(ctx.path(cfg.estimator) / "summary.json")
        metrics.update({f"estimator/{k}": float(v) for k, v in summary.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
    mean_curve = (pl.concat(curves).group_by(["kind", "arm", "round"], maintain_order=True)
                  .agg(pl.col("acc").mean().alias("acc"),
                       pl.col("acc").std(ddof=0).alias("acc_std"))
                  .sort(["kind", "arm", "round"]))
    with io.atomic_path(ctx.pipeline_dir / cfg.plot) as tmp:
        mean_curve.write_csv(tmp)
    metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
    with io.atomic_path(ctx.path(cfg.report), is_dir=True) as tmp:
        _plot(mean_curve, tmp / "acc_by_round.png")
        (tmp / "table.md").write_text(results_table({"compare": metrics}))
    return metrics


# --- README table ------------------------------------------------------------------------------

def _cell(m: dict[str, Any], key: str, fmt: str = ".3f") -> str:
    mean, std = m.get(f"{key}_mean"), m.get(f"{key}_std")
    if mean is None:
        return "n/a"
    return f"{mean:{fmt}} ± {std:{fmt}}" if std is not None else f"{mean:{fmt}}"


def _num(value: Any, fmt: str) -> str:
    return "n/a" if value is None else f"{value:{fmt}}"


def _arms(m: dict[str, Any], prefix: str) -> list[str]:
    arms = {k.split("/")[1] for k in m if k.startswith(f"{prefix}/") and k.endswith("/acc_mean")
            and k.count("/") == 2}
    return sorted(arms, key=lambda a: m.get(f"{prefix}/{a}/order", 0.0))


def _sub(m: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) + 1:]: v for k, v in m.items() if k.startswith(prefix + "/")}


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README tables from the compare stage's metrics: nothing typed by hand."""
    m = metrics.get("compare", {})
    if not _arms(m, "sft"):
        return "_No results yet: run the pipeline._\n"
    lines: list[str] = []
    for kind, title in (("sft", "Curriculum SFT"), ("rl", "Curriculum RL (GRPO)")):
        arms = _arms(m, kind)
        if not arms:
            continue
        base = next((k.rsplit("_vs_", 1)[1] for k in m if k.startswith(f"{kind}/")
                     and "/delta_vs_" in k), "?")
        rounds = int(m.get(f"{kind}/rounds", 0))
        lines += [f"{title}: R = {rounds} rounds of N = {m.get(f'{kind}/top_n', 0):.0f}, held-out"
                  f" accuracy before training {m.get(f'{kind}/initial_acc', math.nan):.3f} "
                  f"(mean ± std over seeds; Δ in points vs {base}):", "",
                  "| arm | final accuracy | Δ vs " + base + " | accuracy on `*` rows "
                  "| mean accuracy over rounds | noisy share selected | `*` share selected "
                  "| rows ever selected |" + (" groups with zero reward variance |"
                                              if kind == "rl" else "") + " seeds |",
                  "|---|---|---|---|---|---|---|---|" + ("---|" if kind == "rl" else "") + "---|"]
        for a in arms:
            s = _sub(m, f"{kind}/{a}")
            delta = s.get(f"delta_vs_{base}")
            lines.append(
                f"| {a} | {_cell(s, 'acc')} | {_num(None if delta is None else 100 * delta, '+.1f')} "
                f"| {_cell(s, 'acc_mul')} | {_cell(s, 'auc')} "
                f"| {_num(s.get('noisy_frac'), '.1%')} | {_num(s.get('mul_share'), '.1%')} "
                f"| {_num(s.get('unique_items'), '.0f')} "
                + (f"| {_num(s.get('frac_reward_zero_std'), '.0%')} " if kind == "rl" else "")
                + f"| {_num(s.get('seeds'), '.0f')} |")
        lines += ["", f"{title}, per round: accuracy (mean over seeds) / noisy share of the "
                  f"selection (pool base rate {m.get('pool/noisy_frac', math.nan):.1%}) / rows "
                  f"new to the curriculum:", "",
                  "| arm | " + " | ".join(f"round {r}" for r in range(1, rounds + 1)) + " |",
                  "|---|" + "---|" * rounds]
        for a in arms:
            s = _sub(m, f"{kind}/{a}")
            cells = [f"{s[f'r{r}/acc_mean']:.3f} / {s[f'r{r}/noisy_frac']:.1%} / "
                     f"{s[f'r{r}/new_items']:.0f}"
                     if f"r{r}/acc_mean" in s else "n/a" for r in range(1, rounds + 1)]
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        lines.append("")
    lengths = sorted({int(k.split("/")[1][1:]) for k in m if k.startswith("estimator/L")})
    if lengths:
        # Cost as tokens decoded (deterministic): wall times are measurements of the machine,
        # kept in MLflow (stage entropy_estimate) and benchmarks/RESULTS.md, not in this table.
        lines += ["Entropy estimator on the pool under the base model: prefix of L tokens vs "
                  f"the full answer (mean {m.get('estimator/full_mean_tokens', math.nan):.1f} "
                  "tokens per item); cost = tokens decoded, the paper's 83.5% less time "
                  "measured as the share of decoded tokens saved (wall times: MLflow, stage "
                  "`entropy_estimate`; `benchmarks/edco_estimator.py`):", "",
                  "| L | Spearman rho vs full (top-20%) | Spearman rho (mean aggregation) "
                  "| tokens / item | token reduction |", "|---|---|---|---|---|"]
        for L in lengths:
            s = _sub(m, f"estimator/L{L}")
            rho = s.get("spearman")
            rho_mean = s.get("spearman_mean", s.get("spearman_top_frac"))
            lines.append(f"| {L} | {_num(rho, '+.3f')} | {_num(rho_mean, '+.3f')} "
                         f"| {_num(s.get('mean_tokens'), '.1f')} "
                         f"| {_num(s.get('token_reduction'), '.1%')} |")
        extra = [(label, m.get(f"estimator/{key}")) for label, key in (
            ("wrong answers minus right ones", "entropy_wrong_minus_rest"),
            ("rows with `*` minus the rest", "entropy_mul_minus_rest"),
            ("noisy rows minus clean ones", "entropy_noisy_minus_rest"))]
        extra = [(label, v) for label, v in extra if v is not None]
        if extra:
            lines += ["", "Full-answer entropy (bits, top-20% aggregation), differences of "
                      "means: " + "; ".join(f"{label} {v:+.3f}" for label, v in extra) + "."]
    return "\n".join(lines + claims_table(m)).rstrip() + "\n"


def claims_table(m: dict[str, Any]) -> list[str]:
    """README lines: every claim in `m` (claim/<sft|rl>/acc/<a>_vs_<b>) with its verdict
    sentence (`Claim.sentence`), SFT first."""
    prefixes = [k[:-len("/verdict")] for k in m if k.startswith("claim/")
                and k.endswith("/verdict")]
    prefixes.sort(key=lambda p: (p.split("/")[1] != "sft", p))
    if not prefixes:
        return []
    lines = ["", "Claims, final held-out accuracy paired by seed (difference method - baseline "
             "as a fraction, with its 95% t interval; MDE: the smallest true difference these "
             "seeds would detect with 80% power):", "", "| claim | verdict |", "|---|---|"]
    for prefix in prefixes:
        parts = prefix.split("/")
        a, _, b = parts[-1].partition("_vs_")
        c: Claim | None = read_claim(m, prefix)
        lines.append(f"| {'SFT' if parts[1] == 'sft' else 'RL'}: {a} above {b} "
                     f"| {c.sentence() if c else 'n/a'} |")
    return lines


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many claims are reproduced / inconclusive / contradicted; each claim and
    every arm's numbers in details/compare.json."""
    return stats.verdict_counts(metrics)
