"""Stage `compare` of ProofVerify (arXiv 2511.13027): every selection rule side by side, mean ±
std over seeds.

Per arm (judge, genselect, hybrid, the ablation hybrid_lenient, and the baselines majority vote
on final answers and a random pick): selection accuracy at proof level (the selected candidate
is VALID: every step and the answer right) and at final-answer level, verifier calls per problem
and the parse-failure rate. For the judge's verdicts on all test candidates (one verdict = one
call; a malformed reply counts as not-Yes): precision / recall / F1 of the Yes class against
proof validity, the Yes rate per flaw class (valid, flaw b: right answer through a wrong step,
flaw a: wrong answer) and the final-answer precision on the balanced 3+/3- set (§2, our
reconstruction of the paper's definition). For the selector: the
share of games with one valid side that the valid side won, and the share won by position 1
(the position bias the paper warns about).

The paper's claims (§1: Hybrid is the best framework, "Hybrid > pure GenSelect ≈ pure Judge at
equal or lower compute") go through the house claim rule (`stats.claim`): Hybrid's proof-level
accuracy minus pure Judge's and minus pure GenSelect's, and Hybrid's verifier calls minus pure
Judge's, paired over problems (each rule's value on a problem averaged over seeds; percentile
bootstrap over problems: both rules chose from the same candidates, so the problem-to-problem
spread cancels), each reported with its verdict and minimum detectable effect. The other rules
get the paired difference and CI without a verdict (`diff/hybrid_<rule>_*`).

Outputs: `report/table.md`, `plots/selection.csv` (accuracy vs calls per arm, `dvc plots`) and
the flat metrics (`details/compare.json`; the verdict counts in `metrics/compare.json`) the README
table is rendered from.
"""

from __future__ import annotations

import math
import random
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io, stats
from stages.proofverify import proofverify as pv

SELECTORS = ("judge", "genselect", "hybrid", "hybrid_lenient")   # arms read from a stage output
ARMS = (*SELECTORS, "majority", "random")
# The paper's claims: (rival of Hybrid, value compared, direction: +1 Hybrid's is higher).
CLAIMS = (("judge", "proof_acc", 1), ("genselect", "proof_acc", 1), ("judge", "calls", -1))


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    candidates: str = Field("candidates", description="paths key of the candidates folder")
    judge: str = Field("judge_out", description="paths key of the judge stage output")
    genselect: str = Field("genselect_out", description="paths key of the genselect output")
    hybrid: str = Field("hybrid_out", description="paths key of the hybrid output")
    hybrid_lenient: str = Field("hybrid_lenient_out", description="paths key of the "
                                "hybrid_lenient output (the #Yes / #parseable ablation)")
    report: str = Field("report", description="paths key of the report folder")
    plot: str = Field("plots/selection.csv", description="plot CSV, relative to the pipeline")
    per_side: int = Field(3, ge=1, le=64, description="balanced set: right / wrong answers kept "
                          "per problem (spec: 3+/3-)")
    bootstrap: int = Field(2000, ge=100, le=100_000, description="bootstrap draws of the paired "
                           "95% CI of Hybrid minus each other rule, over problems [ours]")
    paper_hybrid_vs_judge: float | None = Field(
        None, description="the paper's Hybrid minus pure Judge proof-level accuracy (signed, a "
                          "fraction); null: the paper gives no number")
    paper_hybrid_vs_genselect: float | None = Field(
        None, description="the paper's Hybrid minus pure GenSelect proof-level accuracy (signed, a "
                          "fraction); null: the paper gives no number")
    paper_hybrid_vs_judge_calls: float | None = Field(
        None, description="the paper's Hybrid minus pure Judge verifier calls per problem (signed) "
                          "at this run's n_p, n_s, n_j; null: the paper quotes them at n_p = 256 "
                          "only")

    def paper_effect(self, rival: str, value: str) -> float | None:
        return {("judge", "proof_acc"): self.paper_hybrid_vs_judge,
                ("genselect", "proof_acc"): self.paper_hybrid_vs_genselect,
                ("judge", "calls"): self.paper_hybrid_vs_judge_calls}[(rival, value)]


