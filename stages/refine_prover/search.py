"""Stage `search` of Refine-Prover: every arm on the test statements at every budget, per seed.

Arms (spec §4), all budgeted in generations (restarts included; value-model calls apart):

    iid            i.i.d. base-prover samples, stop at the first accepted proof (pass@B)
    random_tree    refinement tree, random node selection, expert-iteration refiner
    value_tree     refinement tree, best-first on the value model (restart vs repair)
    long_history   one chain: each attempt conditions on the earlier attempts and errors
    base_refiner   random tree with the untrained base prover as the refiner
    cold_refiner   random tree with the cold-start refiner (before expert iteration)

Budgets are nested: no arm's algorithm depends on B (each stops at its first accepted proof or at
B), so the run at B is the first B generations of the run at the largest budget. Each arm runs
once at max(B) and `stages.search.budget.run_budget_grid` replays the first B generations into
a fresh ledger per budget (`prover.GenLog.at_budget`), which checks that no problem spends past
B. Output: one row per (seed, arm, budget, problem) with `score` (solved) and every unit of
`stages.search.ledger.Cost`; the i.i.d. check compares the i.i.d. arm with 1 - (1 - p)^B
estimated without bias from per-problem counts on a separate set of `rate_samples` samples
(`iid_check`; budgets above `rate_samples` cannot be checked and are counted); the base prover's
wrong samples give the compression statistics of real failures.

    python -m stages refine_prover search
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io
from stages.refine_prover import kernel, prover

ARMS = ("iid", "random_tree", "value_tree", "long_history", "base_refiner", "cold_refiner")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    budgets: list[int] = Field(description="generation budgets B per problem [spec: 8-64]")
    arms: list[str] = Field(default_factory=lambda: list(ARMS), description="arms to run")
    history: int = Field(3, ge=1, description="attempts the long-history prompt holds (the "
                                              "refiner's 512-char window)")
    rate_samples: int = Field(64, ge=1, description="base samples per problem for the measured "
                                                    "rates p (i.i.d. check)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature, every arm")
    max_new_tokens: int = Field(110, ge=8, description="longest proof (chars)")
    batch_size: int = Field(256, ge=1, description="sequences per generate call")
    problems: str = Field("refine_prover_problems", description="paths key of the problems")
    models: str = Field("refine_prover_models", description="paths key of the trained models")
    out: str = Field("refine_prover_search", description="paths key of the search output")
    num_threads: int = Field(0, ge=0, description="torch threads per process (0: all cores)")
    workers: int = Field(1, ge=1, le=64, description="(seed, arm) jobs run side by side in "
                                                     "spawned processes (stages.core.pool); "
                                                     "the results do not depend on it")

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, v: list[int]) -> list[int]:
        if not v or any(b < 1 for b in v) or len(set(v)) != len(v):
            raise ValueError(f"budgets = {v}: expected distinct integers >= 1")
        return sorted(v)

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if a not in ARMS]
        if bad or not v:
            raise ValueError(f"arms = {v}: unknown {bad}; expected some of {list(ARMS)}")
        return v


def result_spec() -> Any:
    import polars as pl

    from stages.core.checks import spec_from_schema
    from stages.search.ledger import UNITS

    schema = {"seed": pl.Int64, "arm": pl.String, "unit": pl.String, "budget": pl.Int64,
              "problem": pl.String, "score": pl.Float64, **{u: pl.Int64 for u in UNITS}}
    return spec_from_schema(schema, arm={"values": list(ARMS)})


def load_value(path: Any) -> np.ndarray:
    from stages.core.checks import read_json_checked

    data = read_json_checked(path, {"features": list, "weights": list})
    if data["features"] != list(prover.FEATURES):
        raise ValueError(f"{path}: value features {data['features']} are not "
                         f"{list(prover.FEATURES)}; retrain")
    w = np.array(data["weights"], dtype=float)
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{path}: non-finite value weights")
    return w


RATES = "rates"   # the job that measures the base prover's per-problem rates (i.i.d. check)


def run_arm(cfg: Config, problems: dict[str, str], gens: dict[str, prover.Generator],
            w: np.ndarray, seed: int, k0: float, arm: str) -> dict[str, prover.GenLog]:
    """One arm on every problem at the largest budget (every generation call seeds itself, so
    an arm's logs depend on its inputs only, not on what ran before it)."""
    top = max(cfg.budgets)
    if arm == "iid":
        return prover.run_iid(problems, gens["base"], top, seed)
    if arm == "long_history":
        return prover.run_history(problems, gens["base"], gens["refiner"], top, seed,
                                  cfg.history)
    refiner = {"random_tree": "refiner", "value_tree": "refiner",
               "base_refiner": "base", "cold_refiner": "refiner_cold"}[arm]
    model = prover.RefineModel(gens["base"], gens[refiner], seed=seed,
                               value_weights=w if arm == "value_tree" else None,
                               prior_strength=k0)
    return prover.run_tree(problems, model, top, "value" if arm == "value_tree" else "random")


def _arm_job(job: tuple[Config, dict[str, str], Any, int, str]) -> Any:
    """One (seed, arm) of the search, or the seed's rate samples (`RATES`), from the seed's
    saved models alone: any process, any order (stages.core.pool)."""
    from stages.core.checks import read_json_checked
    from stages.models.base import set_threads
    from stages.models.generate import load_model

    cfg, problems, folder, seed, arm = job
    set_threads(cfg.num_threads)
    gens = {}
    for name in ("base", "refiner", "refiner_cold"):
        model, tok = load_model(folder / name)
        gens[name] = prover.Generator(model, tok, cfg.max_new_tokens, cfg.temperature,
                                      cfg.batch_size)
    if arm == RATES:
        return prover.sample_rates(problems, gens["base"], cfg.rate_samples, seed + 10_000)
    w = load_value(folder / "value.json")
    k0 = float(read_json_checked(folder / "value.json")["prior_strength"])
    return run_arm(cfg, problems, gens, w, seed, k0, arm)


def _timed_job(job: tuple[Config, dict[str, str], Any, int, str]) -> tuple[float, Any]:
    """(wall seconds, `_arm_job(job)`): the per-job times go to MLflow, never to a tracked file."""
    import time

    started = time.perf_counter()
    out = _arm_job(job)
    return time.perf_counter() - started, out


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.pool import map_jobs
    from stages.refine_prover.train import load_problems
    from stages.search.budget import run_budget_grid
    from stages.search.ledger import Ledger

    df = load_problems(ctx, cfg.problems)
    test = df.filter(df["split"] == "test")
    problems = dict(zip(test["id"].to_list(), test["statement"].to_list()))
    models = ctx.path(cfg.models)
    seeds = sorted(int(p.name[4:]) for p in models.glob("seed*"))
    if not seeds:
        raise FileNotFoundError(f"{models}: no seed<k>/ folders; run stage train first")
    # longest first (long-history chains, then the trees, then i.i.d. and the rate samples),
    # so no long job starts last while the other worker idles; results are keyed, not ordered
    cost = {"long_history": 0, "iid": 2, RATES: 3}
    jobs = sorted(((cfg, problems, models / f"seed{seed}", seed, arm)
                   for seed in seeds for arm in (*cfg.arms, RATES)),
                  key=lambda job: (cost.get(job[4], 1), job[3]))
    timed = map_jobs(_timed_job, jobs, cfg.workers)
    ctx.log_metrics({f"job_seconds/seed{job[3]}/{job[4]}": t for job, (t, _) in zip(jobs, timed)})
    done = {(job[3], job[4]): out for job, (_, out) in zip(jobs, timed)}
    rows: list[dict[str, Any]] = []
    metrics: dict[str, float] = {}
    wrong: list[tuple[str, str]] = []
    for seed in seeds:
        logs = {arm: done[seed, arm] for arm in cfg.arms}
        ledger = Ledger()
        for arm, arm_logs in logs.items():
            def replay(budget: Any, meters: Any, arm_logs: Any = arm_logs) -> dict[str, float]:
                scores = {}
                for p, meter in meters.items():
                    solved, cost = arm_logs[p].at_budget(budget.limit)
                    meter.charge(cost)
                    scores[p] = float(solved)
                return scores
            for r in run_budget_grid(arm, replay, cfg.budgets, "generations", list(problems),
                                     ledger):
                rows.append({"seed": seed, **r})
        # The i.i.d. check: pass@B against 1 - (1 - p)^B from separately measured rates.
        rates, wrong_s = done[seed, RATES]
        wrong += wrong_s
        metrics[f"seed{seed}/base_rate"] = float(np.mean(list(rates.values())))
        if "iid" in logs:
            n = cfg.rate_samples
            successes = [round(rates[p] * n) for p in problems]
            for b in cfg.budgets:
                solved = [float(logs["iid"][p].at_budget(b)[0]) for p in problems]
                if b > n:  # no unbiased estimate of (1 - p)^B from n < B samples exists
                    metrics["iid_check/unchecked"] = metrics.get("iid_check/unchecked", 0.0) + 1
                    continue
                observed, pred, z = iid_check(solved, successes, n, b)
                metrics[f"iid_check/seed{seed}/B{b}/observed"] = observed
                metrics[f"iid_check/seed{seed}/B{b}/predicted"] = pred
                metrics[f"iid_check/seed{seed}/B{b}/z"] = z
    zs = [v for k, v in metrics.items() if k.startswith("iid_check/") and k.endswith("/z")]
    if zs:
        finite = [abs(z) for z in zs if math.isfinite(z)]
        metrics["iid_check/max_abs_z"] = float(max(finite)) if finite else float("nan")
        # cells where observed and predicted agree on every problem (no spread): z undefined
        metrics["iid_check/undefined"] = float(sum(not math.isfinite(z) for z in zs))
    metrics.update({f"real_failures/{k}": v for k, v in kernel.signature_counts(wrong).items()})
    frame = pl.DataFrame(rows)
    out = ctx.path(cfg.out)
    with io.atomic_path(out, is_dir=True) as tmp:
        io.write_parquet(tmp / "results.parquet", frame)
    for (arm, seed), part in frame.group_by(["arm", "seed"], maintain_order=True):
        top = part.filter(pl.col("budget") == max(cfg.budgets))
        with ctx.method_run("search", str(arm), int(seed), {"arm": arm, "seed": seed,
                                                              "budget": max(cfg.budgets)}) as run_:
            run_.log_metrics({"solved": float(top["score"].mean()),
                              "output_tokens": float(top["output_tokens"].mean()),
                              "input_tokens": float(top["input_tokens"].mean()),
                              "generations": float(top["generations"].mean())})
    for arm in cfg.arms:
        for b in cfg.budgets:
            part = frame.filter((pl.col("arm") == arm) & (pl.col("budget") == b))
            metrics[f"{arm}/B{b}/solved"] = float(part["score"].mean())
            metrics[f"{arm}/B{b}/output_tokens"] = float(part["output_tokens"].mean())
            metrics[f"{arm}/B{b}/input_tokens"] = float(part["input_tokens"].mean())
    return metrics


def unsolved_estimate(k: int, n: int, budget: int) -> float:
    """Unbiased estimate of (1 - p)^B from k accepted of n i.i.d. samples (B <= n): the chance
    that B of the n samples drawn without replacement are all failures, C(n - k, B) / C(n, B).
    The plug-in (1 - k/n)^B is biased (Jensen): a problem solved at 1% per sample shows k = 0 of
    32 most of the time and would be predicted never solved, so the check read z = 8.7."""
    if not 0 <= k <= n or not 1 <= budget <= n:
        raise ValueError(f"unsolved_estimate needs 0 <= k <= n and 1 <= B <= n, got k={k}, "
                         f"n={n}, B={budget}")
    return math.comb(n - k, budget) / math.comb(n, budget)


def iid_check(solved: list[float], successes: list[int], n: int, budget: int
              ) -> tuple[float, float, float]:
    """(observed, predicted, z) of the i.i.d. check at `budget` (<= n) over problems.

    Per problem, D = solved_B - (1 - U), with U = `unsolved_estimate(k, n, B)` from separate
    samples: E[D] = 0 exactly when i.i.d. sampling at B behaves as the rates say, and the D are
    independent across problems, so z = mean(D) / (sd(D) / sqrt(N)) (a one-sample t statistic;
    the spread of D carries both the sampling noise of the arm and the error of the rates).
    z is 0 when every D is 0 and NaN when the D agree on a non-zero value (no spread to size
    it)."""
    if len(solved) != len(successes) or not solved:
        raise ValueError(f"iid_check needs one rate per problem: {len(solved)} solved, "
                         f"{len(successes)} rates")
    pred = [1.0 - unsolved_estimate(k, n, budget) for k in successes]
    d = np.asarray(solved, dtype=float) - np.asarray(pred)
    observed, predicted = float(np.mean(solved)), float(np.mean(pred))
    sd = float(np.std(d, ddof=1)) if len(d) > 1 else 0.0
    if sd > 0:
        return observed, predicted, float(d.mean() / (sd / math.sqrt(len(d))))
    return observed, predicted, (0.0 if math.isclose(float(d.mean()), 0.0, abs_tol=1e-12)
                                 else float("nan"))


def headline(details: dict[str, float]) -> dict[str, float]:
    """Solved fraction of i.i.d. sampling and of the value-guided tree at the largest budget:
    flat short keys (`dvc metrics show` prints one column per key over all stages)."""
    top = max((int(k.split("/")[1][1:]) for k in details if k.startswith("iid/B")), default=0)
    names = {"iid_solved": f"iid/B{top}/solved", "value_solved": f"value_tree/B{top}/solved"}
    return {short: details[k] for short, k in names.items() if k in details}
