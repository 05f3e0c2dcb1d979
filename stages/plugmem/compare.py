"""Stage `compare`: PlugMem's predicted directions, by the house claim rule (stages.core.stats:
paired 95% t CI over corpus seed x noise level cells, per-cell means over the questions).

    acc_vs_raw          PlugMem >= raw-memory retrieval in accuracy; LongMemEval 75.1 vs 71.2
                        [secondary], effect +0.039
    acc_vs_bm25         PlugMem vs BM25 chunk retrieval (ours: a second task-agnostic baseline)
    tokens_vs_raw       PlugMem puts fewer memory tokens in the reader's prompt ("several times
                        fewer"): relative difference (plugmem - raw) / raw, direction -1
    density_vs_raw      higher information density [reconstructed definition]
    updates_vs_raw      "later fact wins": PlugMem's accuracy on update questions > raw's
    reasoning           PlugMem > PlugMem without the reasoning step (accuracy)
    tags                PlugMem > PlugMem without tags (accuracy)
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict

from stages.core import stats
from stages.plugmem.graph import LINE_BUCKETS

# name: (method arm, baseline arm, metric, direction, relative, paper effect)
CLAIMS = {
    "acc_vs_raw": ("plugmem", "raw", "acc", 1, False, 0.039),
    "acc_vs_bm25": ("plugmem", "bm25", "acc", 1, False, None),
    "tokens_vs_raw": ("plugmem", "raw", "tokens", -1, True, None),
    "density_vs_raw": ("plugmem", "raw", "density", 1, False, None),
    "updates_vs_raw": ("plugmem", "raw", "acc_update", 1, False, None),
    "reasoning": ("plugmem", "plugmem_no_reasoning", "acc", 1, False, None),
    "tags": ("plugmem", "plugmem_no_tags", "acc", 1, False, None),
}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


def cells(m: dict[str, float], arm: str, metric: str) -> dict[str, float]:
    """{'n<noise>/s<seed>': value} of one arm's per-cell metric."""
    pre = f"{arm}/"
    return {k[len(pre):-len(metric) - 1]: v for k, v in m.items()
            if k.startswith(pre) and k.endswith(f"/{metric}") and k.count("/") == 3}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    m = ctx.stage_metrics("answer")
    out: dict[str, float] = {}
    n_cells = len(cells(m, "none", "acc"))
    if n_cells < 2:
        raise ValueError(f"compare: {n_cells} seed x noise cell(s) in details/answer.json; "
                         "paired CIs need at least 2")
    out["cells"] = float(n_cells)
    for name, (method, base, metric, direction, relative, effect) in CLAIMS.items():
        a, b = cells(m, method, metric), cells(m, base, metric)
        if not a or not b:
            continue                                    # an arm not run at this profile
        c = stats.claim_by_key(a, b, direction=direction, relative=relative, paper_effect=effect)
        out.update(stats.claim_metrics(c, f"claim/{name}"))
    if "oracle/acc" in m and "plugmem/acc" in m:
        out["structurer_gap"] = m["oracle/acc"] - m["plugmem/acc"]
    if "plugmem/tokens" in m and "raw/tokens" in m and m["plugmem/tokens"] > 0:
        out["token_ratio_raw_over_plugmem"] = m["raw/tokens"] / m["plugmem/tokens"]
    return out


def headline(metrics: dict[str, float]) -> dict[str, float]:
    return stats.verdict_counts(metrics)


ARMS_SHOWN = ("none", "raw", "bm25", "plugmem", "plugmem_no_reasoning", "plugmem_no_tags",
              "oracle")
