"""Stage `sft` of CoRe: the SFT arms on the `vlm-text` checkpoints, then every arm answers the
test split from the text and from the rendered page (ICML 2026, poster 64509; the math:
`stages.core_align.core`).

Each seed's `vlm-text` model (pipelines/vlm: it reads pages, OCR, but was never trained to
answer) is post-trained under each arm at the same step budget, on the same pairs
(x_txt = the page's characters as text + question, x_img = the rendered page + question, y* = the
exact answer):

- `text_sft`    CE(y* | x_txt)                                   the upper bound, read on text
- `visual_sft`  CE(y* | x_img)                                   the transfer failure
- `core_sft`    CE(y* | x_img) + lam L_match + mu CE(y* | x_txt)  CoRe-SFT (spec §2)

and `base` is the `vlm-text` model as it is (zero-shot). Every model answers every test item
greedily from both inputs; one row per (arm, seed, item, modality) goes to `answers.parquet`,
which the compare stage pairs item by item. Models are saved per arm and seed and registered as
`core-policy` (aliases `<arm>-seed<k>`, and `<arm>` for the first seed).

Engine: a plain torch loop (AdamW, linear warm-up, cosine decay to `min_lr_ratio`, gradient
clipping). Why not the transformers Trainer the substrate uses: a CoRe step scores the same
response after two different prompts (token ids and projected image patches) and mixes three
losses; `core.sft_step` does that in one call, and the two baselines are the same loop with one
branch, so every arm shares the optimiser, schedule, batches and seeds exactly.

    python -m stages core sft          # sizes per profile in pipelines/core/params.yaml
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.core.pool import map_jobs
from stages.core_align.core import CoReParams
from stages.core_align.pages import KINDS
from stages.models import vlm as vlm_model

ARMS = ("text_sft", "visual_sft", "core_sft")
RL_ARMS = ("visual_grpo", "core_grpo")
MODALITIES = ("text", "image")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str = Field("vlm_data", description="path key: rendered_text/{train,val,test}.parquet "
                                              "(the vlm pipeline's, or the pages stage's)")
    models: str = Field("vlm_text", description="path key: vlm-text checkpoints, seed<k>/")
    out: str = Field("core_models", description="path key: <arm>/seed<k>/ trained models")
    answers: str = Field("core_answers", description="path key: answers.parquet, one row per "
                                                     "(arm, seed, item, modality)")
    register_as: str | None = Field("core-policy", description="MLflow registered model name")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="vlm-text seeds; each arm trains once from each")
    arms: list[Literal["text_sft", "visual_sft", "core_sft"]] = Field(
        default_factory=lambda: list(ARMS), min_length=1, description="SFT arms to run")
    core: CoReParams = Field(default_factory=CoReParams,
                             description="CoRe-SFT's loss (lam, mu, divergence, ...)")
    kinds: list[Literal["kv", "arith", "table", "index"]] = Field(
        default_factory=lambda: ["kv", "arith", "table"], min_length=1,
        description="page kinds trained and evaluated")
    max_train_rows: int | None = Field(None, ge=1, description="use at most this many pages")
    split: Literal["val", "test"] = Field("test", description="split every arm answers")
    max_eval_rows: int | None = Field(None, ge=1, description="answer at most this many items")
    check_image_size: bool = Field(True, description="pages must have the model's input size "
                                                     "(tiny model); false for a real VLM whose "
                                                     "processor resizes (gpu)")
    steps: int = Field(300, ge=1, le=1_000_000, description="optimiser steps per arm and seed "
                                                           "(the equal budget)")
    batch_size: int = Field(16, ge=1, le=4096, description="pairs per step")
    lr: float = Field(1e-3, gt=0, le=1.0, description="peak learning rate")
    warmup: float = Field(0.05, ge=0, lt=1, description="linear warm-up, fraction of steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr * this")
    weight_decay: float = Field(0.01, ge=0, le=1, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, le=1e3, description="gradient clipping norm")
    answer_tokens: int = Field(24, ge=1, le=512, description="max new tokens of an answer "
                                                            "(the longest arith answer: ~16)")
    eval_batch_size: int = Field(64, ge=1, le=4096, description="prompts decoded together")
    log_every: int = Field(25, ge=1, description="log the losses every N steps")
    workers: int = Field(1, ge=1, le=64, description="seeds trained at once, each in its own "
                         "process; results do not depend on it, only wall time")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads per worker; 0 = the "
                                                          "cores split between the workers")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        for name in ("seeds", "arms", "kinds"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name} {values} repeat a value")
        if "core_sft" in self.arms and self.core.granularity == "step":
            raise ValueError("core.granularity = 'step' needs reasoning-step spans, which the "
                             "rendered-text answers do not carry: use 'token'")
        if "core_sft" in self.arms and self.core.anchor != "dynamic":
            raise ValueError(f"core.anchor = {self.core.anchor!r}: this stage runs the spec's "
                             f"default, the dynamic stop-gradient anchor")
        return self


# --- data -----------------------------------------------------------------------------------

def load_split(data_dir: Path, split: str, kinds: list[str], image_size: int | None,
               max_rows: int | None) -> tuple[Any, list[Any]]:
    """(rows, decoded page images) of one rendered-text split (the vlm pipeline's, or the
    `pages` stage's index pages), checked (GE suite, then every kept image decoded and
    size-checked) before any compute, filtered to `kinds`."""
    import polars as pl

    from stages.core.checks import read_parquet_checked
    from stages.core_align.pages import expectations
    from stages.tasks.images import decode_all

    path = data_dir / "rendered_text" / f"{split}.parquet"
    df = read_parquet_checked(path, expectations(split))
    keep = [i for i, k in enumerate(df["kind"].to_list()) if k in kinds]
    if max_rows:
        keep = keep[:max_rows]
    if not keep:
        raise ValueError(f"{path}: no rows of kinds {kinds}")
    rows = df.with_row_index("_row").filter(pl.col("_row").is_in(keep)).drop("_row")
    # image_size None (a pretrained model, whose processor resizes): every image the size of
    # the first
    images = decode_all(rows["image"], rows["id"], mode="L", source=str(path),
                        size=None if image_size is None else (image_size, image_size))
    return rows, images


def check_answer_room(tokenizer: Any, frames: list[Any], budget: int, name: str) -> None:
    """`budget` new tokens hold the longest target of `frames` and its eos; otherwise every
    longer answer would be cut and scored wrong: a named error before any compute."""
    longest = max(len(tokenizer(t, add_special_tokens=False)["input_ids"])
                  for df in frames for t in df["target"].unique())
    if budget < longest + 1:
        raise ValueError(f"{name} = {budget} new tokens: the longest target takes {longest} "
                         f"tokens + eos; raise it to at least {longest + 1}")


def encode_pairs(vlm: vlm_model.VLM, df: Any) -> list[dict[str, Any]]:
    """Per row: text prompt ids (x_txt), image prompt ids (x_img, `<image>` expanded) and the
    response ids (y* + eos), the same tokens after both prompts (spec §6 pitfall)."""
    tok, layout = vlm.tokenizer, vlm.layout
    image_ids: dict[str, list[int]] = {}
    rows = []
    for content, query, target in zip(df["content"], df["query"], df["target"]):
        if query not in image_ids:
            image_ids[query] = vlm_model.encode_image_prompt(layout, tok, query)
        rows.append({"text": vlm_model.encode_text_prompt(layout, tok, content, query),
                     "image": image_ids[query],
                     "response": tok(target, add_special_tokens=False)["input_ids"]
                     + [tok.eos_token_id]})
    return rows


def right_pad(rows: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def image_branch(model: Any, ids: Any, mask: Any, pixels: Any) -> Any:
    """x_img as a `Branch` of prompt embeddings: the token embeddings with each `<image>` run
    replaced by the projected patches of its page (what LLaVA's forward does inside)."""
    from stages.core_align.core import Branch

    embeds = model.get_input_embeddings()(ids)
    feats = model.get_image_features(pixel_values=pixels.to(embeds.dtype))
    feats = feats.pooler_output if hasattr(feats, "pooler_output") else feats
    feats = feats if not isinstance(feats, (list, tuple)) else __import__("torch").cat(feats)
    where = (ids == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(where, feats.reshape(-1, embeds.shape[-1]).to(embeds.dtype))
    return Branch(inputs_embeds=embeds, attention_mask=mask)


def batch_branches(model: Any, pairs: list[dict[str, Any]], pixels: Any, idx: list[int],
                   pad_id: int) -> tuple[Any, Any, Any, Any]:
    """(text Branch, image Branch, response ids, response mask) of the rows `idx`."""
    from stages.core_align.core import Branch

    t_ids, t_mask = vlm_model.left_pad([pairs[i]["text"] for i in idx], pad_id)
    i_ids, i_mask = vlm_model.left_pad([pairs[i]["image"] for i in idx], pad_id)
    r_ids, r_mask = right_pad([pairs[i]["response"] for i in idx], pad_id)
    device = model.device
    text = Branch(input_ids=t_ids.to(device), attention_mask=t_mask.to(device))
    image = image_branch(model, i_ids.to(device), i_mask.to(device), pixels[idx].to(device))
    return text, image, r_ids.to(device), r_mask.to(device)


# --- one arm --------------------------------------------------------------------------------

def arm_loss(arm: str, model: Any, pairs: list[dict[str, Any]], pixels: Any, idx: list[int],
             pad_id: int, core: CoReParams) -> tuple[Any, dict[str, float]]:
    """The loss of one batch under `arm` and its parts."""
    from stages.core_align.core import core_sft_loss, response_ce, response_logits

    text, image, r_ids, r_mask = batch_branches(model, pairs, pixels, idx, pad_id)
    if arm == "core_sft":
        return core_sft_loss(model, text, image, r_ids, r_mask, core)
    branch = text if arm == "text_sft" else image
    loss = response_ce(response_logits(model, branch, r_ids, r_mask), r_ids, r_mask)
    return loss, {"loss": loss.item(), "ce_txt" if arm == "text_sft" else "ce_img": loss.item()}


def train_arm(cfg: Config, arm: str, vlm: vlm_model.VLM, pairs: list[dict[str, Any]],
              pixels: Any, seed: int, log: Any = None) -> dict[str, float]:
    """`cfg.steps` optimiser steps of `arm` on `vlm` in place; the batches depend on the seed
    only, so every arm of a seed sees the same pairs in the same order."""
    import torch
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    model, tok = vlm.model, vlm.tokenizer
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            betas=(0.9, 0.98))
    sched = get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=int(cfg.warmup * cfg.steps), num_training_steps=cfg.steps,
        min_lr_rate=cfg.min_lr_ratio)
    sums: dict[str, float] = {}
    history: list[dict[str, float]] = []
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(1, cfg.steps + 1):
        idx = [rng.randrange(len(pairs)) for _ in range(cfg.batch_size)]
        opt.zero_grad(set_to_none=True)
        loss, parts = arm_loss(arm, model, pairs, pixels, idx, tok.pad_token_id, cfg.core)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"{arm}, seed {seed}: loss {loss.item()} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        sched.step()
        if vlm.sink_norm is not None and vlm.layout.sink_tokens:
            vlm_model.restore_sinks(model, tok, vlm.sink_norm)
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + v
        if step % cfg.log_every == 0 or step == cfg.steps:
            n = cfg.log_every if step % cfg.log_every == 0 else step % cfg.log_every
            point = {f"train/{k}": v / n for k, v in sums.items()}
            history.append(point)
            sums = {}
            if log is not None:
                log(point, step)
    model.eval()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    first, last = history[0], history[-1]
    return {**{f"first_{k[6:]}": v for k, v in first.items()},
            **{f"final_{k[6:]}": v for k, v in last.items()},
            "train_seconds": wall, "train_cpu_seconds": cpu}


