"""Stage `compare` of CoRe: the arms side by side and the paper's claims by the house rule.

Pairs are (seed, test item): the same item answered by two arms trained from the same
`vlm-text` seed, pooled over seeds. A claim on accuracies is the paired percentile bootstrap 95%
CI of the mean difference over those pairs (`stats.claim(..., method_ci="bootstrap")`); gap
recovery is `core.gap_recovery_ci` (the three arms resampled item by item together). Verdicts:
reproduced / contradicted / inconclusive (stages/core/stats.py), each with its MDE.

Claims (CoRe, ICML 2026 poster 64509, abstract only; no per-benchmark numbers are public):
- transfer failure: SFT on the text, read on the text, beats SFT on the page, read on the page;
- CoRe-SFT beats visual SFT on the page;
- CoRe-SFT recovers part of the text-vs-visual gap: gap recovery > 0 (paper: "up to 70%", a
  best case over benchmarks, shown beside the CI);
- where the GRPO arms ran: GRPO with the text anchor beats GRPO without it on the page, and its
  gap recovery, with visual GRPO (same start) as the lower reference.
Each also on the reference answer's NLL per token (teacher-forced), a graded measure where
greedy accuracy sits at the floor.

Outputs: the README table (`results_table`), `<report>/accuracy.png` (each arm's accuracy on the
page and on the text, per seed).

    python -m stages core compare
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import stats
from stages.core_align.pages import KINDS
from stages.core_align.sft import ARMS, MODALITIES, RL_ARMS

ARM_ORDER = ("base", *ARMS, *RL_ARMS)
LABELS = {"base": "vlm-text as it is (zero-shot)", "text_sft": "text SFT (upper bound)",
          "visual_sft": "visual SFT", "core_sft": "CoRe-SFT (visual SFT + L_match)",
          "visual_grpo": "visual GRPO", "core_grpo": "CoRe-RL (visual GRPO + text anchor)"}
PAPER_GAP_RECOVERY = 0.70          # "recovers up to 70% of the gap" [paper, abstract]

# name -> (method arm, its modality, baseline arm, its modality, statistic, direction, text);
# statistic: `correct` (greedy accuracy) or `nll` (the reference answer's mean NLL per token,
# teacher-forced: graded where accuracy sits at the floor; lower is better, direction -1)
CLAIMS: dict[str, tuple[str, str, str, str, str, int, str]] = {
    "transfer_failure": ("text_sft", "text", "visual_sft", "image", "correct", 1,
                         "transfer failure: text SFT (read on text) beats visual SFT (read on "
                         "the page)"),
    "core_sft_vs_visual_sft": ("core_sft", "image", "visual_sft", "image", "correct", 1,
                               "CoRe-SFT beats visual SFT on the page"),
    "core_grpo_vs_visual_grpo": ("core_grpo", "image", "visual_grpo", "image", "correct", 1,
                                 "CoRe-RL (text anchor) beats visual GRPO on the page"),
    "transfer_failure_nll": ("text_sft", "text", "visual_sft", "image", "nll", -1,
                             "answer NLL: text SFT on text below visual SFT on the page"),
    "core_sft_vs_visual_sft_nll": ("core_sft", "image", "visual_sft", "image", "nll", -1,
                                   "answer NLL on the page: CoRe-SFT below visual SFT"),
    "core_grpo_vs_visual_grpo_nll": ("core_grpo", "image", "visual_grpo", "image", "nll", -1,
                                     "answer NLL on the page: CoRe-RL below visual GRPO"),
}
# name -> (arm, lower reference arm, statistic, text). The RL arms start from text SFT, so their
# lower reference is visual GRPO from the same start [ours]; against visual SFT their recovery
# would mix the SFT and the RL effects. The upper reference is always text SFT read on text.
RECOVERY = {
    "gap_recovery_sft": ("core_sft", "visual_sft", "correct",
                         "CoRe-SFT recovers part of the text-vs-visual accuracy gap"),
    "gap_recovery_grpo": ("core_grpo", "visual_grpo", "correct",
                          "CoRe-RL recovers part of the accuracy gap (lower reference: visual "
                          "GRPO)"),
    "gap_recovery_sft_nll": ("core_sft", "visual_sft", "nll",
                             "CoRe-SFT recovers part of the text-vs-visual answer-NLL gap"),
    "gap_recovery_grpo_nll": ("core_grpo", "visual_grpo", "nll",
                              "CoRe-RL recovers part of the answer-NLL gap (lower reference: "
                              "visual GRPO)"),
}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    answers: str = Field("core_answers", description="path key: answers.parquet folder(s)")
    rl_answers: str | None = Field("core_rl_answers", description="path key: the grpo stage's "
                                                                  "answers (None: no RL arms)")
    report: str = Field("core_report", description="path key: PNG figures")
    draws: int = Field(2000, ge=100, le=100_000, description="bootstrap resamples per claim")


def correctness(answers: Any, arm: str, modality: str, statistic: str = "correct"
                ) -> dict[tuple[int, str], float]:
    """{(seed, item): value} of one arm reading one modality (0/1, or the answer's NLL)."""
    import polars as pl

    rows = answers.filter((pl.col("arm") == arm) & (pl.col("modality") == modality))
    return {(s, i): float(c) for s, i, c in zip(rows["seed"], rows["item"], rows[statistic])}


def paired(a: dict, b: dict, what: str) -> tuple[list[float], list[float]]:
    if set(a) != set(b):
        raise ValueError(f"{what}: the arms answered different (seed, item) pairs "
                         f"({len(set(a) ^ set(b))} differ): run them on the same seeds and items")
    keys = sorted(a)
    return [a[k] for k in keys], [b[k] for k in keys]


def accuracy_claim(answers: Any, method: str, m_mod: str, baseline: str, b_mod: str,
                   draws: int, statistic: str = "correct", direction: int = 1) -> stats.Claim:
    m, b = paired(correctness(answers, method, m_mod, statistic),
                  correctness(answers, baseline, b_mod, statistic), f"{method} vs {baseline}")
    return stats.claim(m, b, direction=direction, method_ci="bootstrap", draws=draws)


def recovery_claim(answers: Any, arm: str, draws: int, statistic: str = "correct",
                   lower: str = "visual_sft") -> tuple[stats.Claim, Any]:
    """Gap recovery of `arm` on the page with its paired item bootstrap CI, as a Claim (verdict
    on the CI vs 0, the house rule; the paper's 0.70 beside it, a best case: "up to"); MDE: the
    accuracy MDE of (arm - lower) over the gap. `nll`: the same on -NLL. `lower`: the lower
    reference arm read on the page (visual SFT in the paper's formula)."""
    from stages.core_align.core import gap_recovery_ci

    sign = -1.0 if statistic == "nll" else 1.0          # NLL: lower is better
    core, visual, text = ({k: sign * v for k, v in correctness(answers, a, m, statistic).items()}
                          for a, m in ((arm, "image"), (lower, "image"),
                                       ("text_sft", "text")))
    c, v = paired(core, visual, f"{arm} vs {lower}")
    _, t = paired(core, text, f"{arm} vs text_sft")
    g = gap_recovery_ci(c, v, t, draws=draws)
    mde = stats.mde([x - y for x, y in zip(c, v)]) / g.gap if g.gap > 0 else math.nan
    return stats.claim_from_ci(g.value, g.low, g.high, n=g.n, mde_value=mde,
                               paper_effect=PAPER_GAP_RECOVERY), g


def figure(answers: Any, path: Any) -> None:
    """Accuracy of every arm on the page and on the text: bars = mean over seeds, dots = seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import polars as pl

    from stages.core import io

    per_seed = answers.group_by("arm", "modality", "seed", maintain_order=True).agg(
        pl.col("correct").mean())
    arms = [a for a in ARM_ORDER if a in set(per_seed["arm"].to_list())]
    fig, ax = plt.subplots(figsize=(1.3 * len(arms) + 2, 3.4))
    width = 0.38
    for j, (mod, colour) in enumerate((("text", "#4c72b0"), ("image", "#dd8452"))):
        for i, arm in enumerate(arms):
            vals = per_seed.filter((pl.col("arm") == arm) & (pl.col("modality") == mod))
            ys = vals["correct"].to_list()
            x = i + (j - 0.5) * width
            ax.bar(x, sum(ys) / len(ys), width, color=colour,
                   label=f"read on the {'page' if mod == 'image' else 'text'}" if i == 0 else None)
            ax.scatter([x] * len(ys), ys, s=8, color="black", zorder=3)
    ax.set_xticks(range(len(arms)), [a.replace("_", "\n") for a in arms], fontsize=8)
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("CoRe: accuracy by arm and input (bars: mean over seeds; dots: seeds)",
                 fontsize=9)
    fig.tight_layout()
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked
    from stages.core_align.sft import answers_spec

    frames = [read_parquet_checked(ctx.path(cfg.answers) / "answers.parquet", answers_spec())]
    if cfg.rl_answers:
        frames.append(read_parquet_checked(ctx.path(cfg.rl_answers) / "answers.parquet",
                                           answers_spec()))
    answers = pl.concat(frames)
    present = set(answers["arm"].unique().to_list())
    missing = sorted({"base", "text_sft", "visual_sft"} - present)
    if missing:
        raise ValueError(f"answers: no rows for arms {missing} (the sft stage runs them)")
    seeds = sorted(answers["seed"].unique().to_list())
    metrics: dict[str, float] = {"seeds": float(len(seeds)),
                                 "items": float(answers["item"].n_unique())}
    sft = ctx.stage_metrics("sft")
    metrics["chars_per_visual_token"] = sft["chars_per_visual_token"]
    per_seed = answers.group_by("arm", "modality", "seed", maintain_order=True).agg(
        pl.col("correct", "nll").mean())
    per_kind = answers.group_by("arm", "modality", "kind", maintain_order=True).agg(
        pl.col("correct").mean())
    for arm in (a for a in ARM_ORDER if a in present):
        for mod in MODALITIES:
            vals = per_seed.filter((pl.col("arm") == arm) & (pl.col("modality") == mod))
            metrics[f"{arm}/{mod}_mean"], metrics[f"{arm}/{mod}_std"] = \
                stats.mean_std(vals["correct"].to_list())
            metrics[f"{arm}/{mod}_nll_mean"], metrics[f"{arm}/{mod}_nll_std"] = \
                stats.mean_std(vals["nll"].to_list())
            for kind, acc in per_kind.filter((pl.col("arm") == arm)
                                             & (pl.col("modality") == mod)).select(
                                                 "kind", "correct").iter_rows():
                metrics[f"{arm}/{mod}_{kind}"] = acc
    for name, (method, m_mod, baseline, b_mod, statistic, direction, _) in CLAIMS.items():
        if {method, baseline} <= present:
            c = accuracy_claim(answers, method, m_mod, baseline, b_mod, cfg.draws, statistic,
                               direction)
            metrics.update(stats.claim_metrics(c, f"claim/{name}"))
            print(f"compare: {name}: {c.sentence()}")
    for name, (arm, lower, statistic, _) in RECOVERY.items():
        if {arm, lower} <= present:
            c, g = recovery_claim(answers, arm, cfg.draws, statistic, lower)
            metrics.update(stats.claim_metrics(c, f"claim/{name}"))
            metrics[f"claim/{name}/gap"] = g.gap
            print(f"compare: {name}: {g.describe()} -> {c.sentence('{:+.2f}')}")
    report = ctx.path(cfg.report)
    report.mkdir(parents=True, exist_ok=True)
    figure(answers, report / "accuracy.png")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: verdict counts, gap recovery of CoRe-SFT (accuracy) and of CoRe-RL (answer
    NLL); the arms' numbers are the sft and grpo stages' headlines."""
    out = stats.verdict_counts(metrics)
    for key, name in (("claim/gap_recovery_sft/diff", "recovery_sft"),
                      ("claim/gap_recovery_grpo_nll/diff", "recovery_rl_nll")):
        if key in metrics and math.isfinite(metrics[key]):
            out[name] = metrics[key]
    return out


def _cell(m: dict[str, Any], key: str, n_seeds: int) -> str:
    mean, std = m.get(f"{key}_mean", math.nan), m.get(f"{key}_std", math.nan)
    if not math.isfinite(mean):
        return "—"
    return f"{mean:.3f}" + (f" ± {std:.3f}" if n_seeds > 1 else "")


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """The README block of `paperline report core`: arms side by side, then every claim."""
    m = metrics.get("compare", {})
    if "visual_sft/image_mean" not in m:
        return "_No results yet: run the pipeline._\n"
    n_seeds = int(m.get("seeds", 0))
    arms = [a for a in ARM_ORDER if f"{a}/image_mean" in m]
    shown = [k for k in KINDS if any(f"{a}/image_{k}" in m for a in arms)]
    shown = shown if len(shown) > 1 else []      # one kind: its column is the page's accuracy
    lines = [f"Test split ({int(m.get('items', 0))} items), greedy answers, mean ± std over "
             f"{n_seeds} `vlm-text` seeds; {m.get('chars_per_visual_token', math.nan):.1f} "
             f"characters per visual token (compression ratio).", "",
             "| arm | accuracy on the page | accuracy on the text | "
             + "".join(f"page: {k} | " for k in shown)
             + "answer NLL, page | answer NLL, text |",
             "|---|---|---|" + "---|" * len(shown) + "---|---|"]
    for arm in arms:
        kinds = [m.get(f"{arm}/image_{k}") for k in shown]
        cells = [LABELS[arm], _cell(m, f"{arm}/image", n_seeds), _cell(m, f"{arm}/text", n_seeds),
                 *("—" if v is None else f"{v:.3f}" for v in kinds),
                 _cell(m, f"{arm}/image_nll", n_seeds), _cell(m, f"{arm}/text_nll", n_seeds)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| claim | paired 95% CI over (seed, item) pairs |", "|---|---|"]
    for name, (*_, text) in CLAIMS.items():
        c = stats.read_claim(m, f"claim/{name}")
        if c is not None:
            lines.append(f"| {text} | {c.sentence()} |")
    for name, (arm, lower, _, text) in RECOVERY.items():
        c = stats.read_claim(m, f"claim/{name}")
        if c is not None:
            gap = m.get(f"claim/{name}/gap", math.nan)
            extra = (f"undefined: text SFT does not beat {LABELS[lower]}"
                     if not math.isfinite(c.diff)
                     else c.sentence("{:+.2f}").replace("paper: +0.70", "paper: up to 0.70"))
            lines.append(f"| {text} (gap {gap:+.3f}) | {extra} |")
    lines += ["", "Accuracy claims are differences in accuracy, NLL claims differences in the "
                  "reference answer's mean negative log-likelihood per token (teacher-forced; "
                  "lower is better); gap recovery is (CoRe(page) − lower(page)) / "
                  "(text SFT(text) − lower(page)), lower = visual SFT (visual GRPO for the RL "
                  "arms), on −NLL for the NLL rows, its CI a "
                  "paired bootstrap over items with the three arms resampled together; the paper's "
                  "0.70 is a best case (\"up to\"), shown beside the CI.", ""]
    return "\n".join(lines)
