"""Budget grids: run every arm at each budget B of a grid, charge everything to one ledger, and
compare arms per budget and plot accuracy against compute.

A search method is never compared at one point: Refine-Prover reports budgets 8-64 (arXiv
2604.18587; the paper itself 64/128/256), DiffuReason 1x, 4x and 16x the NFE of vanilla
decoding. At each point every arm gets the same per-problem budget in the same unit; the ledger
refuses any charge past it, and the table reports what each arm really spent (an arm that stops
early, e.g. on a solved proof, spends less and the table shows it).

    def iid(budget, meters):                 # an arm: per problem a score in [0, 1]
        ...                                  # generate while meters[p].can_afford(...), charge
        return {p: float(solved[p]) for p in problems}

    rows = run_budget_grid("iid", iid, [8, 16, 32, 64], "generations", problems, ledger)
    curve = compute_curve(rows)              # per (arm, budget): accuracy and mean compute
    plot_accuracy_vs_compute(curve, "report/acc_vs_gen.png", x="generations")

Each budget is a separate run from fresh meters, so an arm whose behaviour depends on B (a
search that splits its budget over blocks) is run as it would be at that B. Wall seconds of each
run go to `ledger.wall_seconds` and `wall_seconds_per_problem` in the curve: a measurement of
the machine, not a result (the metrics contract keeps it out of tracked files; log it to MLflow).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from stages.search.ledger import UNITS, Budget, Ledger, Meter

Arm = Callable[[Budget, Mapping[str, Meter]], Mapping[str, float]]


def run_budget_grid(arm: str, run_arm: Arm, budgets: Sequence[int], unit: str,
                    problems: Sequence[str], ledger: Ledger) -> list[dict[str, Any]]:
    """Run `run_arm(budget, meters)` at every budget; one row per (budget, problem): arm, unit,
    budget, problem, score and every compute unit that problem spent.

    `run_arm` gets a meter per problem (keyed by problem id) and returns a score per problem
    (1.0 solved / correct, 0.0 not; any number in [0, 1])."""
    if not budgets or any(int(b) != b or b < 1 for b in budgets):
        raise ValueError(f"budgets = {list(budgets)!r}: expected integers >= 1")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"budgets = {list(budgets)!r}: a budget is listed twice")
    problems = [str(p) for p in problems]
    if not problems or len(set(problems)) != len(problems):
        raise ValueError(f"problems: expected distinct ids, got {len(problems)} "
                         f"({len(set(problems))} distinct)")
    rows = []
    for b in budgets:
        budget = Budget(unit=unit, limit=int(b))
        meters = {p: ledger.meter(arm, budget, p) for p in problems}
        started = time.perf_counter()
        scores = run_arm(budget, meters)
        ledger.wall_seconds[(arm, budget)] += time.perf_counter() - started
        missing = [p for p in problems if p not in scores]
        extra = [p for p in scores if p not in meters]
        if missing or extra:
            raise ValueError(f"arm {arm!r} at {unit} budget {b}: scores missing for "
                             f"{missing[:5]} / for unknown problems {extra[:5]}")
        for p in problems:
            score = float(scores[p])
            if not 0.0 <= score <= 1.0:
                raise ValueError(f"arm {arm!r}, problem {p!r}: score {score!r} not in [0, 1]")
            spent = meters[p].spent
            # The meters refuse such a charge; this catches an arm that bypassed them.
            if spent.get(unit) > b:
                raise AssertionError(f"arm {arm!r}, problem {p!r}: spent {spent.get(unit)} "
                                     f"{unit} at budget {b}")
            rows.append({"arm": arm, "unit": unit, "budget": int(b), "problem": p,
                         "score": score, **spent.as_dict()})
    return rows


def compute_curve(rows: Sequence[Mapping[str, Any]], ledger: Ledger | None = None) -> Any:
    """Per (arm, budget): `accuracy` (mean score), `n` problems, mean of every compute unit per
    problem, `used` (mean share of the budget spent) and, given the ledger,
    `wall_seconds_per_problem`. A polars frame sorted by arm and budget."""
    import polars as pl

    if not rows:
        raise ValueError("compute_curve: no rows")
    frame = pl.DataFrame(list(rows))
    curve = (frame.group_by(["arm", "unit", "budget"], maintain_order=True)
             .agg(pl.col("score").mean().alias("accuracy"), pl.len().alias("n"),
                  *[pl.col(u).mean().cast(pl.Float64) for u in UNITS]))
    used = [row[row["unit"]] / row["budget"] for row in curve.iter_rows(named=True)]
    curve = curve.with_columns(pl.Series("used", used, dtype=pl.Float64))
    if ledger is not None:
        wall = [ledger.wall_seconds.get((r["arm"], Budget(unit=r["unit"], limit=r["budget"])),
                                        float("nan")) / r["n"]
                for r in curve.iter_rows(named=True)]
        curve = curve.with_columns(pl.Series("wall_seconds_per_problem", wall,
                                             dtype=pl.Float64))
    return curve.sort(["arm", "budget"])


def plot_accuracy_vs_compute(curve: Any, path: str | Path, *, x: str = "nfe",
                             y: str = "accuracy", log_x: bool = True,
                             title: str | None = None) -> Path:
    """One line per arm: `y` against the mean compute per problem in `x` (a unit, or
    `budget`, or `wall_seconds_per_problem`); written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stages.core import io

    for col in (x, y, "arm"):
        if col not in curve.columns:
            raise ValueError(f"plot_accuracy_vs_compute: no column {col!r} in the curve "
                             f"(columns: {curve.columns})")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for arm in curve["arm"].unique(maintain_order=True).to_list():
        part = curve.filter(curve["arm"] == arm).sort(x)
        ax.plot(part[x].to_list(), part[y].to_list(), marker="o", label=arm)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{x} per problem (mean)" if x != "budget" else "budget per problem")
    ax.set_ylabel(y)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return Path(path)