# --- answers --------------------------------------------------------------------------------

def answer_rows(vlm: vlm_model.VLM, df: Any, images: list[Any], arm: str, seed: int,
                cfg: Config) -> list[dict[str, Any]]:
    """Greedy answers of `vlm` to every item from the text and from the page, verified."""
    from stages.tasks import rendered_text

    tok, layout = vlm.tokenizer, vlm.layout
    items = df.select("id", "kind", "difficulty", "content", "query", "answer").to_dicts()
    prompts = {
        "text": [vlm_model.encode_text_prompt(layout, tok, r["content"], r["query"])
                 for r in items],
        "image": [vlm_model.encode_image_prompt(layout, tok, r["query"]) for r in items]}
    nll = answer_nll(vlm, df, images, cfg.eval_batch_size)
    out = []
    for modality in MODALITIES:
        said = vlm_model.generate(vlm, prompts[modality], images if modality == "image" else None,
                                  max_new_tokens=cfg.answer_tokens,
                                  batch_size=cfg.eval_batch_size)
        for i, (r, completion) in enumerate(zip(items, said)):
            out.append({"arm": arm, "seed": seed, "item": r["id"], "kind": r["kind"],
                        "difficulty": r["difficulty"], "modality": modality,
                        "completion": completion,
                        "correct": int(rendered_text.verify_answer(r, completion)),
                        "nll": nll[modality][i]})
    return out