def baseline_selections(cands: pl.DataFrame, seeds: list[int]) -> pl.DataFrame:
    """Majority vote on final answers and a random pick, per seed and problem (0 calls)."""
    rows = []
    for seed in seeds:
        for k, ((pid,), g) in enumerate(cands.group_by(["problem_id"], maintain_order=True)):
            ids = g["candidate_id"].to_list()
            maj = pv.majority_vote(g["final_answer"].to_list(), random.Random(f"maj:{seed}:{k}"))
            rnd = random.Random(f"rand:{seed}:{k}").randrange(len(ids))
            for method, pick in (("majority", maj), ("random", rnd)):
                rows.append({"method": method, "seed": seed, "problem_id": pid,
                             "selected_id": ids[pick], "calls": 0, "parse_failures": 0})
    return pl.DataFrame(rows)


SCORES = ("proof_acc", "answer_acc", "calls", "parse_fail_rate")  # per (rule, seed)


def per_seed(sel: pl.DataFrame, cands: pl.DataFrame) -> pl.DataFrame:
    """One row per (method, seed): the `SCORES` of that rule's selections on that seed."""
    lab = cands.select(pl.col("candidate_id").alias("selected_id"), "valid", "answer_correct")
    joined = sel.join(lab, on="selected_id", how="left")
    if joined["valid"].null_count():
        raise ValueError("a selection names a candidate that is not in candidates/test.parquet")
    return (joined.group_by(["method", "seed"])
            .agg(pl.col("valid").mean().alias("proof_acc"),
                 pl.col("answer_correct").mean().alias("answer_acc"),
                 pl.col("calls").cast(pl.Float64).mean().alias("calls"),
                 (pl.col("parse_failures").sum() / pl.col("calls").sum().clip(1))
                 .alias("parse_fail_rate"))
            .sort(["method", "seed"]))


# A rule's settings as MLflow params of its runs: the fields of its stage config that shape the
# selection, and its verifier (the baselines have none).
RULE_PARAMS = ("n_j", "winner_count", "survivor_score", "temperature", "max_new_tokens",
               "prompt_style")


def log_method_runs(ctx: Any, per: pl.DataFrame) -> None:
    """One MLflow run per (rule, seed) under this stage's run: params `method`, `seed` and the
    rule's settings (its params section, profile applied), metrics `SCORES`, the same for every
    rule, so MLflow's Compare shows the rules side by side."""
    from stages.core.config import validate_section
    from stages.proofverify.select import Config as RuleConfig

    settings: dict[str, dict[str, Any]] = {}
    for rule in SELECTORS:   # each selector's params section (validated before any compute)
        if rule in ctx.params:
            rc = validate_section(RuleConfig, ctx.params, rule, ctx.profile, "params")
            settings[rule] = {**{k: getattr(rc, k) for k in RULE_PARAMS},
                              "verifier": rc.backend.model}
    for method, seed, *values in per.select("method", "seed", *SCORES).iter_rows():
        params = {"method": method, "seed": seed, **settings.get(method, {})}
        with ctx.method_run("compare", method, seed, params=params) as run:
            run.log_metrics(dict(zip(SCORES, map(float, values))))


def arm_metrics(sel: pl.DataFrame, cands: pl.DataFrame) -> dict[str, float]:
    """`<arm>/<metric>_mean|_std` over seeds for every method in `sel`."""
    per = per_seed(sel, cands)
    m: dict[str, float] = {}
    for method in per["method"].unique().sort().to_list():
        p = per.filter(pl.col("method") == method)
        for key in ("proof_acc", "answer_acc", "calls", "parse_fail_rate"):
            m[f"{method}/{key}_mean"], m[f"{method}/{key}_std"] = stats.mean_std(
                p[key].to_list())
    return m


def per_problem(sel: pl.DataFrame, cands: pl.DataFrame) -> dict[str, pl.DataFrame]:
    """{"proof_acc" | "calls": problem_id x method}: each rule's proof-level accuracy and calls
    on a problem, averaged over seeds (the pairs of every paired comparison here)."""
    lab = cands.select(pl.col("candidate_id").alias("selected_id"), "valid")
    per = (sel.join(lab, on="selected_id", how="left")
           .group_by(["method", "problem_id"])
           .agg(pl.col("valid").cast(pl.Float64).mean().alias("proof_acc"),
                pl.col("calls").cast(pl.Float64).mean().alias("calls")))
    return {v: per.pivot(on="method", index="problem_id", values=v).sort("problem_id")
            for v in ("proof_acc", "calls")}


