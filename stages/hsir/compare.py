"""Stage `compare` of HSIR: the self-improvement arms and the RL arms side by side.

Self-training arms (`stages.hsir.self_improve`, `<runs>/<arm>/curve.parquet`, one row per seed
and round): final-round greedy accuracy on held-out prompts of the training distribution and on
the hard split, generated tokens per solved query (mean ± population std over seeds), each
relative to STaR as (a - b) / b (paper: up to +10.9% accuracy, up to -42.4% inference overhead);
the training pool's share of hard queries (spec: VeriExit raises it), its mean re-verification
steps, and the share of VeriExit rows that are the true derivation (`faithful_rate`).

RL arms (`stages.hsir.rl` on the shared GRPO engine: GRPO, H-GRPO, GRPO + length penalty): their saved curve has no
hard split and no tokens per solved query, so each seed's final policy is evaluated here with
the same greedy pass as the self-training arms, then compared with plain GRPO.

InDiv validation (spec §4): seed-format traces (concise + 2-4 injected re-verification steps) of
held-out prompts are scored with each InDiv formula under the seed model; Spearman(InDiv,
injected repetition count) should be strongly negative. The eigenscore also falls with the
number of steps, so the within-difficulty correlation (same number of derivation steps) is
reported too.

Claims (`stages.core.stats.claim`, paired by seed, 95% t interval; +1 reproduced, 0
inconclusive, -1 contradicted, with the minimum detectable effect), final round:
- HSIR vs STaR: held-out accuracy higher, relative to STaR's mean (paper: up to +10.9%), hard-split
  accuracy higher (spec §4, in accuracy points: the paper gives no hard-split number), tokens per
  solved query fewer, relative (paper: up to -42.4% inference overhead);
- VeriExit vs STaR: a larger share of hard queries in the training pools (mean over rounds);
- H-GRPO vs GRPO: accuracy higher and tokens per solved query fewer, relative to GRPO (the
  paper's reviewers: small accuracy gains, shorter outputs; no number);
- InDiv: Spearman(InDiv, injected repeats) below 0, with a percentile bootstrap CI over the
  traces (`claim_from_ci`).

Refuses arms whose budgets differ (self-training: rounds, K, SFT steps per round, batch size,
...; RL: `GRPOParams.budget`), naming the arm and the key.
Outputs: report/ (table.md, rounds.png, indiv.png), plots/rounds.csv, flat metrics.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.core.checks import read_json_checked
from stages.core.config import check_arm, disjoint_arms, unique_arms
from stages.core import io, stats
from stages.core.stats import (Claim, check_budgets, claim_by_key, claim_from_ci, claim_metrics,
                               mean_std, percentile_ci, read_claim, spearman)

SELF_BUDGET_KEYS = ("rounds", "samples_per_query", "sft_steps_per_round", "batch_size",
                    "max_new_tokens", "temperature", "lr", "train_queries")
# What must be equal across the RL arms (the keys of `stages.train.grpo.GRPOParams.budget`).
RL_BUDGET_KEYS = ("rounds", "prompts_per_round", "num_generations", "minibatches",
                  "num_iterations", "max_completion_length")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str] = Field(min_length=1, description="self-training stages (<runs>/<arm>)")
    baseline: str = Field("star", description="self-training arm the changes are relative to")
    rl_arms: list[str] = Field(default_factory=list, description="GRPO stages (<runs>/<arm>)")
    rl_baseline: str | None = Field("grpo", description="RL arm the RL changes are relative to")
    family: Literal["arith"] = Field("arith", description="task family of the prompts")
    runs: str = Field("runs", description="paths key of the runs folder")
    prompts: str = Field("hsir_prompts", description="paths key of the training prompts")
    hard_prompts: str = Field("hard_prompts", description="paths key of the hard split")
    seed_model: str = Field("seed_model", description="paths key of the seed model (InDiv "
                                                      "validation)")
    report: str = Field("report", description="paths key of the report folder")
    plot: str = Field("plots/rounds.csv", description="plot CSV, relative to the pipeline folder")
    eval_rows: int | None = Field(200, ge=1, description="held-out prompts per split for the RL "
                                                         "arms (match the self-training arms)")
    max_new_tokens: int = Field(128, ge=1, le=32768, description="generation budget, tokens")
    eval_batch_size: int = Field(256, ge=1, le=65536, description="sequences decoded together")
    indiv_rows: int = Field(200, ge=2, description="seed-format traces scored for validation")
    indiv_layer: int | Literal["middle"] = Field(-1, description="hidden layer InDiv reads")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: all cores)")
    method: str = Field("hsir", description="the paper's full method among `arms`; the claims "
                                            "test it against `baseline`, paired by seed")
    veriexit_arm: str | None = Field("veriexit", description="the VeriExit-only arm (claim: more "
                                                             "hard queries in its pools than "
                                                             "the baseline's; None: untested)")
    rl_method: str | None = Field("h_grpo", description="H-GRPO among `rl_arms` (claims vs "
                                                        "`rl_baseline`)")
    paper_acc_gain: float | None = Field(
        0.109, ge=-1, description="the paper's held-out accuracy gain of the method over STaR, "
                                  "relative to STaR ((m - b) / b; None: not stated)")
    paper_tokens_change: float | None = Field(
        -0.424, ge=-1, description="the paper's change in generated tokens (inference "
                                   "overhead) vs STaR, relative (None: not stated)")
    indiv_ci_draws: int = Field(1000, ge=100, le=100_000, description="bootstrap resamples of "
                                                                      "the traces for the CI of "
                                                                      "the InDiv Spearman")

    @field_validator("arms", "rl_arms")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        return unique_arms(value)

    @model_validator(mode="after")
    def _baselines(self) -> "Config":
        check_arm("baseline", self.baseline, self.arms)
        check_arm("rl_baseline", self.rl_baseline, self.rl_arms)
        check_arm("method", self.method, self.arms, self.baseline)
        check_arm("veriexit_arm", self.veriexit_arm, self.arms, self.baseline)
        check_arm("rl_method", self.rl_method, self.rl_arms, self.rl_baseline)
        disjoint_arms(self.arms, self.rl_arms, "self-training and RL")
        return self


# --- pure pieces -----------------------------------------------------------------------------

def relative(a: float, b: float) -> float:
    """(a - b) / b; NaN when b is 0 or either is NaN."""
    return (a - b) / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def summarize_arms(finals: dict[str, dict[str, list[float]]], baseline: str,
                   prefix: str) -> dict[str, float]:
    """arm -> metric -> per-seed values  ->  `<prefix>/<arm>/<metric>_mean|_std` and the change
    vs the baseline arm `<prefix>/<arm>/<metric>_vs_<baseline>` for acc, hard_acc and
    tokens_per_solved."""
    out: dict[str, float] = {}
    base = {k: mean_std(v)[0] for k, v in finals[baseline].items()}
    for arm, values in finals.items():
        for key, per_seed in values.items():
            m, s = mean_std(per_seed)
            out[f"{prefix}/{arm}/{key}_mean"], out[f"{prefix}/{arm}/{key}_std"] = m, s
        for key in ("acc", "hard_acc", "tokens_per_solved"):
            out[f"{prefix}/{arm}/{key}_vs_{baseline}"] = relative(mean_std(values[key])[0],
                                                                  base[key])
        out[f"{prefix}/{arm}/seeds"] = float(len(values["acc"]))
        out[f"{prefix}/{arm}/order"] = float(list(finals).index(arm))  # table row order
    return out


def seed_finals(frame: Any, keys: tuple[str, ...]) -> dict[str, dict[int, float]]:
    """metric -> seed -> value at the last round of a self-training arm's curve."""
    last = frame.filter(frame["round"] == frame["round"].max())
    return {k: dict(zip((int(s) for s in last["seed"]), last[k].to_list())) for k in keys}