def answer_nll(vlm: vlm_model.VLM, df: Any, images: list[Any], batch_size: int
               ) -> dict[str, list[float]]:
    """Per item, the mean negative log-likelihood per token of the reference answer y* (+ eos)
    after the text and after the page, teacher-forced: a graded measure of how close each
    input's policy is to the answer, where greedy accuracy sits at the floor."""
    import torch

    from stages.core_align.core import response_logits

    pairs = encode_pairs(vlm, df)
    pixels = vlm_model.pixel_values(vlm.processor, images)
    out: dict[str, list[float]] = {m: [] for m in MODALITIES}
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            idx = list(range(start, min(start + batch_size, len(pairs))))
            text, image, r_ids, r_mask = batch_branches(vlm.model, pairs, pixels, idx,
                                                        vlm.tokenizer.pad_token_id)
            for modality, branch in (("text", text), ("image", image)):
                logits = response_logits(vlm.model, branch, r_ids, r_mask).float()
                tok_nll = -logits.log_softmax(-1).gather(-1, r_ids.unsqueeze(-1)).squeeze(-1)
                m = r_mask.to(tok_nll.dtype)
                out[modality] += ((tok_nll * m).sum(1) / m.sum(1)).tolist()
    return out


def answers_spec() -> Any:
    """The contract of answers.parquet (compare checks it before it reads a number)."""
    import polars as pl

    from stages.core.checks import ColumnSpec, FrameSpec

    return FrameSpec(columns={
        "arm": ColumnSpec(dtype=pl.String, values=("base", *ARMS, *RL_ARMS)),
        "seed": ColumnSpec(dtype=pl.Int64, min=0), "item": ColumnSpec(dtype=pl.String),
        "kind": ColumnSpec(dtype=pl.String, values=KINDS),
        "difficulty": ColumnSpec(dtype=pl.Int64, min=0),
        "modality": ColumnSpec(dtype=pl.String, values=MODALITIES),
        "completion": ColumnSpec(dtype=pl.String),
        "correct": ColumnSpec(dtype=pl.Int64, values=(0, 1)),
        "nll": ColumnSpec(dtype=pl.Float64, min=0)}, min_rows=1)


