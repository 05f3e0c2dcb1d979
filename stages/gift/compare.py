"""Stage `compare` of GIFT: the arms side by side and the paper's claims by the house rule.

Pairs are (seed, test image): the same image captioned / questioned by both arms on the same
checkpoint. Each claim is a paired percentile bootstrap 95% CI
(`hallucination.paired_ratio_bootstrap`, the seeds as strata: CHAIR_S, CHAIR_I and POPE F1 are
ratios of sums over all seeds; each draw resamples the images within each seed separately, the
same draw on both arms, so every seed keeps its number of pairs), turned into a verdict
(reproduced / contradicted / inconclusive, with the MDE): by `stats.verdict` for "lower" /
"higher" claims, by `stats.noninferiority` with the margin `pope_margin` for "does not fall"
claims.

Claims (GIFT, arXiv 2510.22067; numbers [secondary], GIFT spec §1):
- CHAIR_S falls relative to greedy: paper -20.7% (50.2 -> 39.8, LLaVA-1.5-7B);
- CHAIR_I falls relative to greedy: paper -31% (15.4 -> 10.6);
- GIFT beats VAF on CHAIR_S: paper -19.8% (VAF 49.6 -> GIFT 39.8);
- the spec's predicted order on hallucination, full GIFT < visual-only < VAF (no number);
- POPE F1 does not fall (paper +1.4 points, 82.4 -> 83.8), per negative kind: a
  non-inferiority claim, reproduced when the CI of GIFT - greedy F1 lies above -`pope_margin`;
  not tested (`claim/<name>/untestable` = 1) only when GIFT and greedy both give one answer
  to every question in every seed, and the same one (`untestable_pope`);
  `pope_constant_answers` records whether greedy alone does.

Outputs: the README table (`results_table`), `<report>/samples.png` (test images with each
arm's caption, first seed).

    python -m stages gift compare
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core import stats
from stages.evaluate import hallucination
from stages.gift import arms as gift_arms

# name -> (method arm, baseline arm, statistic, relative, direction, rule, paper effect, text).
# rule "differs": the house rule (`stats.verdict`, the CI excludes 0 in `direction`);
# "noninferior": the paper says the value does not get worse (`stats.noninferiority`, margin
# `Config.pope_margin`); the paper effect is then what the paper observed, for reference.
CLAIMS: dict[str, tuple[str, str, str, bool, int, str, float | None, str]] = {
    "chair_s_vs_greedy": ("gift", "greedy", "chair_sentence", True, -1, "differs", -0.207,
                          "GIFT lowers CHAIR_S relative to greedy"),
    "chair_i_vs_greedy": ("gift", "greedy", "chair_instance", True, -1, "differs", -0.312,
                          "GIFT lowers CHAIR_I relative to greedy"),
    "chair_s_vs_vaf": ("gift", "vaf", "chair_sentence", True, -1, "differs", -0.198,
                       "GIFT lowers CHAIR_S relative to VAF"),
    "chair_s_vs_visual_only": ("gift", "gift_visual", "chair_sentence", True, -1, "differs",
                               None, "full GIFT < visual-only on CHAIR_S (query rescaling "
                               "helps)"),
    "chair_s_visual_only_vs_vaf": ("gift_visual", "vaf", "chair_sentence", True, -1, "differs",
                                   None, "visual-only < VAF on CHAIR_S (saliency beats an "
                                   "attention-proportional boost)"),
    "pope_random_f1": ("gift", "greedy", "pope_random_f1", False, 1, "noninferior", 0.014,
                       "POPE F1 (random) does not fall"),
    "pope_popular_f1": ("gift", "greedy", "pope_popular_f1", False, 1, "noninferior", 0.014,
                        "POPE F1 (popular) does not fall"),
    "pope_adversarial_f1": ("gift", "greedy", "pope_adversarial_f1", False, 1, "noninferior",
                            0.014, "POPE F1 (adversarial) does not fall"),
}
COLUMNS = (("chair_sentence", "CHAIR_S ↓"), ("chair_instance", "CHAIR_I ↓"),
           ("caption_recall", "object recall"), ("caption_f1", "object F1"),
           ("pope_random_f1", "POPE F1 rand."), ("pope_popular_f1", "POPE F1 pop."),
           ("pope_adversarial_f1", "POPE F1 adv."), ("pope_adversarial_acc", "POPE acc adv."))


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    decoded: str = Field("gift_decoded", description="path key: decode's captions / pope")
    data: str = Field("vlm_data", description="path key: the vlm task folder (sample figure)")
    report: str = Field("gift_report", description="path key: PNG figures")
    draws: int = Field(2000, ge=100, le=100_000, description="bootstrap resamples per claim")
    pope_margin: float = Field(0.01, ge=0, le=0.2,
                               description="non-inferiority margin of the POPE claims: F1 'does "
                                           "not fall' when GIFT - greedy > -margin over the "
                                           "whole CI [reconstructed]")
    sample_images: int = Field(4, ge=0, le=16, description="test images in samples.png")


def ratio_columns(captions: Any, pope: Any, arm: str, statistic: str) -> tuple[Any, Any, Any]:
    """(pair keys, numerator, denominator) of `statistic` for one arm, one row per
    (seed, image), sorted by key."""
    import polars as pl

    if statistic.startswith("pope_"):
        kind = statistic.split("_")[1]
        rows = pope.filter((pl.col("arm") == arm)
                           & pl.col("negative").is_in(["positive", kind]))
        agg = rows.group_by("seed", "image_id").agg(
            num=(2 * pl.col("pred_yes") * pl.col("label_yes")).sum(),
            den=(pl.col("pred_yes") + pl.col("label_yes")).sum())
    else:
        rows = captions.filter(pl.col("arm") == arm)
        num, den = (("chair_sentence", pl.lit(1.0)) if statistic == "chair_sentence"
                    else ("hallucinated", pl.col("mentioned")))
        agg = rows.select("seed", "image_id", num=pl.col(num).cast(pl.Float64),
                          den=den.cast(pl.Float64))
    agg = agg.sort("seed", "image_id")
    keys = list(zip(agg["seed"].to_list(), agg["image_id"].to_list()))
    return keys, agg["num"].to_numpy(), agg["den"].to_numpy()


def claim_for(captions: Any, pope: Any, method: str, baseline: str, statistic: str,
              relative: bool, direction: int, paper: float | None, draws: int,
              margin: float | None = None) -> stats.Claim:
    """One claim on the (seed, image) pairs of two arms: the house rule (`stats.verdict`) or,
    with a `margin`, non-inferiority (`stats.noninferiority`)."""
    km, nm, dm = ratio_columns(captions, pope, method, statistic)
    kb, nb, db = ratio_columns(captions, pope, baseline, statistic)
    if km != kb:
        raise ValueError(f"arms {method!r} and {baseline!r} cover different (seed, image) pairs: "
                         f"decode them on the same seeds and images")
    diff, low, high, per_pair = hallucination.paired_ratio_bootstrap(
        nm, dm, nb, db, strata=[seed for seed, _ in km], relative=relative, draws=draws)
    c = stats.claim_from_ci(diff, low, high, diffs=per_pair, direction=direction,
                            paper_effect=paper)
    if margin is None:
        return c
    return dataclasses.replace(c, verdict=stats.noninferiority(low, high, margin, direction))


def constant_answers(pope: Any, arm: str = "greedy") -> bool:
    """True when `arm` gives one answer to every yes/no question in every seed (its yes-rate is
    0 or 1 per seed): then no decoding change that keeps the answer tokens' argmax can move POPE,
    and a POPE claim has nothing to measure (the `vlm` README: vlm-shapes at `cpu`)."""
    import polars as pl

    rates = pope.filter(pl.col("arm") == arm).group_by("seed").agg(pl.col("pred_yes").mean())
    return bool(rates.height) and all(r in (0.0, 1.0) for r in rates["pred_yes"].to_list())


def untestable_pope(pope: Any, method: str, baseline: str) -> bool:
    """True when a POPE claim of `method` against `baseline` has nothing to measure: both arms
    answer every question the same way within each seed (`constant_answers`) AND give the same
    answer to every question. Greedy alone being constant is not enough: a decoding change
    that flips answers is exactly what a "POPE F1 does not fall" claim must catch."""
    import polars as pl

    if not (constant_answers(pope, method) and constant_answers(pope, baseline)):
        return False
    key = ["seed", "image_id", "negative"]
    a = pope.filter(pl.col("arm") == method).select(*key, "pred_yes").sort(key)
    b = pope.filter(pl.col("arm") == baseline).select(*key, "pred_yes").sort(key)
    return a.height == b.height and a.equals(b)


def samples_figure(captions: Any, data_dir: Any, n: int, path: Any) -> None:
    """n test images of the first seed with each arm's caption under them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import polars as pl

    from stages.core import io
    from stages.train.vlm import load_family

    df, images, _ = load_family(data_dir, "shapes", "test", 64)
    seed = captions["seed"].min()
    ids = df["id"].to_list()[:n]
    fig, axes = plt.subplots(1, n, figsize=(3.1 * n, 3.6))
    for ax, (i, rid) in zip([axes] if n == 1 else axes, enumerate(ids)):
        ax.imshow(images[i])
        ax.axis("off")
        truth = ", ".join(df["objects"][i])
        lines = [f"truth: {truth}"]
        for arm in gift_arms.ARMS:
            row = captions.filter((pl.col("seed") == seed) & (pl.col("arm") == arm)
                                  & (pl.col("image_id") == rid))
            if row.height:
                mark = " ✗" if row["hallucinated"][0] else ""
                lines.append(f"{arm}: {row['caption'][0]}{mark}")
        ax.set_title("\n".join(lines), fontsize=6, loc="left")
    fig.tight_layout()
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.gift.decode import captions_spec, pope_spec

    folder = ctx.path(cfg.decoded)
    captions = read_parquet_checked(folder / "captions.parquet", captions_spec())
    pope = read_parquet_checked(folder / "pope.parquet", pope_spec())
    missing = sorted(set(gift_arms.ARMS) - set(captions["arm"].unique().to_list()))
    if missing:
        raise ValueError(f"{folder / 'captions.parquet'}: no rows for arms {missing}")
    decoded = ctx.stage_metrics("decode")
    calibrated = ctx.stage_metrics("calibrate")
    seeds = sorted(captions["seed"].unique().to_list())
    metrics: dict[str, float] = {"seeds": float(len(seeds)),
                                 "images": float(captions["image_id"].n_unique())}
    for arm in gift_arms.ARMS:
        for key, _ in COLUMNS:
            values = [decoded.get(f"seed{s}/{arm}/{key}", math.nan) for s in seeds]
            metrics[f"{arm}/{key}_mean"], metrics[f"{arm}/{key}_std"] = stats.mean_std(values)
            # seeds where the value is defined (POPE F1 is not when a model never says yes)
            metrics[f"{arm}/{key}_n"] = float(len(stats.finite(values)))
        if arm in gift_arms.HOOKED:
            alphas = [calibrated.get(f"seed{s}/{arm}/alpha", math.nan) for s in seeds]
            metrics[f"{arm}/alpha_mean"] = stats.mean_std(alphas)[0]
    shares = [decoded.get(f"seed{s}/sink_share", math.nan) for s in seeds]
    metrics["sink_share_mean"] = stats.mean_std(shares)[0]
    pope_constant = constant_answers(pope)
    metrics["pope_constant_answers"] = float(pope_constant)
    for name, (method, baseline, statistic, relative, direction, rule, paper, _
               ) in CLAIMS.items():
        if statistic.startswith("pope_") and untestable_pope(pope, method, baseline):
            metrics[f"claim/{name}/untestable"] = 1.0
            print(f"compare: {name}: not tested ({method} and {baseline} give the same constant "
                  f"answer to every question)")
            continue
        margin = cfg.pope_margin if rule == "noninferior" else None
        c = claim_for(captions, pope, method, baseline, statistic, relative, direction, paper,
                      cfg.draws, margin)
        metrics.update(stats.claim_metrics(c, f"claim/{name}"))
        if margin is not None:
            metrics[f"claim/{name}/margin"] = margin
        print(f"compare: {name}: {c.sentence()}")
    if cfg.sample_images:
        report = ctx.path(cfg.report)
        report.mkdir(parents=True, exist_ok=True)
        samples_figure(captions, ctx.path(cfg.data), cfg.sample_images, report / "samples.png")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: verdict counts and CHAIR_S of greedy and full GIFT (means over seeds)."""
    out = stats.verdict_counts(metrics)
    for arm in ("greedy", "gift"):
        if f"{arm}/chair_sentence_mean" in metrics:
            out[f"chair_{arm}"] = metrics[f"{arm}/chair_sentence_mean"]
    return out


def _cell(m: dict[str, Any], key: str, n_seeds: int) -> str:
    mean, std = m.get(f"{key}_mean", math.nan), m.get(f"{key}_std", math.nan)
    n = int(m.get(f"{key}_n", n_seeds))
    if n == 0:
        return "undefined"
    text = f"{mean:.3f}" + (f" ± {std:.3f}" if n > 1 else "")
    return text if n == n_seeds else f"{text} ({n}/{n_seeds})"


def results_table(metrics: dict[str, dict[str, Any]]) -> str:
    """The README block of `paperline report gift`: arms side by side, then every claim."""
    m = metrics.get("compare", {})
    if "greedy/chair_sentence_mean" not in m:
        return "_No results yet: run the pipeline._\n"
    n_seeds = int(m.get("seeds", 0))
    lines = [f"Test split ({int(m.get('images', 0))} images), mean ± std over {n_seeds} "
             f"`vlm-shapes` seeds; alpha per arm chosen on the validation split (mean over "
             f"seeds).", "",
             "| arm | alpha | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for arm in gift_arms.ARMS:
        alpha = m.get(f"{arm}/alpha_mean")
        cells = [_cell(m, f"{arm}/{k}", n_seeds) for k, _ in COLUMNS]
        lines.append(f"| {arm} | {'—' if alpha is None else f'{alpha:.2f}'} | "
                     + " | ".join(cells) + " |")
    lines += ["", f"Share of the greedy output tokens' visual attention on the 2 sink tokens: "
                  f"{m.get('sink_share_mean', math.nan):.3f} (mean over seeds).", "",
              "| claim | paired 95% CI over (seed, image) pairs, stratified by seed |", "|---|---|"]
    for name, (*_, text) in CLAIMS.items():
        c = stats.read_claim(m, f"claim/{name}")
        margin = m.get(f"claim/{name}/margin")
        if margin is not None:
            text += f" (non-inferiority, margin {margin:g})"
        if c is not None:
            lines.append(f"| {text} | {c.sentence()} |")
        elif m.get(f"claim/{name}/untestable"):
            lines.append(f"| {text} | **not tested**: GIFT and greedy give the same single "
                         "answer to every yes/no question in every seed |")
    lines += ["", "CHAIR claims are relative changes ((method − baseline) / baseline), POPE "
                  "claims differences in F1; CIs resample the images within each seed. A POPE "
                  "claim is reproduced when the whole CI lies above −margin (F1 does not fall by "
                  "more than the margin), contradicted when it lies below. A cell marked (k/n) "
                  "is over the k of n seeds where the value is defined (POPE F1 is not where a "
                  "model never answers yes to any question).", ""]
    return "\n".join(lines)