def seed_pool_hard_share(frame: Any) -> dict[int, float]:
    """seed -> the pools' share of hard queries, mean over rounds >= 1."""
    trained = frame.filter(frame["round"] > 0)
    return {int(seed): mean_std(g["pool_hard_share"].to_list())[0]
            for (seed,), g in trained.group_by("seed", maintain_order=True)}


def arm_claims(per_seed: dict[str, dict[str, dict[int, float]]], method: str, baseline: str,
               prefix: str, paper_acc_gain: float | None = None,
               paper_tokens_change: float | None = None, hard: bool = True
               ) -> dict[str, float]:
    """`method` vs `baseline` paired by seed (module docstring): accuracy higher and tokens per
    solved query fewer, both relative to the baseline's mean; hard-split accuracy higher, in
    points (`hard`). per_seed: arm -> metric -> seed -> value."""
    m, b = per_seed[method], per_seed[baseline]
    pair = f"{method}_vs_{baseline}"
    out = claim_metrics(claim_by_key(m["acc"], b["acc"], direction=1,
                                     paper_effect=paper_acc_gain, relative=True),
                        f"claim/{prefix}/acc/{pair}")
    if hard:
        out.update(claim_metrics(claim_by_key(m["hard_acc"], b["hard_acc"], direction=1),
                                 f"claim/{prefix}/hard_acc/{pair}"))
    out.update(claim_metrics(claim_by_key(m["tokens_per_solved"], b["tokens_per_solved"],
                                          direction=-1, paper_effect=paper_tokens_change,
                                          relative=True),
                             f"claim/{prefix}/tokens_per_solved/{pair}"))
    return out