def paired_vs_hybrid(sel: pl.DataFrame, cands: pl.DataFrame, draws: int) -> dict[str, float]:
    """`diff/hybrid_<rule>_{mean,ci_low,ci_high}` for every rule the paper makes no claim about
    (majority, random, hybrid_lenient): Hybrid's proof-level accuracy minus the rule's, paired
    over problems (accuracy per problem averaged over seeds), bootstrap 95% CI."""
    acc = per_problem(sel, cands)["proof_acc"]
    claimed = {rival for rival, _, _ in CLAIMS}
    m: dict[str, float] = {}
    for rule in ARMS:
        if rule != "hybrid" and rule not in claimed and rule in acc.columns:
            mean, lo, hi = stats.paired_ci(acc["hybrid"].to_list(), acc[rule].to_list(),
                                           method="bootstrap", draws=draws, seed=0)
            m |= {f"diff/hybrid_{rule}_mean": mean, f"diff/hybrid_{rule}_ci_low": lo,
                  f"diff/hybrid_{rule}_ci_high": hi}
    return m


def claim_prefix(rival: str, value: str) -> str:
    return f"claim/hybrid_vs_{rival}/{value}"


def hybrid_claims(sel: pl.DataFrame, cands: pl.DataFrame, cfg: Config) -> dict[str, float]:
    """The paper's claims about Hybrid (`CLAIMS`), each by the house claim rule on values paired
    over problems, percentile bootstrap over problems (`cfg.bootstrap` draws, seed 0)."""
    tables = per_problem(sel, cands)
    m: dict[str, float] = {}
    for rival, value, direction in CLAIMS:
        t = tables[value]
        c = stats.claim(t["hybrid"].to_list(), t[rival].to_list(), direction=direction,
                        paper_effect=cfg.paper_effect(rival, value), method_ci="bootstrap",
                        draws=cfg.bootstrap, seed=0)
        m |= stats.claim_metrics(c, claim_prefix(rival, value))
    return m


def judge_metrics(votes: pl.DataFrame, cands: pl.DataFrame, per_side: int) -> dict[str, float]:
    """Pointwise judge quality per seed (every verdict one prediction), mean ± std over seeds."""
    test = cands.select("candidate_id", "valid", "answer_correct", "flaw", "problem_id")
    idx = pv.balanced_indices(test["problem_id"].to_list(), test["answer_correct"].to_list(),
                              per_side)
    balanced = set(test["candidate_id"].gather(idx).to_list()) if idx else set()
    per_seed: dict[str, list[float]] = {}
    for (seed,), v in votes.group_by(["seed"], maintain_order=True):
        j = v.join(test, on="candidate_id", how="left")
        yes = j["verdict"].fill_null(False).to_list()
        scores = pv.precision_recall_f1(yes, j["valid"].to_list())
        for flaw, name in (("none", "yes_rate_valid"), ("b", "yes_rate_flaw_b"),
                           ("a", "yes_rate_flaw_a")):
            f = j.filter(pl.col("flaw") == flaw)
            scores[name] = float(f["verdict"].fill_null(False).mean()) if f.height else math.nan
        b = j.filter(pl.col("candidate_id").is_in(list(balanced)))
        scores["fa_precision"] = pv.final_answer_precision(
            b["verdict"].fill_null(False).to_list(), b["answer_correct"].to_list())
        scores["parse_fail_rate"] = j["verdict"].null_count() / j.height
        for k, val in scores.items():
            per_seed.setdefault(k, []).append(val)
    m: dict[str, float] = {"judge_eval/balanced_problems": len(idx) / (2 * per_side)}
    for k, vals in per_seed.items():
        m[f"judge_eval/{k}_mean"], m[f"judge_eval/{k}_std"] = stats.mean_std(vals)
    return m


