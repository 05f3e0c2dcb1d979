"""Stage `score`: the judge over every run, at every turn budget, plus the all-facts oracle.

For each (arm, seed, entity) and budget b, the messages I_m are the insights of the first b
turns and I_t their summary (stages.ddr.judge); every checklist item is judged against both.
The `oracle` arm states every gold fact in one message: it must score 100% (a check that the
checklist, the fact vocabulary and the judge agree). Exploration entropy and table coverage
per episode come from the tables each turn touched (stages.ddr.env.exploration_entropy).

Outputs: `paths.ddr_scores` (one row per arm, seed, budget, entity, item: both verdicts and
the supporting turns), `plots/topk.csv` (the top-k message curve at the largest budget) and,
per (arm, seed), an MLflow method run with the accuracies along the budget sweep.
"""

from __future__ import annotations

import json
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io
from stages.core.checks import read_parquet_checked
from stages.ddr.databases import checklist_spec
from stages.ddr.env import exploration_entropy
from stages.ddr.explore import insight_spec
from stages.ddr.judge import (CORRECT, FactMatchJudge, ItemSpec, accuracies, check_contract,
                              correct_at_k, summary_message)
from stages.ddr.world import TABLES


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str] = Field(min_length=1, description="the arms `explore` ran")
    budgets: list[int] = Field(min_length=1, description="turn budgets of the sweep")
    main_budget: int = Field(ge=1, description="the budget the claims are read at")
    judge: str = Field("fact_match", description="fact_match (deterministic); an LLM judge "
                       "through the backend would plug in here")

    @field_validator("budgets")
    @classmethod
    def _sorted(cls, v: list[int]) -> list[int]:
        if v != sorted(set(v)) or v[0] < 1:
            raise ValueError(f"score.budgets {v}: distinct, increasing, >= 1")
        return v

    def model_post_init(self, _: Any) -> None:
        if self.main_budget not in self.budgets:
            raise ValueError(f"score.main_budget {self.main_budget} is not one of the budgets "
                             f"{self.budgets}")
        if self.judge != "fact_match":
            raise ValueError(f"score.judge {self.judge!r}: only 'fact_match' is built")


def item_specs(checklist: pl.DataFrame) -> dict[tuple[int, int], list[tuple[str, ItemSpec]]]:
    out: dict[tuple[int, int], list[tuple[str, ItemSpec]]] = {}
    for r in checklist.iter_rows(named=True):
        out.setdefault((r["seed"], r["entity"]), []).append(
            (r["item_id"], ItemSpec(r["question"], r["answer"], r["aspect"],
                                    json.loads(r["binding"]), r["kind"])))
    return out