def pool_claim(shares: dict[str, dict[int, float]], arm: str, baseline: str) -> dict[str, float]:
    """`arm`'s pools hold a larger share of hard queries than `baseline`'s, paired by seed."""
    return claim_metrics(claim_by_key(shares[arm], shares[baseline], direction=1),
                         f"claim/self/pool_hard_share/{arm}_vs_{baseline}")


def spearman_claim(x: list[float], y: list[float], draws: int, seed: int) -> Claim:
    """Spearman(x, y) below 0, with the percentile bootstrap CI over the (x, y) pairs."""
    rho = spearman(x, y)
    low, high = percentile_ci(len(x), lambda idx: spearman([x[i] for i in idx],
                                                           [y[i] for i in idx]), draws, seed)
    return claim_from_ci(rho, low, high, n=len(x), direction=-1)


def pool_summary(frame: Any) -> dict[str, float]:
    """Training-pool statistics of one arm over every round >= 1 and seed."""
    trained = frame.filter(frame["round"] > 0)
    veri = float(trained["pool_veriexit_rows"].sum())
    return {"pool_hard_share": mean_std(trained["pool_hard_share"].to_list())[0],
            "pool_size": mean_std(trained["pool_size"].to_list())[0],
            # the share of hard training queries that gained a correct sample in a round's pool
            "pool_hard_coverage": (mean_std(trained["pool_hard_coverage"].to_list())[0]
                                   if "pool_hard_coverage" in trained.columns else math.nan),
            "pool_mean_repeats": mean_std(trained["pool_mean_repeats"].to_list())[0],
            "veriexit_rows": veri / max(1, len(trained)),
            "faithful_rate": (float(trained["pool_veriexit_faithful"].sum()) / veri
                              if veri else math.nan)}


# --- the stage -------------------------------------------------------------------------------

