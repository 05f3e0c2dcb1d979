"""Stage `decode` of GIFT: every arm on every `vlm-shapes` seed, on the TEST split.

Per seed and arm (greedy, vaf, gift_visual, gift; layers and alpha from `calibrate`, chosen on
the validation split): a caption of every test image (CHAIR, per image) and an answer to every
POPE question (one positive and one random, popular and adversarial negative per image). One
MLflow run per (arm, seed) with the common metric set. Per-image records go to
`<decoded>/captions.parquet` and `<decoded>/pope.parquet`, so `compare` pairs the arms image by
image. Also the attention-sink plot (GIFT spec §4: "check the attention sink first"): where the
greedy output tokens' attention lands among the visual tokens, sinks first
(`<plots>/sink_attention.csv`, `<report>/sink_attention.png`).

    python -m stages gift decode
"""

from __future__ import annotations

import math
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.gift import arms as gift_arms

CAPTION_SCHEMA: dict[str, pl.DataType] = {
    "seed": pl.Int64, "arm": pl.String, "image_id": pl.String, "caption": pl.String,
    "mentioned": pl.Int64, "hallucinated": pl.Int64, "correct": pl.Int64, "missed": pl.Int64,
    "chair_sentence": pl.Float64}
POPE_SCHEMA: dict[str, pl.DataType] = {
    "seed": pl.Int64, "arm": pl.String, "question_id": pl.String, "image_id": pl.String,
    "negative": pl.String, "answer": pl.String, "label_yes": pl.Float64, "pred_yes": pl.Float64,
    "correct": pl.Float64, "unparsed": pl.Float64}


def captions_spec() -> Any:
    """The checks `compare` runs on captions.parquet before any statistics."""
    from stages.core.checks import ColumnSpec, FrameSpec

    return FrameSpec(columns={
        "seed": ColumnSpec(dtype=pl.Int64, min=0), "arm": ColumnSpec(dtype=pl.String,
                                                                     values=gift_arms.ARMS),
        "image_id": ColumnSpec(dtype=pl.String), "caption": ColumnSpec(dtype=pl.String),
        "mentioned": ColumnSpec(dtype=pl.Int64, min=0),
        "hallucinated": ColumnSpec(dtype=pl.Int64, min=0),
        "correct": ColumnSpec(dtype=pl.Int64, min=0), "missed": ColumnSpec(dtype=pl.Int64, min=0),
        "chair_sentence": ColumnSpec(dtype=pl.Float64, values=(0.0, 1.0))}, min_rows=1)


def pope_spec() -> Any:
    from stages.core.checks import ColumnSpec, FrameSpec

    flag = {"dtype": pl.Float64, "values": (0.0, 1.0)}
    return FrameSpec(columns={
        "seed": ColumnSpec(dtype=pl.Int64, min=0),
        "arm": ColumnSpec(dtype=pl.String, values=gift_arms.ARMS),
        "question_id": ColumnSpec(dtype=pl.String), "image_id": ColumnSpec(dtype=pl.String),
        "negative": ColumnSpec(dtype=pl.String,
                               values=("positive", "random", "popular", "adversarial")),
        "answer": ColumnSpec(dtype=pl.String), "label_yes": ColumnSpec(**flag),
        "pred_yes": ColumnSpec(**flag), "correct": ColumnSpec(**flag),
        "unparsed": ColumnSpec(**flag)}, min_rows=1)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str = Field("vlm_data", description="path key: the vlm pipeline's task folder")
    models: str = Field("vlm_shapes", description="path key: the vlm pipeline's seed<k>/ models")
    out: str = Field("gift_decoded", description="path key: captions.parquet, pope.parquet")
    plots: str = Field("gift_plots", description="path key: the plot CSVs")
    report: str = Field("gift_report", description="path key: PNG figures")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="vlm-shapes seeds (as calibrated)")
    split: str = Field("test", description="the split the arms are measured on")
    max_rows: int | None = Field(None, ge=1, description="use at most this many images")
    caption_tokens: int = Field(24, ge=1, le=256, description="max new tokens of a caption")
    answer_tokens: int = Field(2, ge=1, le=16, description="max new tokens of a yes/no answer")
    sink_rows: int = Field(64, ge=1, description="images of the attention-sink plot")
    batch_size: int = Field(64, ge=1, le=4096, description="prompts per generate call")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads; 0 = all cores")


def summary(captions: list[dict[str, Any]], pope_rows: list[dict[str, Any]]) -> dict[str, float]:
    """The common metric set of one (arm, seed): CHAIR_S / CHAIR_I, caption F1 and recall, and
    POPE accuracy / F1 per negative kind (positives + that kind's negatives: balanced)."""
    from stages.evaluate import hallucination

    m = {**hallucination.chair(captions)}
    f1 = hallucination.objects_f1(captions)
    m["caption_f1"], m["caption_recall"] = f1["f1"], f1["recall"]
    for kind in ("random", "popular", "adversarial"):
        rows = [r for r in pope_rows if r["negative"] in ("positive", kind)]
        p = hallucination.pope(rows)
        m[f"pope_{kind}_acc"], m[f"pope_{kind}_f1"] = p["accuracy"], p["f1"]
    return m


