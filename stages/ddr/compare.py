"""Stage `compare`: DDR's predicted directions, by the house claim rule (stages.core.stats:
paired 95% t CI over the database seeds, at the main turn budget, sample-averaged accuracy on
the per-turn messages I_m).

    reactive_vs_breadth   reactive (checklist given) > proactive breadth-first; the paper's
                          Qwen3-Next: 43.2 vs 32.6 [secondary], effect +0.106
    breadth_vs_depth      breadth-first > depth-first at equal turns (spec section 4)
    entropy_accuracy      accuracy rises with exploration entropy: per seed, Spearman rho over
                          the proactive arms' episodes, against 0
    learned_vs_random     [ours] the learned explorer beats random queries (it learned to
                          explore at all); learned - breadth is its imitation gap, reported
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import stats

CLAIMS = {  # name: (method arm, baseline arm, paper effect)
    "reactive_vs_breadth": ("reactive", "breadth", 0.106),
    "breadth_vs_depth": ("breadth", "depth", None),
    "learned_vs_random": ("learned", "random", None),
}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: str = Field("acc_sample_m", description="per-seed metric the claims compare")


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    m = ctx.stage_metrics("score")
    b = int(m["main_budget"])
    seeds = sorted({int(k.split("/")[2][1:]) for k in m
                    if k.startswith(f"breadth/b{b}/s") and k.endswith(cfg.metric)})
    if len(seeds) < 2:
        raise ValueError(f"compare: {len(seeds)} seed(s) in details/score.json; paired CIs "
                         "need at least 2")
    out: dict[str, float] = {"main_budget": float(b), "seeds": float(len(seeds))}
    for name, (method, base, effect) in CLAIMS.items():
        if f"{method}/b{b}/{cfg.metric}" not in m or f"{base}/b{b}/{cfg.metric}" not in m:
            continue                                   # an arm not run at this profile
        c = stats.claim_by_key({s: m[f"{method}/b{b}/s{s}/{cfg.metric}"] for s in seeds},
                               {s: m[f"{base}/b{b}/s{s}/{cfg.metric}"] for s in seeds},
                               paper_effect=effect)
        out.update(stats.claim_metrics(c, f"claim/{name}"))
    rhos = {s: m.get(f"entropy_rho/s{s}", math.nan) for s in seeds}
    c = stats.claim_by_key(rhos, {s: 0.0 for s in seeds})
    out.update(stats.claim_metrics(c, "claim/entropy_accuracy"))
    if f"learned/b{b}/{cfg.metric}" in m:
        out["learned_minus_breadth"] = m[f"learned/b{b}/{cfg.metric}"] - \
            m[f"breadth/b{b}/{cfg.metric}"]
    return out


def headline(metrics: dict[str, float]) -> dict[str, float]:
    return stats.verdict_counts(metrics)


ARMS_SHOWN = ("learned", "breadth", "depth", "random", "reactive", "oracle")
NAMES = {"reactive_vs_breadth": "reactive > breadth-first (proactive)",
         "breadth_vs_depth": "breadth-first > depth-first, equal turns",
         "entropy_accuracy": "accuracy rises with exploration entropy (Spearman rho > 0)",
         "learned_vs_random": "[ours] learned explorer > random queries"}


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README block: accuracy per arm along the budget sweep, the main-budget table and the
    claims."""
    s, c = metrics.get("score", {}), metrics.get("compare", {})
    if "main_budget" not in s or not any(k.startswith("claim/") for k in c):
        return "_No results yet: run the pipeline._\n"
    b = int(s["main_budget"])
    budgets = sorted({int(k.split("/")[1][1:]) for k in s if k.startswith("breadth/b")
                      and k.count("/") == 2})
    arms = [a for a in ARMS_SHOWN if any(k.startswith(f"{a}/b") for k in s)]

    def f(key: str) -> str:
        v = s.get(key, math.nan)
        return "-" if not isinstance(v, float) or math.isnan(v) else f"{v:.3f}"

    lines = [f"**Checklist accuracy** at the main budget of {b} turns (mean over "
             f"{int(c.get('seeds', 0))} database seeds; _m: per-turn messages I_m, _t: final "
             "summary I_t; entropy and coverage over the 4 tables):", "",
             "| arm | acc sample (I_m) | acc item (I_m) | acc sample (I_t) | acc item (I_t) | "
             "incorrect | insufficient | entropy | coverage |", "|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        bb = max(budgets) if a == "oracle" else b
        k = f"{a}/b{bb}"
        # the oracle reads every fact and explores nothing: it has no turn budget (stored at
        # the largest one); its entropy and coverage are 0 by construction
        name = "oracle (all facts, no turns)" if a == "oracle" else a
        lines.append(f"| {name} | {f(k + '/acc_sample_m')} | {f(k + '/acc_item_m')} | "
                     f"{f(k + '/acc_sample_t')} | {f(k + '/acc_item_t')} | "
                     f"{f(k + '/incorrect_m')} | {f(k + '/insufficient_m')} | "
                     f"{f(k + '/entropy')} | {f(k + '/coverage')} |")
    lines += ["", "**Turn budget sweep** (sample-averaged accuracy on I_m):", "",
              "| arm | " + " | ".join(f"{x} turns" for x in budgets) + " |",
              "|---|" + "---|" * len(budgets)]
    for a in arms:
        if a != "oracle":
            lines.append(f"| {a} | " + " | ".join(f(f"{a}/b{x}/acc_sample_m") for x in budgets)
                         + " |")
    lines += ["", "**Claims** (paired 95% CI over database seeds, difference of sample-averaged "
              "accuracy; `plots/topk.csv` holds the top-k message curve):", ""]
    for name, label in NAMES.items():
        cl = stats.read_claim(c, f"claim/{name}")
        if cl is not None:
            lines.append(f"- {label}: {cl.sentence()}")
    if "learned_minus_breadth" in c:
        lines.append(f"- learned - breadth-first (its expert): {c['learned_minus_breadth']:+.3f}")
    return "\n".join(lines) + "\n"