def oracle_messages(specs: list[tuple[str, ItemSpec]]) -> list[list[dict[str, str]]]:
    return [[{**s.binding, s.aspect: s.answer} for _, s in specs]]


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    checklist = read_parquet_checked(ctx.path("ddr_databases") / "checklist.parquet",
                                     checklist_spec()).filter(pl.col("split") == "eval")
    specs = item_specs(checklist)
    seeds = sorted(checklist["seed"].unique())
    judge = FactMatchJudge()
    rows, episodes = [], []
    out: dict[str, float] = {"main_budget": float(cfg.main_budget)}
    top = max(cfg.budgets)
    insights = read_parquet_checked(ctx.path("ddr_runs") / "insights.parquet", insight_spec())
    for arm in [*cfg.arms, "oracle"]:
        for seed in seeds:
            if arm == "oracle":
                msgs = {e: oracle_messages(specs[(seed, e)]) for s, e in specs if s == seed}
                doms = {e: [] for e in msgs}
            else:
                ins = insights.filter((pl.col("arm") == arm) & (pl.col("seed") == seed)) \
                    .sort("entity", "turn")
                # an episode the budget stopped before its first turn stated nothing
                msgs = {e: [] for s, e in specs if s == seed}
                doms = {e: [] for e in msgs}
                for (e,), g in ins.group_by("entity", maintain_order=True):
                    if e not in msgs:
                        raise ValueError(f"{arm}/seed{seed}: turns of entity {e}, which has no "
                                         "checklist")
                    msgs[e] = [json.loads(f) for f in g["facts"]]
                    doms[e] = [json.loads(d) for d in g["domains"]]
            for b in ([top] if arm == "oracle" else cfg.budgets):
                for e, m in msgs.items():
                    seen = m[:b]
                    summary = summary_message(seen)
                    for item_id, spec in specs[(seed, e)]:
                        vm = check_contract(judge.judge(spec, seen), len(seen))
                        vt = check_contract(judge.judge(spec, summary), 1)
                        rows.append({"arm": arm, "seed": seed, "budget": b, "entity": e,
                                     "item_id": item_id, "quality_m": vm["context_quality"],
                                     "quality_t": vt["context_quality"],
                                     "support": json.dumps(vm["supporting_message_indices"]),
                                     "topk": [correct_at_k(vm, k) for k in range(1, top + 1)]
                                     if b == top else None})
                    d = doms[e][:b]
                    episodes.append({"arm": arm, "seed": seed, "budget": b, "entity": e,
                                     "entropy": exploration_entropy(d, len(TABLES)),
                                     "coverage": len({t for ts in d for t in ts}) / len(TABLES)})
    df = pl.DataFrame(rows, infer_schema_length=None)  # `topk` is null until the top budget
    ep = pl.DataFrame(episodes)
    for (arm, seed, b), g in df.group_by("arm", "seed", "budget", maintain_order=True):
        am = accuracies(list(zip(g["entity"], g["quality_m"])))
        at = accuracies(list(zip(g["entity"], g["quality_t"])))
        e = ep.filter((pl.col("arm") == arm) & (pl.col("seed") == seed) & (pl.col("budget") == b))
        key = f"{arm}/b{b}/s{seed}"
        out.update({f"{key}/acc_sample_m": am["acc_sample"], f"{key}/acc_item_m": am["acc_item"],
                    f"{key}/acc_sample_t": at["acc_sample"], f"{key}/acc_item_t": at["acc_item"],
                    f"{key}/incorrect_m": am["incorrect"],
                    f"{key}/insufficient_m": am["insufficient"],
                    f"{key}/entropy": float(e["entropy"].mean()),
                    f"{key}/coverage": float(e["coverage"].mean())})
    # means over seeds
    for arm in [*cfg.arms, "oracle"]:
        for b in ([top] if arm == "oracle" else cfg.budgets):
            for m in ("acc_sample_m", "acc_item_m", "acc_sample_t", "acc_item_t", "entropy",
                      "coverage", "incorrect_m", "insufficient_m"):
                vals = [out[f"{arm}/b{b}/s{s}/{m}"] for s in seeds]
                out[f"{arm}/b{b}/{m}"] = sum(vals) / len(vals)
    # entropy vs accuracy over the episodes of the proactive arms at the main budget
    from stages.core.stats import spearman

    per_ep = df.group_by("arm", "seed", "budget", "entity").agg(
        acc=(pl.col("quality_m") == CORRECT).mean()).join(
        ep, on=["arm", "seed", "budget", "entity"]).sort("arm", "seed", "budget", "entity")
    for seed in seeds:
        g = per_ep.filter((pl.col("budget") == cfg.main_budget) & (pl.col("seed") == seed)
                          & pl.col("arm").is_in([a for a in cfg.arms if a != "reactive"]))
        out[f"entropy_rho/s{seed}"] = spearman(g["entropy"].to_list(), g["acc"].to_list())
    # top-k curve at the largest budget, item-averaged, mean over seeds
    curve = {}
    for arm in [*cfg.arms, "oracle"]:
        g = df.filter((pl.col("arm") == arm) & (pl.col("budget") == top))
        mat = g["topk"].to_list()
        curve[arm] = [sum(r[k] for r in mat) / len(mat) for k in range(top)]
    lines = ["k," + ",".join(curve)] + [f"{k + 1}," + ",".join(f"{curve[a][k]:.4f}" for a in curve)
                                         for k in range(top)]
    io.write_text(ctx.pipeline_dir / "plots" / "topk.csv", "\n".join(lines) + "\n")
    with io.atomic_path(ctx.path("ddr_scores")) as tmp:
        df.drop("topk").write_parquet(tmp)
    for arm in [*cfg.arms, "oracle"]:
        for seed in seeds:
            with ctx.method_run("score", arm, int(seed), params={"arm": arm, "seed": int(seed),
                                                              "max_turns": top}) as run_:
                for b in ([top] if arm == "oracle" else cfg.budgets):
                    run_.log_metrics({m: out[f"{arm}/b{b}/s{seed}/{m}"] for m in
                                      ("acc_sample_m", "acc_item_m", "acc_sample_t",
                                       "acc_item_t", "entropy", "coverage")}, step=b)
    return out


def headline(details: dict[str, float]) -> dict[str, float]:
    """DVC metrics: sample-averaged accuracy (I_m) at the main budget of the learned explorer,
    its expert and the reactive arm; every arm, budget and seed in details/score.json."""
    b = int(details["main_budget"])
    return {a: details[f"{a}/b{b}/acc_sample_m"] for a in ("learned", "breadth", "reactive")
            if f"{a}/b{b}/acc_sample_m" in details}