ANSWER_SCHEMA = {"arm": "String", "seed": "Int64", "item": "String", "kind": "String",
                 "difficulty": "Int64", "modality": "String", "completion": "String",
                 "correct": "Int64", "nll": "Float64"}


def answers_frame(rows: list[dict[str, Any]]) -> Any:
    import polars as pl

    return pl.DataFrame(rows, schema={k: getattr(pl, v) for k, v in ANSWER_SCHEMA.items()})


def mean_nll(rows: list[dict[str, Any]], modality: str) -> float:
    sel = [r["nll"] for r in rows if r["modality"] == modality]
    return sum(sel) / len(sel) if sel else math.nan


def accuracy(rows: list[dict[str, Any]], modality: str) -> float:
    sel = [r["correct"] for r in rows if r["modality"] == modality]
    return sum(sel) / len(sel) if sel else math.nan


# --- the stage ------------------------------------------------------------------------------

def seed_arms(cfg: Config, seed: int, model_dir: Path, train_df: Any, train_images: list[Any],
              eval_df: Any, eval_images: list[Any], out: Path) -> dict[str, Any]:
    """Every arm of one seed from `model_dir`: train, answer, save to `out/<arm>/seed<k>`.
    Returns {"rows": answer rows, "metrics": {<arm>/<k>: v}, "logs": {arm: [(point, step)]}}."""
    rows: list[dict[str, Any]] = []
    metrics: dict[str, float] = {}
    logs: dict[str, list[tuple[dict[str, float], int]]] = {}
    pixels = None
    for arm in ("base", *cfg.arms):
        vlm = vlm_model.load_vlm(model_dir)
        if pixels is None:
            pixels = vlm_model.pixel_values(vlm.processor, train_images)
        logs[arm] = []
        m: dict[str, float] = {}
        if arm != "base":
            pairs = encode_pairs(vlm, train_df)
            m = train_arm(cfg, arm, vlm, pairs, pixels, seed,
                          lambda point, step, arm=arm: logs[arm].append((point, step)))
            vlm_model.save_vlm(vlm, out / arm / f"seed{seed}")
        got, acc = score_arm(vlm, eval_df, eval_images, arm, seed, cfg, "sft")
        rows += got
        metrics.update({f"{arm}/{k}": v for k, v in {**m, **acc}.items()})
    return {"rows": rows, "metrics": metrics, "logs": logs}


