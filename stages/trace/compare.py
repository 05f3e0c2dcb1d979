"""Stage `compare` of the TRACE pipeline: tagger, correlation study and RL arms side by side.

Reads the DVC metrics of `label`, `score`, `correlate` and the RL arms, and the RL arms'
per-seed finals (`runs/<arm>/finals.parquet`), and writes `report/table.md` (the same table
`paperline report` puts in the README). Every claim of the paper (Kim & Yang, arXiv 2605.29656:
r = 0.74 across models, perplexity ~0.3, length ~0.1 [secondary]; accuracy + TRACE reward 81.4
vs accuracy-only 76.2 on GSM8K [secondary]) goes through the house claim rule
(stages.core.stats; metrics `claim/<name>/{diff,ci_low,ci_high,mde,pairs,verdict,paper_effect}`):

- `trace_correlates`: r(TRACE, accuracy) across generator conditions, its percentile bootstrap
  95% CI (stage `correlate`) against 0;
- `trace_beats_neg_ppl`, `trace_beats_length`: r(TRACE) - r(baseline), the paired bootstrap
  95% CI of the difference (both r on the same resampled conditions) against 0; a higher point
  estimate alone is not enough;
- `ppl_beats_length`: the spec's predicted order continued, r(-perplexity) - r(length);
- `trace_reward_beats_acc`: final accuracy of the accuracy + TRACE reward minus the
  accuracy-only reward's, paired by seed (t interval, `stats.claim`).

For the correlation claims the CI comes from `correlate`'s bootstrap (`stats.claim_from_ci`), and
the minimum detectable effect from its spread: `mde_sds` (2.8 = z_0.975 + z_0.80, a two-sided 5%
test at 80% power under a normal approximation of the bootstrap distribution) x the sd of the
bootstrap draws; pairs = the number of conditions.

    python -m stages trace compare
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import io, stats
from stages.trace.trace import LABELS, NAMES


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rl_arms: list[str] = Field(["rl_acc", "rl_trace"], min_length=1,
                               description="RL stages compared (the first is the baseline)")
    runs: str = Field("runs", description="paths key of the RL runs (<arm>/finals.parquet)")
    report: str = Field("report", description="paths key of the report folder")
    paper_r_trace: float | None = Field(None, ge=-1, le=1,
                                        description="paper: Pearson r(TRACE, accuracy)")
    paper_r_neg_ppl: float | None = Field(None, ge=-1, le=1,
                                          description="paper: r(perplexity-based score, accuracy)")
    paper_r_length: float | None = Field(None, ge=-1, le=1,
                                         description="paper: r(length, accuracy)")
    paper_rl_gain: float | None = Field(None, ge=-1, le=1, description="paper: final accuracy of "
                                        "the accuracy + TRACE reward - accuracy-only (accuracy "
                                        "units)")
    mde_sds: float = Field(2.8, gt=0, description="MDE of a bootstrap CI = this x the sd of "
                                                  "the draws (z_0.975 + z_0.80)")


# name -> (score, baseline score or None for r itself, text)
CORRELATION_CLAIMS: dict[str, tuple[str, str | None, str]] = {
    "trace_correlates": ("trace", None, "TRACE correlates with accuracy across generators "
                                        "(Pearson r)"),
    "trace_beats_neg_ppl": ("trace", "neg_ppl", "TRACE tracks accuracy better than perplexity "
                                                "(r(TRACE) - r(-perplexity))"),
    "trace_beats_length": ("trace", "length", "TRACE tracks accuracy better than length "
                                              "(r(TRACE) - r(length))"),
    "ppl_beats_length": ("neg_ppl", "length", "perplexity tracks accuracy better than length "
                                              "(the spec's predicted order)"),
}
RL_CLAIM = ("trace_reward_beats_acc", "the accuracy + TRACE reward ends more accurate than the "
                                      "accuracy-only reward (final accuracy, paired by seed)")


def gather(ctx: Any, rl_arms: list[str]) -> dict[str, dict[str, Any]]:
    """{stage: metrics} of the stages this table needs: every number each returned
    (`details/<stage>.json`, listed in this stage's dvc.yaml deps)."""
    return {stage: ctx.stage_metrics(stage)
            for stage in ("corpus", "label", "score", "correlate", *rl_arms)}


def final_acc_by_seed(ctx: Any, runs: str, arm: str) -> dict[int, float]:
    """{seed: final accuracy} of one RL arm, from its `finals.parquet`."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec, read_parquet_checked

    path = ctx.path(runs) / arm / "finals.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; run stage {arm!r} first")
    finals = read_parquet_checked(path, FrameSpec({
        "seed": ColumnSpec(dtype=pl.Int64, min=0, unique=True),
        "final_acc": ColumnSpec(dtype=pl.Float64, min=0.0, max=1.0)}))
    return {int(s): float(a) for s, a in zip(finals["seed"], finals["final_acc"])}


def _paper(cfg: Config, score: str) -> float | None:
    return {"trace": cfg.paper_r_trace, "neg_ppl": cfg.paper_r_neg_ppl,
            "length": cfg.paper_r_length}[score]


def correlation_claims(cor: dict[str, Any], cfg: Config) -> dict[str, float]:
    """The correlation claims from `correlate`'s bootstrap CIs (`stats.claim_from_ci`; module
    doc): the paper's effect is its r, or the difference of its two r."""
    out: dict[str, float] = {}
    n = int(cor.get("conditions", 0))
    for name, (score, base, _) in CORRELATION_CLAIMS.items():
        if base is None:
            diff = cor.get(f"pearson/{score}", math.nan)
            low, high = cor.get(f"ci_low/{score}", math.nan), cor.get(f"ci_high/{score}", math.nan)
            sd = cor.get(f"boot_sd/{score}", math.nan)
            paper = _paper(cfg, score)
        else:
            key = base if score == "trace" else f"{score}_vs_{base}"
            diff = cor.get(f"pearson/{score}", math.nan) - cor.get(f"pearson/{base}", math.nan)
            low = cor.get(f"diff_ci_low/{key}", math.nan)
            high = cor.get(f"diff_ci_high/{key}", math.nan)
            sd = cor.get(f"diff_boot_sd/{key}", math.nan)
            p_s, p_b = _paper(cfg, score), _paper(cfg, base)
            paper = None if p_s is None or p_b is None else p_s - p_b
        got = stats.claim_from_ci(diff, low, high, n=n, direction=+1, paper_effect=paper,
                                  mde_value=cfg.mde_sds * sd)
        out |= stats.claim_metrics(got, f"claim/{name}")
    return out


