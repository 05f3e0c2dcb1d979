"""Stage `oracle` of ProofVerify: the spec's simulated-oracle mode (§4), a budget sweep.

The learned verifiers of this pipeline are tiny and near chance, so they cannot say whether the
*selection rules* behave as the paper says. Here the verifiers are replaced by simulated ones
with set error rates (spec §4 [reconstructed]: P(Yes | valid) = 0.85, P(Yes | flaw b) = 0.5, the
"style" bias, P(Yes | flaw a) = 0.2; a game between a valid and an invalid candidate is won by
the valid one with probability 0.75, otherwise it is a coin flip), and every rule runs on the
same budget of B verifier calls per problem, B in {64, 256, 1024, 4096}:

- pure Judge over a pool of n_p: n_j = B / n_p verdicts per candidate (B < n_p: B candidates,
  one verdict each); argmax of s = #Yes / n_j after a shuffle (`pv.select_by_score`);
- pure GenSelect: one knockout over min(n_p, B + 1) candidates (n - 1 games; budget above
  n_p - 1 is left unspent, as in the paper: one tournament);
- Hybrid: knockout down to n_s = n_p / 16 [paper] (n_p - n_s games), then the judge on the
  survivors with n_j = (B - games) / n_s verdicts each (B too small for one verdict each: a pool
  of B candidates, n_s = B / 16, one verdict each);
- majority vote on the final answers of the whole pool (no verifier call) and a random pick.

The knockout is the pipeline's own `pv.Knockout` (reshuffled every round, byes, exact N - w
games); only the verifier is simulated. Each problem's pool of n_p is drawn with replacement
from its sampled candidates (stage `candidates`), so the policy's real mix of valid, flaw-a and
flaw-b solutions and its final answers are what the rules select from [ours]. Each seed redraws
the pool, the verdicts, the shuffles and the ties. No model is called: the stage takes seconds.

The predicted ordering (spec §4 of the reproduction plan, from the paper's §1 claim "Hybrid >
pure GenSelect ≈ pure Judge at equal or lower compute") goes through the house claim rule
(`stats.claim`), on proof-level accuracy paired over problems (each arm's accuracy on a problem
averaged over seeds; every arm of a seed selects from the same pool; percentile bootstrap over
problems): Hybrid vs Judge at every budget, Hybrid at each smaller budget vs Judge at the largest
("Hybrid ≥ Judge at far smaller B"), and Hybrid vs GenSelect at the largest budget. The paper
gives no number for any of them, so there is no paper effect to set beside the MDE.

    metrics/oracle.json        <arm>/B<b>/proof_acc_mean|std, answer_acc_*, calls_*; claim/*
    plots/oracle_budget.csv    arm, budget, calls, proof_acc, answer_acc

    python -m stages proofverify oracle
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any

import numpy as np
import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io, stats
from stages.proofverify import proofverify as pv

ARMS = ("judge", "genselect", "hybrid", "majority", "random")


class Oracle(BaseModel):
    """A simulated verifier: the judge's Yes rate per class and the selector's accuracy."""

    model_config = ConfigDict(extra="forbid")

    p_yes_valid: float = Field(0.85, ge=0, le=1, description="P(Yes | valid) [spec §4]")
    p_yes_flaw_b: float = Field(0.5, ge=0, le=1, description="P(Yes | right answer, wrong step): "
                                "the style bias [spec §4]")
    p_yes_flaw_a: float = Field(0.2, ge=0, le=1, description="P(Yes | wrong answer) [spec §4]")
    pairwise_acc: float = Field(0.75, ge=0, le=1, description="P(valid wins | validity differs) "
                                "[spec §4]; same validity: a coin flip")

    def p_yes(self, flaw: str) -> float:
        return {"none": self.p_yes_valid, "b": self.p_yes_flaw_b, "a": self.p_yes_flaw_a}[flaw]


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    candidates: str = Field("candidates", description="paths key of the candidates folder")
    oracle: Oracle = Field(default_factory=Oracle, description="the simulated verifiers")
    budgets: list[Annotated[int, Field(ge=1)]] = Field([64, 256, 1024, 4096], min_length=1,
                               description="verifier calls per problem B [spec §4]")
    n_p: int = Field(256, ge=2, le=1_000_000, description="candidates per problem [paper]")
    survivor_ratio: int = Field(16, ge=2, le=1_000_000, description="Hybrid keeps n_s = n_p / "
                                "ratio survivors [paper: 16 of 256]")
    seeds: list[int] = Field([0, 1, 2, 3, 4, 5, 6, 7], min_length=1,
                             description="repeats; each redraws pools, verdicts and shuffles")
    bootstrap: int = Field(2000, ge=100, le=100_000, description="bootstrap draws of the paired "
                           "95% CIs of the claims, over problems [ours]")
    plot: str = Field("plots/oracle_budget.csv", description="plot CSV, relative to the pipeline")

    @field_validator("budgets", "seeds")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"{v} repeats a value")
        return v


def log_method_runs(ctx: Any, per_seed: pl.DataFrame, cfg: Config) -> None:
    """One MLflow run per (rule, budget, seed), named `<rule>@B<budget>` (as racer's routers are
    `<method>@C<budget>`): params `method`, `budget`, `seed`, `n_p` and the simulated verifier's
    error rates; metrics `proof_acc`, `answer_acc`, `calls` for every rule, so MLflow's Compare
    puts the rules side by side at each budget."""
    shared = {"n_p": cfg.n_p, "survivor_ratio": cfg.survivor_ratio,
              **cfg.oracle.model_dump()}
    rows = per_seed.sort(["arm", "budget", "seed"]).iter_rows(named=True)
    for r in rows:
        params = {"method": r["arm"], "budget": r["budget"], "seed": r["seed"], **shared}
        with ctx.method_run("oracle", f"{r['arm']}@B{r['budget']}", r["seed"],
                            params=params) as run:
            run.log_metrics({k: float(r[k]) for k in ("proof_acc", "answer_acc", "calls")})


# --- how each rule spends a budget of B calls ------------------------------------------------

def judge_plan(budget: int, n_p: int) -> tuple[int, int]:
    """(candidates judged, verdicts each) for pure Judge: all n_p with B // n_p verdicts, or
    B candidates with one verdict when B < n_p."""
    return (n_p, budget // n_p) if budget >= n_p else (budget, 1)


def genselect_plan(budget: int, n_p: int) -> int:
    """Candidates in the one knockout: n - 1 games must fit in B."""
    return min(n_p, budget + 1)


def hybrid_plan(budget: int, n_p: int, ratio: int) -> tuple[int, int, int]:
    """(pool, survivors n_s, verdicts per survivor n_j). Knockout n_p -> n_s = n_p // ratio
    costs n_p - n_s games; what is left buys n_j = (B - games) // n_s verdicts each. A budget
    below n_p: a pool of B, n_s = B // ratio (at least 1), one verdict each: B calls."""
    n_s = max(1, n_p // ratio)
    games = n_p - n_s
    if budget >= games + n_s:
        return n_p, n_s, (budget - games) // n_s
    pool = max(1, budget)
    n_s = max(1, pool // ratio)
    return pool, n_s, 1


# --- one problem, one budget -----------------------------------------------------------------

def judge_scores(flaws: list[str], n_j: int, oracle: Oracle, gen: np.random.Generator
                 ) -> list[float]:
    """s = #Yes / n_j with Yes ~ Bernoulli(P(Yes | class)) per verdict."""
    p = np.array([oracle.p_yes(f) for f in flaws])
    return (gen.binomial(n_j, p) / n_j).tolist()


def play_oracle_game(valid_a: bool, valid_b: bool, oracle: Oracle, rng: random.Random) -> int:
    """0 if the first candidate wins, 1 if the second: the valid one with P = pairwise_acc when
    validity differs, a coin flip otherwise."""
    if valid_a == valid_b:
        return rng.randrange(2)
    first_is_valid = valid_a
    right = rng.random() < oracle.pairwise_acc
    return 0 if first_is_valid == right else 1


def knockout(valid: list[bool], winner_count: int, oracle: Oracle, rng: random.Random
             ) -> tuple[list[int], int]:
    """The pipeline's knockout with the simulated selector: (survivors, games played)."""
    ko = pv.Knockout(len(valid), winner_count, rng)
    while not ko.done:
        ko.record([play_oracle_game(valid[a], valid[b], oracle, rng)
                   for a, b in ko.next_pairs()])
    return ko.winners, ko.calls


def select_all(pool: pl.DataFrame, budget: int, cfg: Config, rng: random.Random,
               gen: np.random.Generator) -> dict[str, tuple[int, int]]:
    """{arm: (selected row of `pool`, calls spent)} for one problem's pool at budget B."""
    flaws, valid = pool["flaw"].to_list(), pool["valid"].to_list()
    n = pool.height
    out: dict[str, tuple[int, int]] = {}

    k, n_j = judge_plan(budget, n)
    scores = judge_scores(flaws[:k], n_j, cfg.oracle, gen)
    out["judge"] = (pv.select_by_score(range(k), scores, rng), k * n_j)

    k = genselect_plan(budget, n)
    winners, games = knockout(valid[:k], 1, cfg.oracle, rng)
    out["genselect"] = (winners[0], games)

    k, n_s, n_j = hybrid_plan(budget, n, cfg.survivor_ratio)
    winners, games = knockout(valid[:k], n_s, cfg.oracle, rng)
    scores = dict(zip(winners, judge_scores([flaws[i] for i in winners], n_j, cfg.oracle, gen)))
    pick = pv.select_by_score(winners, [scores.get(i, -1.0) for i in range(k)], rng)
    out["hybrid"] = (pick, games + len(winners) * n_j)

    out["majority"] = (pv.majority_vote(pool["final_answer"].to_list(), rng), 0)
    out["random"] = (rng.randrange(n), 0)
    return out


def matches_judge_at(m: dict[str, float], budgets: list[int]) -> float:
    """The smallest budget at which Hybrid's mean accuracy reaches Judge's at the largest budget
    (NaN if none): a description of the curves, not a test."""
    top = max(budgets)
    match = [b for b in sorted(budgets)
             if m[f"hybrid/B{b}/proof_acc_mean"] >= m[f"judge/B{top}/proof_acc_mean"]]
    return float(match[0]) if match else math.nan


def claim_pairs(budgets: list[int]) -> list[tuple[str, tuple[str, int], tuple[str, int]]]:
    """(metrics prefix, (method arm, budget), (baseline arm, budget)) of every claim tested."""
    top = max(budgets)
    out = [(f"claim/hybrid_vs_judge/B{b}/proof_acc", ("hybrid", b), ("judge", b))
           for b in sorted(budgets)]
    out += [(f"claim/hybrid_B{b}_vs_judge_B{top}/proof_acc", ("hybrid", b), ("judge", top))
            for b in sorted(budgets) if b < top]
    out.append((f"claim/hybrid_vs_genselect/B{top}/proof_acc", ("hybrid", top),
                ("genselect", top)))
    return out


def claims(df: pl.DataFrame, budgets: list[int], draws: int) -> dict[str, float]:
    """The predicted ordering by the claim rule (module docstring). `df`: one row per arm,
    budget, seed and problem with `valid`; the pairs are problems, seeds averaged."""
    acc = (df.group_by("arm", "budget", "problem_id")
           .agg(pl.col("valid").cast(pl.Float64).mean())
           .sort("problem_id"))

    def values(arm: str, budget: int) -> list[float]:
        return acc.filter((pl.col("arm") == arm) & (pl.col("budget") == budget))["valid"] \
            .to_list()

    m: dict[str, float] = {}
    for prefix, method, baseline in claim_pairs(budgets):
        m |= stats.claim_metrics(stats.claim(values(*method), values(*baseline), direction=1,
                                             method_ci="bootstrap", draws=draws, seed=0), prefix)
    return m


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.proofverify.candidates import expectations

    cands = read_parquet_checked(ctx.path(cfg.candidates) / "test.parquet", expectations("test"))
    problems = [g for _, g in cands.group_by(["problem_id"], maintain_order=True)]
    rows, ceiling = [], []
    for seed in cfg.seeds:
        for p, group in enumerate(problems):
            pid = group["problem_id"][0]
            gen = np.random.default_rng([ctx.seed, seed, p])
            pool = group[gen.integers(0, group.height, cfg.n_p).tolist()]   # with replacement
            ceiling.append(float(pool["valid"].any()))
            for budget in cfg.budgets:
                rng = random.Random(f"oracle:{ctx.seed}:{seed}:{pid}:{budget}")
                for arm, (i, calls) in select_all(pool, budget, cfg, rng, gen).items():
                    rows.append({"arm": arm, "seed": seed, "budget": budget, "problem_id": pid,
                                 "valid": pool["valid"][i],
                                 "answer_correct": pool["answer_correct"][i], "calls": calls})
    df = pl.DataFrame(rows)
    per_seed = (df.group_by("arm", "budget", "seed")
                .agg(pl.col("valid").cast(pl.Float64).mean().alias("proof_acc"),
                     pl.col("answer_correct").cast(pl.Float64).mean().alias("answer_acc"),
                     pl.col("calls").cast(pl.Float64).mean().alias("calls"))
                .sort("arm", "budget", "seed"))  # polars' group order varies run to run
    m: dict[str, float] = {"n_problems": float(len(problems)), "n_p": float(cfg.n_p),
                           "seeds": float(len(cfg.seeds)),
                           "pass_at_pool": sum(ceiling) / len(ceiling)}   # the ceiling
    plot_rows = []
    for arm in ARMS:
        for budget in cfg.budgets:
            g = per_seed.filter((pl.col("arm") == arm) & (pl.col("budget") == budget))
            for k in ("proof_acc", "answer_acc", "calls"):
                m[f"{arm}/B{budget}/{k}_mean"], m[f"{arm}/B{budget}/{k}_std"] = stats.mean_std(
                    g[k].to_list())
            plot_rows.append({"arm": arm, "budget": budget,
                              "calls": m[f"{arm}/B{budget}/calls_mean"],
                              "proof_acc": m[f"{arm}/B{budget}/proof_acc_mean"],
                              "answer_acc": m[f"{arm}/B{budget}/answer_acc_mean"]})
    log_method_runs(ctx, per_seed, cfg)
    m["hybrid_matches_judge_at"] = matches_judge_at(m, cfg.budgets)
    m |= claims(df, cfg.budgets, cfg.bootstrap)
    plot = ctx.pipeline_dir / cfg.plot
    plot.parent.mkdir(parents=True, exist_ok=True)
    with io.atomic_path(plot) as tmp:
        pl.DataFrame(plot_rows).write_csv(tmp)
    top = max(cfg.budgets)
    print(f"oracle: B = {top}: judge {m[f'judge/B{top}/proof_acc_mean']:.3f}, genselect "
          f"{m[f'genselect/B{top}/proof_acc_mean']:.3f}, hybrid "
          f"{m[f'hybrid/B{top}/proof_acc_mean']:.3f}, majority "
          f"{m[f'majority/B{top}/proof_acc_mean']:.3f}")
    return m


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many of the predicted orderings are reproduced / inconclusive /
    contradicted; every arm and budget in details/oracle.json."""
    return stats.verdict_counts(metrics)