def score_arm(vlm: vlm_model.VLM, eval_df: Any, eval_images: list[Any], arm: str, seed: int,
              cfg: Any, stage: str) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One trained arm answers the eval split from the text and from the page: (answer rows,
    {acc_<modality>, nll_<modality>}). Shared by the sft and grpo stages."""
    got = answer_rows(vlm, eval_df, eval_images, arm, seed, cfg)
    acc = {f"acc_{mod}": accuracy(got, mod) for mod in MODALITIES}
    acc.update({f"nll_{mod}": mean_nll(got, mod) for mod in MODALITIES})
    print(f"{stage}: seed {seed} {arm}: accuracy text {acc['acc_text']:.3f}, image "
          f"{acc['acc_image']:.3f}", flush=True)
    return got, acc


def _seed_job(job: tuple[Any, ...]) -> dict[str, Any]:
    """One seed in a worker process (spawned: no forked torch or MLflow threads)."""
    from stages.models.base import set_threads

    threads, cfg, *args = job
    set_threads(threads)
    return seed_arms(Config.model_validate(cfg), *args)


def map_seeds(cfg: Any, seed_arms_fn: Any, job_fn: Any, models: Path, train: tuple[Any, Any],
              evaluation: tuple[Any, Any], out: Path) -> list[dict[str, Any]]:
    """Run `seed_arms_fn(cfg, seed, models/seed<k>, *train, *evaluation, out)` for every seed,
    in `cfg.workers` spawned processes (`job_fn`, the module's picklable `_seed_job`) or in this
    one; the seeds' checkpoints land in `out`. Shared by the sft and grpo stages."""
    from stages.models.base import set_threads

    workers = min(cfg.workers, len(cfg.seeds))
    threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // workers)
    jobs = [(threads, cfg.model_dump(mode="json"), seed, models / f"seed{seed}", *train,
             *evaluation, out) for seed in cfg.seeds]
    print(f"{workers} worker(s) x {threads} thread(s)", flush=True)
    if workers > 1:
        return map_jobs(job_fn, jobs, workers)
    set_threads(threads)
    return [seed_arms_fn(cfg, *job[2:]) for job in jobs]


def record_seeds(ctx: Any, cfg: Any, stage: str, results: list[dict[str, Any]],
                 metrics: dict[str, float], settings: Any, out: Path) -> None:
    """Per-seed metrics into `metrics` (`seed<k>/<arm>/<name>`), one MLflow method run per
    (arm, seed) with its training curve and final metrics (`settings(arm, seed)` its params),
    the answers parquet, and each trained checkpoint registered with arm aliases."""
    rows: list[dict[str, Any]] = []
    for seed, result in zip(cfg.seeds, results):
        rows += result["rows"]
        metrics.update({f"seed{seed}/{k}": v for k, v in result["metrics"].items()})
        for arm, logged in result["logs"].items():
            with ctx.method_run(stage, arm, seed, params=settings(arm, seed)) as mr:
                for point, step in logged:
                    mr.log_metrics(point, step)
                mr.log_metrics({k.split("/", 1)[1]: v for k, v in result["metrics"].items()
                                if k.startswith(f"{arm}/") and math.isfinite(v)})
    io.write_parquet(ctx.path(cfg.answers) / "answers.parquet", answers_frame(rows))
    if cfg.register_as and ctx.tracker is not None:
        for seed in cfg.seeds:
            for arm in cfg.arms:
                aliases = [f"{arm}-seed{seed}".replace("_", "-")]
                if seed == cfg.seeds[0]:
                    aliases.append(arm.replace("_", "-"))
                ctx.tracker.register_model(
                    out / arm / f"seed{seed}", cfg.register_as, aliases,
                    tags={"paperline.method": arm, "paperline.seed": str(seed)},
                    artifact_path=f"model-{arm}-seed{seed}")


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    models = ctx.path(cfg.models)
    missing = [s for s in cfg.seeds if not (models / f"seed{s}" / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"{models}: no vlm-text checkpoint for seeds {missing} (run the "
                                f"vlm pipeline's train_text, or set seeds)")
    first = vlm_model.load_vlm(models / f"seed{cfg.seeds[0]}")
    size = first.model.config.vision_config.image_size if cfg.check_image_size else None
    data_dir = ctx.path(cfg.data)
    train_df, train_images = load_split(data_dir, "train", cfg.kinds, size, cfg.max_train_rows)
    eval_df, eval_images = load_split(data_dir, cfg.split, cfg.kinds, size, cfg.max_eval_rows)
    check_answer_room(first.tokenizer, [eval_df], cfg.answer_tokens, "answer_tokens")
    chars = eval_df["chars_per_token"].to_list()
    metrics: dict[str, float] = {
        "train_pairs": float(train_df.height), "eval_items": float(eval_df.height),
        "chars_per_visual_token": sum(chars) / len(chars),
        "visual_tokens": float(eval_df["visual_tokens"][0]), "steps": float(cfg.steps),
        "batch_size": float(cfg.batch_size)}
    print(f"{ctx.stage}: {train_df.height} train pairs, {eval_df.height} {cfg.split} items, "
          f"arms {cfg.arms}, seeds {cfg.seeds}, {cfg.steps} steps x {cfg.batch_size}",
          flush=True)
    out = ctx.path(cfg.out)
    with io.atomic_path(out, is_dir=True) as tmp:
        results = map_seeds(cfg, seed_arms, _seed_job, models, (train_df, train_images),
                            (eval_df, eval_images), tmp)
    record_seeds(ctx, cfg, "sft", results, metrics,
                 lambda arm, seed: {"arm": arm, "seed": seed,
                                    "steps": 0 if arm == "base" else cfg.steps,
                                    **({"core": cfg.core.model_dump()} if arm == "core_sft"
                                       else {})}, out)
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics (a short flat table): the compression ratio and the accuracy of each arm on
    its own input, means over seeds; every other number in details/sft.json."""
    from stages.core.stats import mean_std

    out = {k: metrics[k] for k in ("chars_per_visual_token",) if k in metrics}
    for arm, mod in (("text_sft", "text"), ("visual_sft", "image"), ("core_sft", "image")):
        vals = [v for k, v in metrics.items() if k.startswith("seed")
                and k.endswith(f"/{arm}/acc_{mod}")]
        if vals:
            out[f"{arm}_{mod}"] = mean_std(vals)[0]
    return out