def selector_metrics(games: pl.DataFrame, cands: pl.DataFrame, arm: str) -> dict[str, float]:
    """Pairwise accuracy on games with exactly one valid side; share won by position 1."""
    valid = dict(zip(cands["candidate_id"], cands["valid"]))
    decided = games.filter(pl.col("choice").is_not_null())
    mixed = [(w, f, s) for w, f, s in zip(games["winner_id"], games["first_id"],
                                          games["second_id"]) if valid[f] != valid[s]]
    return {f"{arm}/pairwise_acc": (sum(valid[w] for w, _, _ in mixed) / len(mixed)
                                    if mixed else math.nan),
            f"{arm}/mixed_games": float(len(mixed)),
            f"{arm}/first_wins": (float((decided["choice"] == 0).mean())
                                  if decided.height else math.nan)}


def check_same_cover(sels: dict[str, pl.DataFrame]) -> None:
    """The arms are compared paired, so each must have selected on the same (seed, problem)
    pairs as the first; otherwise a clear error (not a null in the paired table)."""
    (first, ref), *rest = [(a, set(s.select("seed", "problem_id").iter_rows()))
                           for a, s in sels.items()]
    for arm, cover in rest:
        if cover != ref:
            raise ValueError(
                f"compare: {arm}/selections.parquet covers {len(cover)} (seed, problem) pairs, "
                f"{first}'s {len(ref)}, {len(cover ^ ref)} not in both; rerun "
                f"{', '.join(sels)} with the same seeds and max_problems")


def selections_spec() -> Any:
    """A selector's picks (stages.proofverify.select SELECTIONS): one per (seed, problem),
    counts never negative."""
    from stages.core.checks import spec_from_schema
    from stages.proofverify.select import SELECTIONS

    return spec_from_schema(SELECTIONS, **{k: {"min": 0} for k, t in SELECTIONS.items()
                                           if t == pl.Int64 and k != "seed"})