def rl_claim(final_acc: dict[str, dict[int, float]], rl_arms: list[str], cfg: Config
             ) -> dict[str, float]:
    """The last RL arm against the first, final accuracy paired by seed (`stats.claim_by_key`)."""
    if len(rl_arms) < 2:
        return {}
    got = stats.claim_by_key(final_acc[rl_arms[-1]], final_acc[rl_arms[0]], direction=+1,
                             paper_effect=cfg.paper_rl_gain)
    return stats.claim_metrics(got, f"claim/{RL_CLAIM[0]}")


def claims(metrics: dict[str, dict[str, Any]], final_acc: dict[str, dict[int, float]],
           cfg: Config) -> dict[str, float]:
    """Every claim of the module doc, as `claim/<name>/...` metrics."""
    return correlation_claims(metrics["correlate"], cfg) | rl_claim(final_acc, cfg.rl_arms, cfg)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    metrics = gather(ctx, cfg.rl_arms)
    final_acc = {a: final_acc_by_seed(ctx, cfg.runs, a) for a in cfg.rl_arms}
    m = claims(metrics, final_acc, cfg)
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
    claimed = [(text, stats.read_claim(cm, f"claim/{name}")) for name, text in
               [(n, c[2]) for n, c in CORRELATION_CLAIMS.items()] + [RL_CLAIM]]
    if any(c is not None for _, c in claimed):
        lines += ["", "Claims, by the house rule (95% CI of the difference: reproduced when it "
                      "excludes 0 in the paper's direction, contradicted when it excludes 0 the "
                      "other way, else inconclusive). Correlations: "
                      "percentile bootstrap over the conditions (paired for differences; pairs = "
                      "conditions; MDE = `compare.mde_sds`, 2.8, x the sd of the bootstrap "
                      "draws); RL: t interval over seeds:", ""]
        lines += [f"- {text}: {c.sentence()}" for text, c in claimed if c is not None]
    return "\n".join(lines) + "\n"


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many claims are reproduced / inconclusive / contradicted; each claim in
    details/compare.json."""
    return stats.verdict_counts(metrics)