def sink_plot(rows: list[dict[str, Any]], sinks: int, path: Any) -> None:
    """One line per seed: mean attention of the output tokens on each visual position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.8))
    for seed in sorted({r["seed"] for r in rows}):
        pts = [r for r in rows if r["seed"] == seed]
        ax.plot([r["position"] for r in pts], [r["attention"] for r in pts], lw=1,
                label=f"seed {seed}")
    if sinks:
        ax.axvspan(-0.5, sinks - 0.5, color="tab:red", alpha=0.15, label="sink tokens")
    ax.set_xlabel("visual token (sinks first, then 8x8 patches row by row)")
    ax.set_ylabel("attention of output tokens")
    ax.set_title("Where greedy captions look among the visual tokens (mean over layers, heads, "
                 "steps)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.evaluate import hallucination
    from stages.gift import calibrate
    from stages.models import vlm as vlm_model
    from stages.models.base import set_threads

    set_threads(cfg.num_threads)
    folder = ctx.path(cfg.models)
    missing = [s for s in cfg.seeds if not (folder / f"seed{s}" / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: no vlm-shapes model for seeds {missing}; run the vlm "
                                f"pipeline (paperline repro vlm) with these seeds")
    chosen = {seed: calibrate.chosen(ctx.stage_metrics("calibrate"), seed) for seed in cfg.seeds}
    df, images, qa, vocabulary, lexicon = gift_arms.load_split(ctx.path(cfg.data), cfg.split,
                                                               cfg.max_rows)
    index = {rid: i for i, rid in enumerate(df["id"].to_list())}
    q_images = [images[index[i]] for i in qa["image_id"]]
    labels = [bool(x) for x in qa["label"].to_list()]
    caption_rows: list[dict[str, Any]] = []
    pope_rows: list[dict[str, Any]] = []
    sink_rows: list[dict[str, Any]] = []
    metrics: dict[str, float] = {"test_images": float(len(df)), "test_questions": float(qa.height)}
    for seed in cfg.seeds:
        vlm = vlm_model.load_vlm(folder / f"seed{seed}")
        s_layer, e_layers, alphas = chosen[seed]
        prompts = [vlm_model.encode_image_prompt(vlm.layout, vlm.tokenizer, q)
                   for q in df["query"]]
        q_prompts = [vlm_model.encode_image_prompt(vlm.layout, vlm.tokenizer, q)
                     for q in qa["query"]]
        n = min(cfg.sink_rows, len(prompts))
        attention = gift_arms.output_attention(vlm, prompts[:n], images[:n], cfg.caption_tokens)
        sinks = vlm.layout.sink_tokens
        sink_rows += [{"seed": seed, "position": j, "kind": "sink" if j < sinks else "patch",
                       "attention": float(a)} for j, a in enumerate(attention)]
        metrics[f"seed{seed}/sink_share"] = float(attention[:sinks].sum() / attention.sum())
        for arm in gift_arms.ARMS:
            common = {"arm": arm, "alpha": alphas[arm], "saliency_layer": s_layer,
                      "enhance_layers": e_layers, "lexicon": lexicon,
                      "batch_size": cfg.batch_size}
            with ctx.method_run(ctx.stage, arm, seed,
                                params={"arm": arm, "seed": seed, "alpha": alphas[arm],
                                        "saliency_layer": s_layer,
                                        "enhance_layers": str(e_layers),
                                        "images": len(df)}) as mr:
                captions = gift_arms.decode(vlm, prompts, images,
                                            max_new_tokens=cfg.caption_tokens, **common)
                answers = gift_arms.decode(vlm, q_prompts, q_images,
                                           max_new_tokens=cfg.answer_tokens, **common)
                chair = hallucination.chair_per_image(captions, df["objects"].to_list(),
                                                      vocabulary)
                pope = hallucination.pope_per_item(answers, labels)
                rows_c = [{"seed": seed, "arm": arm, "image_id": rid, "caption": c,
                           **{k: r[k] for k in ("mentioned", "hallucinated", "correct",
                                                "missed", "chair_sentence")}}
                          for rid, c, r in zip(df["id"], captions, chair)]
                rows_p = [{"seed": seed, "arm": arm, "question_id": qid, "image_id": iid,
                           "negative": neg, "answer": a, **r}
                          for qid, iid, neg, a, r in zip(qa["id"], qa["image_id"],
                                                         qa["negative"], answers, pope)]
                m = summary(rows_c, rows_p)
                mr.log_metrics({k: v for k, v in m.items() if math.isfinite(v)})
            caption_rows += rows_c
            pope_rows += rows_p
            metrics.update({f"seed{seed}/{arm}/{k}": v for k, v in m.items()})
            print(f"decode: seed {seed} {arm} (alpha {alphas[arm]:g}): CHAIR_S "
                  f"{m['chair_sentence']:.3f}, CHAIR_I {m['chair_instance']:.3f}, recall "
                  f"{m['caption_recall']:.3f}, POPE adv F1 {m['pope_adversarial_f1']:.3f}")
    out = ctx.path(cfg.out)
    io.write_parquet(out / "captions.parquet", pl.DataFrame(caption_rows, schema=CAPTION_SCHEMA))
    io.write_parquet(out / "pope.parquet", pl.DataFrame(pope_rows, schema=POPE_SCHEMA))
    plots = ctx.path(cfg.plots)
    plots.mkdir(parents=True, exist_ok=True)
    frame = pl.DataFrame(sink_rows)
    with io.atomic_path(plots / "sink_attention.csv") as tmp:
        frame.write_csv(tmp)
    report = ctx.path(cfg.report)
    report.mkdir(parents=True, exist_ok=True)
    sink_plot(sink_rows, vlm.layout.sink_tokens, report / "sink_attention.png")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: CHAIR_S of each arm, mean over seeds (the rest in details/decode.json)."""
    from stages.core.stats import mean_std

    out = {}
    for arm in gift_arms.ARMS:
        values = [v for k, v in metrics.items() if k.endswith(f"/{arm}/chair_sentence")]
        if values:
            out[f"chair_{arm}"] = mean_std(values)[0]
    return out
