"""Stage `compare` of SAME: the arms side by side, the forgetting gate, and the paper's claims.

Pairs are seeds: a run is one (seed, task order) under every arm, i.e. the same frozen checkpoint
and the same batches; the two orders of a seed tune the same `vlm-shapes` checkpoint, so they
are not independent, and each arm's value per seed is the mean over its orders (`by_seed`).
Each claim is the paired t 95% CI over the seeds (5 pairs at `cpu`, not the 10 runs: treating
the runs as independent would narrow the CI without the data for it), turned into a verdict by
the house rule (reproduced / contradicted / inconclusive, with the MDE).

The gate (issue 19): naive LoRA must forget, i.e. the 95% CI of its BWT must exclude 0 on the
negative side. If it does not, there is nothing for SAME to fix here: every comparison is
reported with its numbers but marked **not tested** (no verdict).

Claims (CoIN ablation [secondary], final average accuracy, as fractions):
- + spectral router over MoE-LoRA: +0.107 (50.58 -> 61.32), for the paper's 1/sigma-scaled
  router gradient; the `spectral` arm here projects the update (`router_mode: project`), so the
  paper's number is shown beside a different update (the claim's text says so);
- + curvature over + spectral router: +0.046 (-> 65.89);
- + adaptive freezing (full SAME) over + curvature: +0.009 (-> 66.82);
- full SAME over MoE-LoRA: +0.162; MoE-LoRA over LoRA (no number);
- SAME's BWT is less negative than MoE-LoRA's, and its router drift (JS) smaller (spec §4
  prediction, no number).

    python -m stages same compare
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import stats

ARMS = ("lora", "moe_lora", "spectral", "curvature", "same")
# name -> (method, baseline, statistic, direction, paper effect, text)
CLAIMS: dict[str, tuple[str, str, str, int, float | None, str]] = {
    "moe_vs_lora": ("moe_lora", "lora", "avg", 1, None, "MoE-LoRA beats LoRA (final avg)"),
    "spectral_step": ("spectral", "moe_lora", "avg", 1, 0.107,
                      "+ spectral router beats MoE-LoRA (final avg; projected router update, "
                      "the paper's +0.107 is for its 1/σ-scaled one)"),
    "curvature_step": ("curvature", "spectral", "avg", 1, 0.046,
                       "+ curvature beats + spectral router (final avg)"),
    "freezing_step": ("same", "curvature", "avg", 1, 0.009,
                      "+ adaptive freezing (SAME) beats + curvature (final avg)"),
    "same_vs_moe": ("same", "moe_lora", "avg", 1, 0.162, "SAME beats MoE-LoRA (final avg)"),
    "same_bwt": ("same", "moe_lora", "bwt", 1, None, "SAME forgets less than MoE-LoRA (BWT)"),
    "same_drift": ("same", "moe_lora", "router_js", -1, None,
                   "SAME's routers drift less than MoE-LoRA's (JS of task-1 usage)"),
}
COLUMNS = (("avg", "final avg ↑"), ("bwt", "BWT ↑"), ("plasticity", "a_jj (just learned)"),
           ("first_after_first", "task 1 after 1"), ("first_after_last", "task 1 after T"),
           ("probe_acc", "task 1, router re-tuned"), ("router_js", "router JS ↓"),
           ("frozen_share", "frozen share"))


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    runs: str = Field("same_runs", description="path key: train's matrix / runs tables")
    report: str = Field("same_report", description="path key: PNG figures")
    gate_alpha: float = Field(0.05, gt=0, lt=0.5,
                              description="the gate's CI level is 1 - this (only 0.05 is "
                                          "implemented: the house 95% t interval)")


def plasticity(matrix: Any) -> dict[tuple[str, int, int], float]:
    """Mean a_{j,j} (accuracy on a task right after learning it) per (arm, seed, order)."""
    import polars as pl

    diag = matrix.filter(pl.col("after") == pl.col("position"))
    agg = diag.group_by("arm", "seed", "order").agg(pl.col("acc").mean())
    return {(a, s, o): v for a, s, o, v in agg.iter_rows()}


def paired(runs: Any, arm: str, key: str) -> dict[tuple[int, int], float]:
    import polars as pl

    rows = runs.filter(pl.col("arm") == arm)
    return {(s, o): float(v) for s, o, v in rows.select("seed", "order", key).iter_rows()}


def by_seed(values: dict[tuple[int, int], float]) -> dict[int, float]:
    """{seed: mean over its task orders} of per-run values keyed (seed, order): the unit of
    pairing (module docstring). NaN if any order of the seed is NaN."""
    out: dict[int, list[float]] = {}
    for (seed, _), v in sorted(values.items()):
        out.setdefault(seed, []).append(v)
    return {s: sum(v) / len(v) for s, v in out.items()}


def gate(lora_bwt: list[float]) -> stats.Claim:
    """'LoRA forgets': BWT below 0, its paired t 95% CI against 0 (direction -1)."""
    return stats.claim(lora_bwt, [0.0] * len(lora_bwt), direction=-1)


def matrix_figure(matrix: Any, path: Any) -> None:
    """One panel per arm: mean accuracy on task position j after training position i."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import polars as pl

    from stages.core import io

    arms = [a for a in ARMS if a in set(matrix["arm"].to_list())]
    t = int(matrix["position"].max()) + 1
    fig, axes = plt.subplots(1, len(arms), figsize=(2.6 * len(arms), 2.8))
    for ax, arm in zip([axes] if len(arms) == 1 else axes, arms):
        m = matrix.filter(pl.col("arm") == arm).group_by("after", "position").agg(
            pl.col("acc").mean())
        grid = [[math.nan] * t for _ in range(t)]
        for i, j, v in m.iter_rows():
            grid[i][j] = v
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis")
        for i in range(t):
            for j in range(i + 1):
                ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=6,
                        color="w" if grid[i][j] < 0.6 else "k")
        ax.set_title(arm, fontsize=8)
        ax.set_xlabel("task position j", fontsize=7)
        ax.set_ylabel("after training i", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.suptitle("accuracy a[i][j] (tasks seen so far), mean over seeds and orders", fontsize=8)
    fig.tight_layout()
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.same.train import matrix_spec, runs_spec

    folder = ctx.path(cfg.runs)
    runs = read_parquet_checked(folder / "runs.parquet", runs_spec())
    matrix = read_parquet_checked(folder / "matrix.parquet", matrix_spec())
    missing = sorted(set(ARMS) - set(runs["arm"].to_list()))
    if missing:
        raise ValueError(f"{folder / 'runs.parquet'}: no runs of arms {missing}")
    plast = plasticity(matrix)
    metrics: dict[str, float] = {
        "runs": float(runs.filter(runs["arm"] == "lora").height),
        "seeds": float(runs["seed"].n_unique()), "orders": float(runs["order"].n_unique()),
        "zero_shot_avg": float(runs["zero_shot_avg"].mean())}
    for arm in ARMS:
        for key, _ in COLUMNS:
            if key == "plasticity":
                vals = [v for (a, _, _), v in plast.items() if a == arm]
            else:
                vals = list(paired(runs, arm, key).values())
            metrics[f"{arm}/{key}_mean"], metrics[f"{arm}/{key}_std"] = stats.mean_std(vals)
    # final accuracy per task (mean over runs), for the per-task table
    import polars as pl

    final = matrix.filter(pl.col("after") == matrix["position"].max())
    for arm, task, acc in final.group_by("arm", "task").agg(pl.col("acc").mean()).iter_rows():
        metrics[f"{arm}/final_{task}"] = acc
    bwt = by_seed(paired(runs, "lora", "bwt"))
    g = gate([bwt[k] for k in sorted(bwt)])
    metrics.update(g.metrics("gate/lora_bwt"))
    forgets = g.verdict == 1
    metrics["gate_forgetting"] = float(forgets)
    print(f"compare: gate (LoRA forgets, BWT < 0): {g.sentence()}")
    for name, (method, baseline, key, direction, paper, _) in CLAIMS.items():
        ra, rb = paired(runs, method, key), paired(runs, baseline, key)
        if sorted(ra) != sorted(rb):
            raise ValueError(f"arms {method!r} and {baseline!r} cover different (seed, order) "
                             f"runs")
        a, b = by_seed(ra), by_seed(rb)
        keys = [k for k in sorted(a) if math.isfinite(a[k]) and math.isfinite(b[k])]
        if len(keys) < 1:
            continue
        c = stats.claim([a[k] for k in keys], [b[k] for k in keys], direction=direction,
                        paper_effect=paper)
        if forgets:
            metrics.update(c.metrics(f"claim/{name}"))
            print(f"compare: {name}: {c.sentence()}")
        else:
            metrics.update({k: v for k, v in c.metrics(f"untested/{name}").items()
                            if not k.endswith("/verdict")})
            print(f"compare: {name}: not tested (LoRA does not forget): {c.sentence()}")
    report = ctx.path(cfg.report)
    report.mkdir(parents=True, exist_ok=True)
    matrix_figure(matrix, report / "accuracy_matrix.png")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: verdict counts of the paper's claims (the gate is a precondition, not a
    claim: it is its own key), the gate, LoRA's BWT and SAME's final average."""
    out = stats.verdict_counts({k: v for k, v in metrics.items() if not k.startswith("gate/")})
    out["gate"] = metrics.get("gate_forgetting", math.nan)
    out["lora_bwt"] = metrics.get("lora/bwt_mean", math.nan)
    out["same_avg"] = metrics.get("same/avg_mean", math.nan)
    return out


def _cell(m: dict[str, Any], key: str) -> str:
    mean, std = m.get(f"{key}_mean", math.nan), m.get(f"{key}_std", math.nan)
    if not math.isfinite(mean):
        return "—"
    return f"{mean:.3f} ± {std:.3f}"


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """The README block of `paperline report same`: arms, per-task accuracy, gate, claims."""
    m = metrics.get("compare", {})
    if "lora/avg_mean" not in m:
        return "_No results yet: run the pipeline._\n"
    runs, seeds, orders = int(m["runs"]), int(m["seeds"]), int(m["orders"])
    lines = [f"Test splits, mean ± std over {runs} runs ({seeds} `vlm-shapes` seeds × {orders} "
             f"task orders; a run is one frozen checkpoint, one order, the same batches for "
             f"every arm). Zero-shot accuracy of the frozen model, mean over tasks: "
             f"{m.get('zero_shot_avg', math.nan):.3f}.", "",
             "| arm | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for arm in ARMS:
        lines.append(f"| {arm} | " + " | ".join(_cell(m, f"{arm}/{k}") for k, _ in COLUMNS)
                     + " |")
    tasks = sorted({k.split("/final_")[1] for k in m if "/final_" in k})
    lines += ["", "Accuracy on each task after the last task (mean over runs):", "",
              "| arm | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for arm in ARMS:
        lines.append(f"| {arm} | " + " | ".join(f"{m.get(f'{arm}/final_{t}', math.nan):.3f}"
                                                for t in tasks) + " |")
    g = stats.read_claim(m, "gate/lora_bwt")
    forgets = bool(m.get("gate_forgetting"))
    lines += ["", f"**Gate** (issue 19: LoRA's BWT 95% CI excludes 0, there is forgetting; "
                  f"over seeds, each the mean of its orders): "
                  f"{'holds' if forgets else 'FAILS'}; {g.sentence() if g else 'n/a'}.", "",
              "| claim | paired 95% CI over seeds (each the mean of its task orders) |",
              "|---|---|"]
    for name, (*_, text) in CLAIMS.items():
        c = stats.read_claim(m, f"claim/{name}")
        if c is not None:
            lines.append(f"| {text} | {c.sentence()} |")
        elif f"untested/{name}/diff" in m:
            d = m[f"untested/{name}/diff"]
            lo, hi = m[f"untested/{name}/ci_low"], m[f"untested/{name}/ci_high"]
            lines.append(f"| {text} | **not tested** (the gate fails): {d:+.3f} "
                         f"[{lo:+.3f}, {hi:+.3f}] |")
    lines += ["", "Accuracy is first-token greedy accuracy (every answer is one word). BWT = "
                  "mean over j < T of a[T][j] − a[j][j]. Router JS: Jensen-Shannon divergence "
                  "(bits) of task 1's expert usage after task 1 and after task T, mean over "
                  "layers (MoE arms). Re-tuned: task 1 accuracy after retraining only the "
                  "routers on task 1 with the experts frozen (the re-routing probe).", "",
              "![accuracy matrices](report/accuracy_matrix.png)", ""]
    return "\n".join(lines)
