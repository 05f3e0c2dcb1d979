"""Stage `calibrate` of GIFT: the layers and alpha of every arm, per seed, on the VALIDATION split.

GIFT spec §4: "Choose L_s as the middle layer with the largest sum of positive change; L_e = the
next ~40% of layers; alpha grid {1, 2, 3, 5, 7}; pick alpha on a separate 200-image validation
split, not on the test split." Per `vlm-shapes` seed:

1. L_s / L_e: the gaze shift of every layer summed over the validation caption prompts
   (`gift.positive_change_per_layer`), then `gift.choose_layers`.
2. alpha per hooked arm (vaf, gift_visual, gift): caption every validation image at each alpha
   of the arm's grid (`alpha_grid` for GIFT's exponent, `vaf_alpha_grid` for VAF's factor on
   attention weights in [0, 1]); keep the alpha with the lowest CHAIR_S among those whose object recall stays
   within `recall_tolerance` of greedy's [ours]: without it, an alpha that makes captions
   shorter (fewer mentions, so fewer hallucinations) would win. Ties go to the smaller alpha.

The test split is never read here. Outputs: this stage's numbers (details/calibrate.json, read
by `decode` with `ctx.stage_metrics`).

    python -m stages gift calibrate
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from stages.gift import arms as gift_arms


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str = Field("vlm_data", description="path key: the vlm pipeline's task folder")
    models: str = Field("vlm_shapes", description="path key: the vlm pipeline's seed<k>/ models")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="vlm-shapes seeds (checkpoints) to calibrate")
    split: str = Field("val", description="the validation split (never test)")
    max_rows: int | None = Field(None, ge=1, description="use at most this many images")
    alpha_grid: list[float] = Field(default_factory=lambda: [1.0, 2.0, 3.0, 5.0, 7.0],
                                    min_length=1,
                                    description="GIFT's alpha values (m = exp(alpha s_hat))")
    vaf_alpha_grid: list[float] = Field(
        default_factory=lambda: [3.0, 10.0, 30.0, 100.0, 300.0], min_length=1,
        description="VAF's alpha values (a_j (1 + alpha a_j)): alpha scales attention weights in "
                    "[0, 1], about 0.01 per patch and 0.04 per sink here [ours]")
    enhance_fraction: float = Field(0.4, gt=0, le=1, description="L_e: this share of the layers")
    window: tuple[float, float] = Field((0.25, 0.75), description="L_s: middle-layer window")
    recall_tolerance: float = Field(0.1, ge=0, le=1,
                                    description="an alpha must keep object recall >= greedy's "
                                                "x (1 - this) [ours]")
    caption_tokens: int = Field(24, ge=1, le=256, description="max new tokens of a caption")
    batch_size: int = Field(64, ge=1, le=4096, description="prompts per generate call")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads; 0 = all cores")

    @field_validator("split")
    @classmethod
    def _not_test(cls, v: str) -> str:
        if v == "test":
            raise ValueError("alpha is chosen on a validation split, never on test (GIFT spec §4)")
        return v

    @field_validator("alpha_grid", "vaf_alpha_grid")
    @classmethod
    def _alphas(cls, v: list[float], info: ValidationInfo) -> list[float]:
        if any(a < 0 or not math.isfinite(a) for a in v):
            raise ValueError(f"{info.field_name} {v}: every alpha must be a finite number >= 0")
        return sorted(set(v))


def pick_alpha(results: dict[float, dict[str, float]], greedy_recall: float,
               tolerance: float) -> float:
    """The alpha with the lowest CHAIR_S among those keeping recall >= greedy's x (1 - tol);
    ties to the smaller alpha; when none keeps it, the alpha with the highest recall."""
    floor = greedy_recall * (1 - tolerance) if math.isfinite(greedy_recall) else -math.inf
    ok = [a for a, r in results.items() if r["recall"] >= floor]
    if not ok:
        return max(sorted(results), key=lambda a: results[a]["recall"])
    return min(sorted(ok), key=lambda a: results[a]["chair_sentence"])


def caption_scores(captions: list[str], df: Any, vocabulary: list[str]) -> dict[str, float]:
    from stages.evaluate import hallucination

    records = hallucination.chair_per_image(captions, df["objects"].to_list(), vocabulary)
    return {**hallucination.chair(records), **hallucination.objects_f1(records)}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.gift import gift
    from stages.models import vlm as vlm_model
    from stages.models.base import set_threads

    set_threads(cfg.num_threads)
    folder = ctx.path(cfg.models)
    missing = [s for s in cfg.seeds if not (folder / f"seed{s}" / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: no vlm-shapes model for seeds {missing}; run the vlm "
                                f"pipeline (paperline repro vlm) with these seeds")
    df, images, _, vocabulary, lexicon = gift_arms.load_split(ctx.path(cfg.data), cfg.split,
                                                              cfg.max_rows)
    metrics: dict[str, float] = {"val_images": float(len(df))}
    for seed in cfg.seeds:
        vlm = vlm_model.load_vlm(folder / f"seed{seed}")
        prompts = [vlm_model.encode_image_prompt(vlm.layout, vlm.tokenizer, q)
                   for q in df["query"]]
        change = gift_arms.layer_change(vlm, prompts, images, lexicon, cfg.batch_size)
        s_layer, e_layers = gift.choose_layers(change, cfg.enhance_fraction, cfg.window)
        key = f"seed{seed}"
        metrics.update({f"{key}/saliency_layer": float(s_layer),
                        f"{key}/enhance_first": float(e_layers[0]),
                        f"{key}/enhance_last": float(e_layers[-1])})
        metrics.update({f"{key}/change_layer{i}": float(c) for i, c in enumerate(change)})

        def captions(arm: str, alpha: float) -> dict[str, float]:
            return caption_scores(gift_arms.decode(
                vlm, prompts, images, arm=arm, alpha=alpha, saliency_layer=s_layer,
                enhance_layers=e_layers, lexicon=lexicon, max_new_tokens=cfg.caption_tokens,
                batch_size=cfg.batch_size), df, vocabulary)

        greedy = captions("greedy", 0.0)
        metrics.update({f"{key}/greedy/{k}": v for k, v in greedy.items()})
        for arm in gift_arms.HOOKED:
            grid = cfg.vaf_alpha_grid if arm == "vaf" else cfg.alpha_grid
            results = {alpha: captions(arm, alpha) for alpha in grid}
            for alpha, r in results.items():
                metrics.update({f"{key}/{arm}/alpha{alpha:g}/{k}": v for k, v in r.items()})
            best = pick_alpha(results, greedy["recall"], cfg.recall_tolerance)
            metrics[f"{key}/{arm}/alpha"] = best
            print(f"calibrate: seed {seed} {arm}: alpha {best:g} (val CHAIR_S "
                  + ", ".join(f"{a:g}: {r['chair_sentence']:.3f}" for a, r in results.items())
                  + f"; greedy {greedy['chair_sentence']:.3f})")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the chosen alpha of each arm (mean over seeds) and L_s of the first seed."""
    from stages.core.stats import mean_std

    out = {}
    for arm in gift_arms.HOOKED:
        values = [v for k, v in metrics.items() if k.endswith(f"/{arm}/alpha")]
        if values:
            out[f"alpha_{arm}"] = mean_std(values)[0]
    first = sorted(k for k in metrics if k.endswith("/saliency_layer"))
    if first:
        out["saliency_layer"] = metrics[first[0]]
    return out


def chosen(metrics: dict[str, float], seed: int) -> tuple[int, list[int], dict[str, float]]:
    """What `decode` reads back: (L_s, L_e, alpha per arm) of one seed."""
    key = f"seed{seed}"
    if f"{key}/saliency_layer" not in metrics:
        raise KeyError(f"calibrate has no result for seed {seed}: run it with the same seeds")
    first, last = int(metrics[f"{key}/enhance_first"]), int(metrics[f"{key}/enhance_last"])
    alphas = {arm: float(metrics[f"{key}/{arm}/alpha"]) for arm in gift_arms.HOOKED}
    alphas["greedy"] = 0.0
    return int(metrics[f"{key}/saliency_layer"]), list(range(first, last + 1)), alphas
