"""Stage `compare` of the TRACE pipeline: tagger, correlation study and RL arms side by side.

Reads the DVC metrics of `label`, `score`, `correlate` and the RL arms and writes
`report/table.md` (the same table `paperline report` puts in the README), plus the paper's
claims as measured booleans:

- r(TRACE, accuracy) across generators is above each baseline's by a paired bootstrap 95% CI
  of the difference that excludes 0, and its own CI excludes 0 (paper: 0.74 vs perplexity ~0.3,
  length ~0.1): `claim_trace_beats_baselines`; `claim_trace_beats_<baseline>` per baseline;
- the accuracy + TRACE reward ends more accurate than the accuracy-only reward by more than the
  seed std (paper +5.2 points on GSM8K): `claim_trace_reward_ge_acc`.

    python -m stages trace compare
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.trace.trace import LABELS, NAMES


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rl_arms: list[str] = Field(["rl_acc", "rl_trace"], min_length=1,
                               description="RL stages compared (the first is the baseline)")
    report: str = Field("report", description="paths key of the report folder")


def gather(ctx: Any, rl_arms: list[str]) -> dict[str, dict[str, Any]]:
    """{stage: metrics} of the stages this table needs, from `<metrics_dir>/<stage>.json`."""
    out = {}
    for stage in ("corpus", "label", "score", "correlate", *rl_arms):
        path = ctx.metrics_dir / f"{stage}.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; run stage {stage!r} first")
        out[stage] = json.loads(path.read_text())
    return out


def claims(metrics: dict[str, dict[str, Any]], rl_arms: list[str]) -> dict[str, float]:
    """The claims as measured booleans, strict enough not to pass on noise:
    correlation: the paired bootstrap 95% CI of r(TRACE) - r(baseline) above 0 for each
    baseline, AND r(TRACE)'s own CI above 0 (a higher point estimate alone is not enough);
    reward: the TRACE arm's final accuracy above the baseline arm's by more than the larger
    seed std of the two."""
    c = metrics["correlate"]
    r = c.get("pearson/trace", math.nan)
    low = c.get("ci_low/trace", math.nan)
    out = {"r_trace": r}
    for b in ("neg_ppl", "length"):
        d_low = c.get(f"diff_ci_low/{b}", math.nan)
        out[f"claim_trace_beats_{b}"] = float(not math.isnan(d_low) and d_low > 0)
    d_low = c.get("diff_ci_low/neg_ppl_vs_length", math.nan)   # the spec's r(PPL) > r(length)
    out["claim_ppl_beats_length"] = float(not math.isnan(d_low) and d_low > 0)
    out["claim_trace_beats_baselines"] = float(
        not math.isnan(low) and low > 0
        and out["claim_trace_beats_neg_ppl"] == 1.0 and out["claim_trace_beats_length"] == 1.0)
    acc = [metrics[a].get("final_acc_mean", math.nan) for a in rl_arms]
    std = [metrics[a].get("final_acc_std", math.nan) for a in rl_arms]
    if len(acc) >= 2:
        out["rl_gain"] = acc[-1] - acc[0]
        out["claim_trace_reward_ge_acc"] = float(out["rl_gain"] > max(std[0], std[-1]))
    return out


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    metrics = gather(ctx, cfg.rl_arms)
    m = claims(metrics, cfg.rl_arms)
    with io.atomic_path(ctx.path(cfg.report), is_dir=True) as tmp:
        io.write_text(tmp / "table.md", results_table({**metrics, "compare": m}))
    return m


def _f(v: Any, fmt: str = ".3f") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{fmt}}"


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """README tables from the pipeline's metrics; nothing typed by hand."""
    lab, cor = metrics.get("label", {}), metrics.get("correlate", {})
    if not lab or not cor:
        return "_No results yet: run the pipeline._\n"
    sc = metrics.get("score", {})
    lines = ["**Tagger** (held-out templated sentences; paper: macro-F1 0.666 on 400 human-"
             "labelled sentences)", "",
             "| macro-F1 | P | R | " + " | ".join(NAMES[l] for l in LABELS) + " | empty sets |",
             "|---|---|---|" + "---|" * len(LABELS) + "---|",
             f"| {_f(lab.get('macro_f1'))} | {_f(lab.get('macro_precision'))} | "
             f"{_f(lab.get('macro_recall'))} | "
             + " | ".join(_f(lab.get(f"f1_{l}")) for l in LABELS)
             + f" | {_f(lab.get('empty_rate'), '.1%')} |"]
    if "llm_macro_f1" in lab:
        lines += ["", f"LLM labeler (backend option) on {lab.get('llm_rows', 0):.0f} sentences: "
                      f"macro-F1 {_f(lab['llm_macro_f1'])}, malformed replies "
                      f"{lab.get('llm_malformed', 0):.0f} ({_f(lab.get('llm_malformed_rate'), '.0%')})."]
    conds = sorted(k[:-4] for k in cor if k.endswith("/acc"))
    lines += ["", f"**Correlation with accuracy** over {cor.get('conditions', 0):.0f} generator "
                  f"conditions (policy trained on d% poorly structured traces, s SFT steps, "
                  f"sampling temperature t); paper: r = 0.74, perplexity ~0.3, length ~0.1", "",
              "| score | Pearson r (95% bootstrap CI) | Spearman | per-sample point-biserial r |",
              "|---|---|---|---|"]
    for s, name in (("trace", "TRACE"), ("neg_ppl", "−perplexity"), ("length", "length")):
        lines.append(f"| {name} | {_f(cor.get(f'pearson/{s}'))} "
                     f"[{_f(cor.get(f'ci_low/{s}'), '.2f')}, {_f(cor.get(f'ci_high/{s}'), '.2f')}] "
                     f"| {_f(cor.get(f'spearman/{s}'))} | {_f(cor.get(f'point_biserial/{s}'))} |")
    lines += ["", "| condition | accuracy | mean TRACE |", "|---|---|---|"]
    for c in conds:
        lines.append(f"| {c} | {_f(cor[f'{c}/acc'])} | {_f(cor.get(f'{c}/trace'))} |")
    if "bon_trace" in cor:
        lines += ["", f"Best-of-N inside each condition: TRACE pick {_f(cor['bon_trace'])}, random "
                      f"{_f(cor.get('bon_random'))}, longest {_f(cor.get('bon_length'))}, oracle "
                      f"{_f(cor.get('bon_oracle'))}."]
    if sc:
        lines += ["", f"Sampled CoTs: {sc.get('samples', 0):.0f}; empty label sets "
                      f"{_f(sc.get('empty_set_rate'), '.1%')} of sentences; labeler malformed "
                      f"replies {sc.get('labeler_malformed', 0):.0f}."]
    arms = [k for k in metrics if "final_acc_mean" in metrics[k]]
    if arms:
        lines += ["", "**GRPO reward** (mean ± std over seeds, greedy on held-out prompts; paper "
                      "GSM8K: accuracy-only 76.2, accuracy + TRACE 81.4)", "",
                  "| arm | lambda | accuracy before | accuracy after | TRACE before | TRACE after "
                  "| length after | seeds |", "|---|---|---|---|---|---|---|---|"]
        for a in arms:
            r = metrics[a]

            def pm(k: str) -> str:
                return f"{_f(r.get(f'{k}_mean'))} ± {_f(r.get(f'{k}_std'))}"
            lines.append(f"| {a} | {_f(r.get('trace_weight'), '.1f')} | {pm('initial_acc')} | "
                         f"{pm('final_acc')} | {pm('initial_trace')} | {pm('final_trace')} | "
                         f"{_f(r.get('final_len_mean'), '.0f')} | {r.get('seeds', 0):.0f} |")
    cm = metrics.get("compare", {})
    if cm:
        lines += ["", f"Claim 'TRACE correlates with accuracy better than perplexity and length': "
                      f"{'reproduced' if cm.get('claim_trace_beats_baselines') else 'not reproduced'}"
                      f" (r = {_f(cm.get('r_trace'))}; needs the paired bootstrap CI of "
                      f"r(TRACE) − r(baseline) above 0 for both baselines, and r's CI above 0)."]
        for b, name in (("neg_ppl", "−perplexity"), ("length", "length")):
            diff = cor.get("pearson/trace", math.nan) - cor.get(f"pearson/{b}", math.nan)
            lines.append(f"- vs {name}: r(TRACE) − r = {_f(diff, '+.2f')}, paired 95% CI "
                         f"[{_f(cor.get(f'diff_ci_low/{b}'), '+.2f')}, "
                         f"{_f(cor.get(f'diff_ci_high/{b}'), '+.2f')}]: "
                         f"{'higher' if cm.get(f'claim_trace_beats_{b}') else 'not shown higher'}.")
        if "diff_ci_low/neg_ppl_vs_length" in cor:
            diff = cor.get("pearson/neg_ppl", math.nan) - cor.get("pearson/length", math.nan)
            lines.append(f"- the spec's next step, −perplexity vs length: r − r = "
                         f"{_f(diff, '+.2f')}, paired 95% CI "
                         f"[{_f(cor.get('diff_ci_low/neg_ppl_vs_length'), '+.2f')}, "
                         f"{_f(cor.get('diff_ci_high/neg_ppl_vs_length'), '+.2f')}]: "
                         f"{'higher' if cm.get('claim_ppl_beats_length') else 'not shown higher'}.")
        if "claim_trace_reward_ge_acc" in cm:
            lines.append(f"Claim 'accuracy + TRACE reward beats accuracy-only': "
                         f"{'reproduced' if cm['claim_trace_reward_ge_acc'] else 'not reproduced'}"
                         f" (accuracy gain {_f(cm.get('rl_gain'), '+.3f')}; needs a gain above "
                         f"the seed std).")
    return "\n".join(lines) + "\n"