LABELS = {"oracle": "oracle parser [upper bound]"}
NAMES = {"acc_vs_raw": "PlugMem >= raw-chunk retrieval, accuracy",
         "acc_vs_bm25": "PlugMem >= BM25 retrieval, accuracy",
         "tokens_vs_raw": "PlugMem uses fewer memory tokens than raw retrieval (relative)",
         "density_vs_raw": "PlugMem has the higher density [reconstructed]",
         "updates_vs_raw": "update questions (later fact wins): PlugMem > raw",
         "reasoning": "reasoning step helps (PlugMem > without reasoning)",
         "tags": "tags help (PlugMem > without tags)"}


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README block: per arm accuracy, by kind, tokens, perfect reader, density; claims."""
    a, c = metrics.get("answer", {}), metrics.get("compare", {})
    s, mm = metrics.get("structure", {}), metrics.get("memory", {})
    if not any(k.startswith("claim/") for k in c):
        return "_No results yet: run the pipeline._\n"

    def f(key: str, src: dict = a, fmt: str = "{:.3f}") -> str:
        v = src.get(key, math.nan)
        return "-" if not isinstance(v, (int, float)) or math.isnan(v) else fmt.format(v)

    arms = [x for x in ARMS_SHOWN if f"{x}/acc" in a]
    lines = [f"**Reader accuracy** (learned reader; mean over {int(c.get('cells', 0))} corpus "
             "seed x noise cells; tokens = memory tokens in the reader's prompt, its own "
             "tokenizer; perfect = the perfect reader on the same memory [upper bound]; density "
             "= (acc - acc_none) per 1k memory tokens [reconstructed]):", "",
             "| arm | acc | single | update | two-hop | tokens | perfect reader | density |",
             "|---|---|---|---|---|---|---|---|"]
    for x in arms:
        lines.append(f"| {LABELS.get(x, x)} | {f(x + '/acc')} | {f(x + '/acc_single')} | "
                     f"{f(x + '/acc_update')} | {f(x + '/acc_hop')} | "
                     f"{f(x + '/tokens', fmt='{:.1f}')} | {f(x + '/perfect')} | "
                     f"{f(x + '/density')} |")
    levels = sorted({int(k.split("/")[1][1:]) for k in a if k.startswith("none/n")
                     and k.count("/") == 2})
    lines += ["", "**By noise level** (distractors per session / passage set; acc, tokens):", "",
              "| arm | " + " | ".join(f"noise {n}" for n in levels) + " |",
              "|---|" + "---|" * len(levels)]
    for x in arms:
        lines.append(f"| {LABELS.get(x, x)} | " + " | ".join(
            f"{f(f'{x}/n{n}/acc')} / {f(f'{x}/n{n}/tokens', fmt='{:.0f}')}" for n in levels)
            + " |")
    shown = [x for x in arms if x != "none" and f"{x}/line1/n" in a]
    if shown:
        lines += ["", "**Where the answer sits** (learned reader accuracy by the line of the "
                  "memory block that last mentions the answer, over every cell; share of the "
                  "arm's questions in brackets):", "",
                  "| arm | " + " | ".join(f"line {b}" for b in LINE_BUCKETS) + " |",
                  "|---|" + "---|" * len(LINE_BUCKETS)]
        for x in shown:
            total = sum(a.get(f"{x}/line{b}/n", 0.0) for b in LINE_BUCKETS) or 1.0
            lines.append(f"| {LABELS.get(x, x)} | " + " | ".join(
                f"{f(f'{x}/line{b}/acc')} ({a.get(f'{x}/line{b}/n', 0.0) / total:.2f})"
                for b in LINE_BUCKETS) + " |")
    lines += ["", f"**Structurer** (eval, against the oracle parser): parse rate "
              f"{f('eval/parse_rate', s)}, exact facts {f('eval/fact_exact', s)}, value kept "
              f"{f('eval/value_kept', s)}, NONE right {f('eval/none_right', s)}. "
              f"**Recalibrated on val**: tau_tag {f('tau_tag', mm, '{:g}')} (paper 0.8), keep "
              f"{f('keep', mm, '{:g}')}, tau_seg {f('tau_seg', mm, '{:g}')} (paper 0.75).", "",
              "**Claims** (paired 95% CI over seed x noise cells):", ""]
    for name, label in NAMES.items():
        cl = stats.read_claim(c, f"claim/{name}")
        if cl is not None:
            lines.append(f"- {label}: {cl.sentence()}")
    if "token_ratio_raw_over_plugmem" in c:
        lines.append(f"- raw / PlugMem memory tokens: {c['token_ratio_raw_over_plugmem']:.2f}x")
    if "structurer_gap" in c:
        lines.append(f"- oracle parser - learned structurer (accuracy): "
                     f"{c['structurer_gap']:+.3f}")
    return "\n".join(lines) + "\n"