def curve_spec(kind: str) -> Any:
    """What run() reads from an arm's curve.parquet. Self-training (`self`): per seed and round
    the accuracies (never NaN) and the pool statistics (null on round 0, before any pool; tokens
    per solved query NaN when nothing is solved). RL (`rl`): the seeds only (its policies are
    evaluated here)."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    cols = {"seed": ColumnSpec(dtype=pl.Int64)}
    if kind == "self":
        share = ColumnSpec(dtype=pl.Float64, min=0.0, max=1.0)
        maybe = ColumnSpec(dtype=pl.Float64, nullable=True)
        cols |= {"round": ColumnSpec(dtype=pl.Float64, min=0), "acc": share, "hard_acc": share,
                 **{k: maybe for k in ("tokens_per_solved", "verbose_share", "pool_hard_share",
                                       "pool_size", "pool_mean_repeats", "pool_veriexit_rows",
                                       "pool_veriexit_faithful")}}
    return FrameSpec(cols)


def _load_arm(folder: Path, arm: str, kind: str = "self") -> tuple[Any, dict[str, Any]]:
    from stages.core.checks import read_parquet_checked

    if not (folder / "budget.json").is_file():
        raise FileNotFoundError(f"{folder}: no budget.json; run stage {arm!r}")
    return (read_parquet_checked(folder / "curve.parquet", curve_spec(kind)),
            read_json_checked(folder / "budget.json"))


def _plot_rounds(mean_curve: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ("acc", "hard_acc", "tokens_per_solved"),
                              ("held-out accuracy", "hard-split accuracy",
                               "tokens per solved query")):
        for (arm,), g in mean_curve.group_by("arm", maintain_order=True):
            g = g.sort("round")
            ax.plot(g["round"], g[key], marker="o", label=arm)
        ax.set_xlabel("round")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_indiv(scores: dict[str, list[float]], repeats: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scores), figsize=(5 * len(scores), 4), squeeze=False)
    for ax, (method, values) in zip(axes[0], scores.items()):
        ax.scatter(repeats, values, s=8, alpha=0.5)
        ax.set_xlabel("injected re-verification steps")
        ax.set_ylabel(f"InDiv ({method})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def indiv_validation(model: Any, tokenizer: Any, rows: list[dict[str, Any]], seed: int,
                     layer: Any, ci_draws: int = 1000
                     ) -> tuple[dict[str, float], dict[str, list[float]], list[int]]:
    """Spearman(InDiv, injected repetition count) on seed-format traces of `rows`, overall and
    averaged over difficulty levels, for every InDiv formula; the claim that it is negative,
    with a bootstrap CI over the traces (`ci_draws` resamples, seeded by `seed`)."""
    from stages.hsir import hsir

    traces = hsir.seed_rows(rows, 0.5, f"validation:{seed}")
    repeats = [r["n_repeats"] for r in traces]
    metrics: dict[str, float] = {}
    scores: dict[str, list[float]] = {}
    for method in hsir.INDIV_METHODS:
        s = hsir.indiv_scores(model, tokenizer, [r["prompt"] for r in traces],
                              [r["target"] for r in traces], layer=layer, method=method)
        scores[method] = s
        metrics[f"indiv/{method}/spearman_repeats"] = spearman(s, [float(n) for n in repeats])
        metrics.update(claim_metrics(spearman_claim(s, [float(n) for n in repeats], ci_draws,
                                                    seed), f"claim/indiv/{method}/spearman"))
        within = []
        for d in sorted({r["difficulty"] for r in traces}):
            idx = [i for i, r in enumerate(traces) if r["difficulty"] == d]
            within.append(spearman([s[i] for i in idx], [float(repeats[i]) for i in idx]))
        metrics[f"indiv/{method}/spearman_repeats_within_difficulty"] = mean_std(within)[0]
    metrics["indiv/rows"] = float(len(traces))
    return metrics, scores, repeats


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked
    from stages.models.base import set_threads
    from stages.models.generate import load_model
    from stages.tasks import get_family
    from stages.hsir.self_improve import eval_splits

    set_threads(cfg.num_threads)
    runs = ctx.path(cfg.runs)
    frames, budgets = {}, {}
    for arm in cfg.arms:
        frames[arm], budgets[arm] = _load_arm(runs / arm, arm)
    check_budgets(budgets, SELF_BUDGET_KEYS)
    metrics: dict[str, float] = {}
    finals = {}
    for arm, frame in frames.items():
        last = frame.filter(pl.col("round") == frame["round"].max())
        finals[arm] = {k: last[k].to_list() for k in ("acc", "hard_acc", "tokens_per_solved",
                                                      "verbose_share")}
        metrics.update({f"self/{arm}/{k}": v for k, v in pool_summary(frame).items()})
    metrics.update(summarize_arms(finals, cfg.baseline, "self"))
    keys = ("acc", "hard_acc", "tokens_per_solved")
    per_seed = {arm: seed_finals(frame, keys) for arm, frame in frames.items()}
    metrics.update(arm_claims(per_seed, cfg.method, cfg.baseline, "self", cfg.paper_acc_gain,
                              cfg.paper_tokens_change))
    if cfg.veriexit_arm is not None:
        metrics.update(pool_claim({a: seed_pool_hard_share(frames[a])
                                   for a in (cfg.veriexit_arm, cfg.baseline)},
                                  cfg.veriexit_arm, cfg.baseline))

    expect = get_family(cfg.family).expectations
    test = read_parquet_checked(ctx.path(cfg.prompts) / "test.parquet",
                                expect(None, "test")).to_dicts()
    hard = read_parquet_checked(ctx.path(cfg.hard_prompts) / "test.parquet",
                                expect(None, "test")).to_dicts()
    n = cfg.eval_rows
    eval_sets = {"": test[:n] if n else test, "hard": hard[:n] if n else hard}
    if cfg.rl_arms:
        rl_budgets, rl_finals, rl_seeds = {}, {}, {}
        for arm in cfg.rl_arms:
            curve, rl_budgets[arm] = _load_arm(runs / arm, arm, "rl")
            values: dict[str, list[float]] = {k: [] for k in ("acc", "hard_acc",
                                                              "tokens_per_solved",
                                                              "verbose_share")}
            rl_seeds[arm] = sorted(curve["seed"].unique().to_list())
            for seed in rl_seeds[arm]:
                model, tokenizer = load_model(runs / arm / f"seed{seed}")
                scores = eval_splits(model, tokenizer, eval_sets, cfg.family, cfg.max_new_tokens,
                                     cfg.eval_batch_size)
                for k in values:
                    values[k].append(scores[k])
            rl_finals[arm] = values
        check_budgets(rl_budgets, RL_BUDGET_KEYS)
        metrics.update(summarize_arms(rl_finals, cfg.rl_baseline, "rl"))
        if cfg.rl_method is not None:
            by_seed = {arm: {k: dict(zip(rl_seeds[arm], v)) for k, v in values.items()}
                       for arm, values in rl_finals.items()}
            metrics.update(arm_claims(by_seed, cfg.rl_method, cfg.rl_baseline, "rl",
                                      hard=False))

    model, tokenizer = load_model(ctx.path(cfg.seed_model))
    indiv, scores, repeats = indiv_validation(model, tokenizer, test[:cfg.indiv_rows], ctx.seed,
                                              cfg.indiv_layer, cfg.indiv_ci_draws)
    metrics.update(indiv)

    curves = pl.concat([f.with_columns(pl.lit(a).alias("arm")) for a, f in frames.items()],
                       how="diagonal_relaxed")
    mean_curve = (curves.group_by(["arm", "round"], maintain_order=True)
                  .agg(pl.col("acc").mean(), pl.col("hard_acc").mean(),
                       pl.col("tokens_per_solved").fill_nan(None).mean())
                  .sort(["arm", "round"]))
    with io.atomic_path(ctx.pipeline_dir / cfg.plot) as tmp:
        mean_curve.write_csv(tmp)
    metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
    with io.atomic_path(ctx.path(cfg.report), is_dir=True) as tmp:
        _plot_rounds(mean_curve, tmp / "rounds.png")
        _plot_indiv(scores, repeats, tmp / "indiv.png")
        (tmp / "table.md").write_text(results_table({"compare": metrics}))
    return metrics


# --- README table ------------------------------------------------------------------------------

def _cell(m: dict[str, Any], key: str, fmt: str = ".3f") -> str:
    mean, std = m.get(f"{key}_mean"), m.get(f"{key}_std")
    if mean is None:
        return "n/a"
    return f"{mean:{fmt}} ± {std:{fmt}}" if std is not None else f"{mean:{fmt}}"


def _pct(value: Any) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def _num(value: Any, fmt: str) -> str:
    return "n/a" if value is None else f"{value:{fmt}}"


def _arms(m: dict[str, Any], prefix: str) -> list[str]:
    """The arms under `prefix`, in the order `compare` listed them (metrics files sort keys)."""
    arms = [k.split("/")[1] for k in m if k.startswith(f"{prefix}/") and k.endswith("/acc_mean")]
    return sorted(arms, key=lambda a: m.get(f"{prefix}/{a}/order", 0.0))


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README table from the compare stage's metrics: arms as rows, nothing typed by hand."""
    m = metrics.get("compare", {})
    arms = _arms(m, "self")
    if not arms:
        return "_No results yet: run the pipeline._\n"
    base = next((k.rsplit("_vs_", 1)[1] for k in m if k.startswith("self/")
                 and "/acc_vs_" in k), "star")
    lines = [f"Self-improvement (final round; mean ± std over seeds; changes vs {base}):", "",
             "| arm | accuracy | Δ acc | hard accuracy | Δ hard | tokens / solved | Δ tokens "
             "| pool: hard share | pool: hard queries covered | pool: re-verifications / row "
             "| VeriExit rows faithful | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        p = f"self/{a}"
        sub = {k[len(p) + 1:]: v for k, v in m.items() if k.startswith(p + "/")}
        lines.append(
            f"| {a} | {_cell(sub, 'acc')} | {_pct(sub.get(f'acc_vs_{base}'))} "
            f"| {_cell(sub, 'hard_acc')} | {_pct(sub.get(f'hard_acc_vs_{base}'))} "
            f"| {_cell(sub, 'tokens_per_solved', '.1f')} "
            f"| {_pct(sub.get(f'tokens_per_solved_vs_{base}'))} "
            f"| {_num(sub.get('pool_hard_share'), '.1%')} "
            f"| {_num(sub.get('pool_hard_coverage'), '.1%')} "
            f"| {_num(sub.get('pool_mean_repeats'), '.2f')} "
            f"| {_num(sub.get('faithful_rate'), '.0%')} | {_num(sub.get('seeds'), '.0f')} |")
    rl = _arms(m, "rl")
    if rl:
        rl_base = next((k.rsplit("_vs_", 1)[1] for k in m if k.startswith("rl/")
                        and "/acc_vs_" in k), "grpo")
        lines += ["", f"RL (final policy; changes vs {rl_base}):", "",
                  "| arm | accuracy | Δ acc | hard accuracy | tokens / solved | Δ tokens "
                  "| seeds |", "|---|---|---|---|---|---|---|"]
        for a in rl:
            p = f"rl/{a}"
            sub = {k[len(p) + 1:]: v for k, v in m.items() if k.startswith(p + "/")}
            lines.append(
                f"| {a} | {_cell(sub, 'acc')} | {_pct(sub.get(f'acc_vs_{rl_base}'))} "
                f"| {_cell(sub, 'hard_acc')} | {_cell(sub, 'tokens_per_solved', '.1f')} "
                f"| {_pct(sub.get(f'tokens_per_solved_vs_{rl_base}'))} "
                f"| {_num(sub.get('seeds'), '.0f')} |")
    methods = sorted({k.split("/")[1] for k in m if k.startswith("indiv/")
                      and k.endswith("/spearman_repeats")})
    if methods:
        lines += ["", "InDiv validation on seed-format traces (seed model; spec: strongly "
                  "negative):", "", "| InDiv formula | Spearman vs injected repeats "
                  "| within difficulty |", "|---|---|---|"]
        for meth in methods:
            w = m.get(f"indiv/{meth}/spearman_repeats_within_difficulty")
            lines.append(f"| {meth} | {m[f'indiv/{meth}/spearman_repeats']:+.3f} "
                         f"| {'n/a' if w is None else f'{w:+.3f}'} |")
    return "\n".join(lines + claims_table(m)) + "\n"


# (group, metric) of a claim -> (README wording from method a and baseline b; number format)
CLAIM_TEXT = {
    ("self", "acc"): ("{a} vs {b}: held-out accuracy, change relative to {b} (paper: higher)",
                      "{:+.1%}"),
    ("self", "hard_acc"): ("{a} vs {b}: hard-split accuracy, difference (spec: higher)",
                           "{:+.3f}"),
    ("self", "tokens_per_solved"): ("{a} vs {b}: tokens per solved query, change relative to "
                                    "{b} (paper: fewer)", "{:+.1%}"),
    ("self", "pool_hard_share"): ("{a} vs {b}: share of hard queries in the training pools, "
                                  "difference (spec: higher)", "{:+.3f}"),
    ("rl", "acc"): ("{a} vs {b}: held-out accuracy, change relative to {b} (paper: higher)",
                    "{:+.1%}"),
    ("rl", "tokens_per_solved"): ("{a} vs {b}: tokens per solved query, change relative to {b} "
                                  "(paper: fewer)", "{:+.1%}"),
    ("indiv", "spearman"): ("InDiv ({a}): Spearman vs injected repeats, bootstrap CI over the "
                            "traces (spec: strongly negative)", "{:+.3f}"),
}


def claims_table(m: dict[str, Any]) -> list[str]:
    """README lines: every claim in `m` with its verdict sentence (`Claim.sentence`)."""
    def key(prefix: str) -> tuple[str, str]:
        parts = prefix.split("/")  # claim/<group>/<metric>/<a>_vs_<b> or claim/indiv/<f>/spearman
        return (parts[1], parts[3] if parts[1] == "indiv" else parts[2])

    order = list(CLAIM_TEXT)
    prefixes = sorted((k[:-len("/verdict")] for k in m if k.startswith("claim/")
                       and k.endswith("/verdict")),
                      key=lambda p: (order.index(key(p)) if key(p) in order else len(order), p))
    if not prefixes:
        return []
    lines = ["", "Claims, paired by seed unless said otherwise (difference method - baseline with "
             "its 95% t interval; MDE: the smallest true difference these seeds would detect "
             "with 80% power):", "", "| claim | verdict |", "|---|---|"]
    for prefix in prefixes:
        parts = prefix.split("/")
        a, _, b = (parts[2] if parts[1] == "indiv" else parts[3]).partition("_vs_")
        text, fmt = CLAIM_TEXT.get(key(prefix), ("/".join(parts[1:]), "{:+.3f}"))
        c: Claim | None = read_claim(m, prefix)
        lines.append(f"| {text.format(a=a, b=b)} | {c.sentence(fmt) if c else 'n/a'} |")
    return lines


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many claims are reproduced / inconclusive / contradicted; each claim and
    every arm's numbers in details/compare.json."""
    return stats.verdict_counts(metrics)