def games_spec() -> Any:
    """Knockout games (stages.proofverify.select GAMES); `choice` None = an unparseable reply
    (the game's `winner_id` is then the fallback pick)."""
    from dataclasses import replace

    from stages.core.checks import spec_from_schema
    from stages.proofverify.select import GAMES

    spec = spec_from_schema(GAMES, round={"min": 0}, choice={"values": [0, 1]})
    spec.columns["choice"] = replace(spec.columns["choice"], nullable=True)
    return spec


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.proofverify.candidates import expectations
    from stages.proofverify.select import _votes_spec as votes_spec

    cands = read_parquet_checked(ctx.path(cfg.candidates) / "test.parquet", expectations("test"))
    # hybrid_lenient's stage writes method = hybrid: every arm is labelled by where it came from
    sels = [read_parquet_checked(ctx.path(getattr(cfg, a)) / "selections.parquet",
                                 selections_spec()).with_columns(pl.lit(a).alias("method"))
            for a in SELECTORS]
    check_same_cover(dict(zip(SELECTORS, sels)))
    seeds = sorted(set(sels[0]["seed"].to_list()))
    used = set(sels[0]["problem_id"].to_list())
    cands = cands.filter(pl.col("problem_id").is_in(list(used)))
    base = baseline_selections(cands, seeds)
    cols = ["method", "seed", "problem_id", "selected_id", "calls", "parse_failures"]
    sel = pl.concat([s.select(cols) for s in sels]
                    + [base.select(cols).cast({"calls": pl.Int64, "parse_failures": pl.Int64})])
    m = arm_metrics(sel, cands)
    log_method_runs(ctx, per_seed(sel, cands))
    votes = read_parquet_checked(ctx.path(cfg.judge) / "votes.parquet", votes_spec())
    m |= judge_metrics(votes, cands, cfg.per_side)
    for arm in ("genselect", "hybrid", "hybrid_lenient"):
        m |= selector_metrics(read_parquet_checked(ctx.path(getattr(cfg, arm)) / "games.parquet",
                                                   games_spec()), cands, arm)
    per = cands.group_by("problem_id").agg(pl.col("valid").any(), pl.col("answer_correct").any(),
                                           pl.col("valid").mean().alias("p1")).sort("problem_id")
    m |= {"oracle/proof_acc": float(per["valid"].mean()),
          "oracle/answer_acc": float(per["answer_correct"].mean()),
          "pass_at_1/proof_acc": float(per["p1"].mean()),
          "flaw_b_share": float((cands["flaw"] == "b").mean()),
          "n_problems": float(per.height), "n_p": float(cands.height / per.height),
          "seeds": float(len(seeds))}
    # The paper's ordering "Hybrid > pure Judge, pure GenSelect at equal or lower compute" by the
    # claim rule (a higher mean inside the noise is not a reproduction); the rest as differences.
    m |= hybrid_claims(sel, cands, cfg)
    m |= paired_vs_hybrid(sel, cands, cfg.bootstrap)
    tables: dict[str, dict[str, Any]] = {"compare": m}
    if (ctx.details_dir / "oracle.json").is_file():   # stage `oracle`, when it has run
        tables["oracle"] = ctx.stage_metrics("oracle")
    with io.atomic_path(ctx.path(cfg.report), is_dir=True) as tmp:
        io.write_text(tmp / "table.md", results_table(tables))
    plot = ctx.pipeline_dir / cfg.plot
    plot.parent.mkdir(parents=True, exist_ok=True)
    with io.atomic_path(plot) as tmp:
        pl.DataFrame([{"arm": a, "calls_per_problem": m[f"{a}/calls_mean"],
                       "proof_acc": m[f"{a}/proof_acc_mean"],
                       "answer_acc": m[f"{a}/answer_acc_mean"]} for a in ARMS]).write_csv(tmp)
    return m


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README tables from the compare metrics: arms as rows, nothing typed by hand."""
    m = metrics.get("compare", {})
    if "judge/proof_acc_mean" not in m:
        return "_No results yet: run the pipeline._\n"

    def pm(key: str, fmt: str = ".3f") -> str:
        mean, std = m.get(f"{key}_mean", math.nan), m.get(f"{key}_std", math.nan)
        return "–" if math.isnan(mean) else f"{mean:{fmt}} ± {std:{fmt}}"

    def one(key: str, fmt: str = ".3f") -> str:
        v = m.get(key, math.nan)
        return "–" if isinstance(v, float) and math.isnan(v) else f"{v:{fmt}}"

    def diff(rule: str) -> str:
        k = f"diff/hybrid_{rule}"
        if f"{k}_mean" not in m:
            return "–"
        return f"{m[f'{k}_mean']:+.3f} [{m[f'{k}_ci_low']:+.3f}, {m[f'{k}_ci_high']:+.3f}]"

    def claim(rival: str, value: str) -> str:
        prefix = claim_prefix(rival, value)
        c = stats.read_claim(m, prefix)
        return "not run" if c is None else c.sentence("{:+.1f}" if value == "calls" else "{:+.3f}")

    names = {"judge": "pure Judge", "genselect": "pure GenSelect", "hybrid": "Hybrid",
             "hybrid_lenient": "Hybrid, lenient score (ablation)",
             "majority": "majority vote (final answers)", "random": "random pick"}
    others = [r for r in ARMS if f"diff/hybrid_{r}_mean" in m]
    lines = [f"{m['n_problems']:.0f} held-out problems, n_p = {m['n_p']:.0f} candidates each, "
             f"{m['seeds']:.0f} seeds (mean ± std); {m['flaw_b_share']:.1%} of the candidates "
             "reach the right answer through a wrong step (flaw b).", "",
             "| selection | proof-level acc | final-answer acc | verifier calls / problem | "
             "parse failures | pairwise acc (valid vs invalid) |",
             "|---|---|---|---|---|---|"]
    for a in ARMS:
        lines.append(f"| {names[a]} | {pm(f'{a}/proof_acc')} | {pm(f'{a}/answer_acc')} "
                     f"| {pm(f'{a}/calls', '.1f')} | {pm(f'{a}/parse_fail_rate', '.3f')} "
                     f"| {one(f'{a}/pairwise_acc')} |")
    lines += [f"| pass@1 (expected) | {one('pass_at_1/proof_acc')} | – | – | – | – |",
              f"| oracle (pass@n_p) | {one('oracle/proof_acc')} | {one('oracle/answer_acc')} "
              "| – | – | – |", "",
              "Judge verdicts on every test candidate (one verdict per call; malformed = not Yes):",
              "", "| precision | recall | F1 | Yes on valid | Yes on flaw b | Yes on flaw a | "
              "final-answer precision (3+/3-) | parse failures |",
              "|---|---|---|---|---|---|---|---|",
              "| " + " | ".join(pm(f"judge_eval/{k}") for k in (
                  "precision", "recall", "f1", "yes_rate_valid", "yes_rate_flaw_b",
                  "yes_rate_flaw_a", "fa_precision", "parse_fail_rate")) + " |", "",
              f"Selector position bias: position 1 wins {one('genselect/first_wins', '.1%')} of "
              f"parsed games (GenSelect), {one('hybrid/first_wins', '.1%')} (Hybrid).", "",
              "The paper's claims, Hybrid minus the rival, paired over problems (seeds "
              "averaged), mean [bootstrap 95% CI], verdict by the house rule:", "",
              f"- Hybrid beats pure Judge at proof level: {claim('judge', 'proof_acc')}",
              f"- Hybrid beats pure GenSelect at proof level: {claim('genselect', 'proof_acc')}",
              "- Hybrid spends fewer verifier calls per problem than pure Judge: "
              f"{claim('judge', 'calls')}"]
    if others:
        lines += ["", "Hybrid minus the other rules, proof-level accuracy, paired over problems "
                  "(seeds averaged), mean [bootstrap 95% CI]: "
                  + "; ".join(f"{names[r]} {diff(r)}" for r in others) + "."]
    if metrics.get("oracle"):
        lines += ["", *oracle_table(metrics["oracle"])]
    return "\n".join(lines) + "\n"


def oracle_table(o: dict[str, Any]) -> list[str]:
    """The simulated-oracle budget sweep (stage `oracle`): proof-level accuracy per arm and
    budget B, mean ± std over seeds, with the calls each arm actually spent."""
    budgets = sorted({int(k.split("/")[1][1:]) for k in o if k.startswith("judge/B")
                      and k.endswith("/proof_acc_mean")})

    def cell(arm: str, b: int) -> str:
        mean, std = o[f"{arm}/B{b}/proof_acc_mean"], o[f"{arm}/B{b}/proof_acc_std"]
        calls = o[f"{arm}/B{b}/calls_mean"]
        return f"{mean:.3f} ± {std:.3f} ({calls:.0f})"

    names = {"judge": "pure Judge", "genselect": "pure GenSelect", "hybrid": "Hybrid",
             "majority": "majority vote", "random": "random pick"}
    match = o.get("hybrid_matches_judge_at", math.nan)
    top = budgets[-1]

    def claim(prefix: str) -> str:
        c = stats.read_claim(o, prefix)
        return "not run" if c is None else c.sentence()

    return [f"**Simulated-oracle mode** (stage `oracle`): verifiers with set error rates, "
            f"{o['n_problems']:.0f} problems, pools of n_p = {o['n_p']:.0f} drawn from each "
            f"problem's candidates, {o['seeds']:.0f} seeds. Proof-level accuracy, mean ± std "
            f"(calls spent per problem) at a budget of B calls; a valid candidate is in the pool "
            f"for {o['pass_at_pool']:.1%} of problem draws (the ceiling).", "",
            "| selection | " + " | ".join(f"B = {b}" for b in budgets) + " |",
            "|---|" + "---|" * len(budgets),
            *(f"| {names[a]} | " + " | ".join(cell(a, b) for b in budgets) + " |"
              for a in names if f"{a}/B{budgets[0]}/proof_acc_mean" in o),
            "", f"Hybrid's mean reaches pure Judge's at B = {top} from B = "
            f"{'never' if math.isnan(match) else f'{match:.0f}'}. The predicted ordering "
            "(oracle mode), Hybrid minus the rival, paired over problems (seeds averaged), mean "
            "[bootstrap 95% CI], verdict by the house rule:", "",
            *(f"- Hybrid ≥ pure Judge at B = {b}: "
              f"{claim(f'claim/hybrid_vs_judge/B{b}/proof_acc')}" for b in budgets),
            *(f"- Hybrid at B = {b} ≥ pure Judge at B = {top}: "
              f"{claim(f'claim/hybrid_B{b}_vs_judge_B{top}/proof_acc')}"
              for b in budgets if b < top),
            f"- Hybrid ≥ pure GenSelect at B = {top}: "
            f"{claim(f'claim/hybrid_vs_genselect/B{top}/proof_acc')}"]


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many claims are reproduced / inconclusive / contradicted; each claim and
    every arm's numbers in details/compare.json."""
    return stats.verdict_counts(metrics)
