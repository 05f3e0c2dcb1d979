"""Stages `train_shapes` / `train_text`: the tiny VLMs of the vision papers, one per seed.

What it does: builds a tiny LLaVA (stages/models/vlm.py) over a tokenizer made from the train
split, trains it from scratch by completion-only SFT on the family's tasks, saves one
`save_pretrained` folder per seed (`<out>/seed<k>/`) and registers each in MLflow
(`vlm-shapes`, `vlm-text`; aliases `seed-<k>`, `champion` on the first seed).

- `shapes` (GIFT, and the later SAME / BridgeVLM substrate): word tokenizer; every train image
  gives its caption (`describe the image .` -> `a red circle and a blue triangle`) and its
  yes/no questions (`is there a green square ?` -> `yes` / `no`).
- `rendered_text` (CoRe spec §4 phase 1, "pre-train on text answers and on OCR"): pair
  tokenizer (one token per two characters = one visual token); every train page gives OCR
  (image + `read` -> the content) `ocr_repeats` times and the text-conditioned answer (content
  as text + question -> answer) `text_qa_repeats` times. The image-conditioned answer is NOT
  trained here: that is the transfer CoRe studies.

The auxiliary patch loss (`aux_weight`, below `VLMCollator`) is what makes these models look at
the image within the cpu budget; pipelines/vlm/README.md has the measurements.

Engine: the transformers `Trainer`, as the base model (stages/models/base.py), with a collator
that puts each batch's images in `pixel_values`; a callback puts the constant sink row back after
every optimiser step (AdamW's decoupled weight decay would shrink it even without a gradient).
Images are decoded and checked once (stages/tasks/images.py) before any training.

    python -m stages vlm train_shapes      # sizes per profile in pipelines/vlm/params.yaml
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.models import vlm as vlm_model

FAMILIES = ("shapes", "rendered_text")
OCR_QUERY = "read"


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: Literal["shapes", "rendered_text"] = Field(description="task family to train on")
    data: str = Field("vlm_data", description="path key of the data stage's folder")
    out: str = Field(description="path key of the output folder (one seed<k>/ per seed)")
    register_as: str | None = Field(None, description="MLflow registered model name")
    tokenizer: Literal["word", "char", "pair"] = Field(
        "word", description="init=scratch: word (shapes), char or pair (rendered text: one "
                            "token per two characters, as one visual token)")
    init: Literal["scratch", "pretrained"] = Field(
        "scratch", description="scratch: a new tiny VLM (spec, layout); pretrained: fine-tune "
                               "the local HF VLM folder at `pretrained_path` (gpu profile)")
    pretrained_path: str | None = Field(
        None, description="local folder of a LLaVA-style HF VLM (init=pretrained); never a hub "
                          "id, loaded offline without remote code; its layout is `layout`")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="training seeds, one model each")
    spec: vlm_model.Spec = Field(default_factory=vlm_model.Spec, description="architecture")
    layout: vlm_model.Layout = Field(default_factory=vlm_model.Layout,
                                     description="prompt template")
    # What each train row contributes (repeats of each example kind per epoch).
    caption_repeats: int = Field(1, ge=0, le=100, description="shapes: caption examples per image")
    question_repeats: int = Field(1, ge=0, le=100, description="shapes: each yes/no question")
    ocr_repeats: int = Field(1, ge=0, le=100, description="rendered_text: OCR examples per row")
    text_qa_repeats: int = Field(1, ge=0, le=100,
                                 description="rendered_text: text-conditioned answers per row")
    max_train_rows: int | None = Field(None, ge=1, description="use at most this many images")
    aux_weight: float = Field(1.0, ge=0, le=100,
                              description="weight of the auxiliary patch loss (0: off; see "
                                          "module docstring); training only, not saved")
    aux_lm_head: bool = Field(False, description="score the patch targets with the decoder's "
                                                 "own output layer (one slot only): a visual "
                                                 "token then already points at the token its "
                                                 "patch shows")
    text_cell: tuple[int, int] = Field((4, 8), description="rendered_text: glyph cell (w, h) "
                                                           "in pixels, for the patch targets")
    # Optimisation (as stages/models/base.py).
    steps: int = Field(100, ge=0, le=1_000_000,
                       description="optimiser steps per seed (0: save the initial model)")
    batch_size: int = Field(32, ge=1, le=4096, description="examples per step")
    lr: float = Field(2e-3, gt=0, le=1.0, description="peak learning rate")
    warmup: float = Field(0.05, ge=0, lt=1, description="linear warm-up, fraction of steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr * this")
    weight_decay: float = Field(0.01, ge=0, le=1, description="AdamW weight decay")
    adam_beta2: float = Field(0.98, gt=0, lt=1, description="AdamW beta2")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    log_every: int = Field(25, ge=1, description="log the training loss every N steps")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads; 0 = all cores")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        if self.init == "pretrained" and not self.pretrained_path:
            raise ValueError("init=pretrained needs pretrained_path (a local VLM folder)")
        if self.init == "scratch" and self.layout.image_tokens != self.spec.patch_tokens:
            raise ValueError(f"layout.image_tokens = {self.layout.image_tokens} but spec gives "
                             f"{self.spec.patch_tokens} patch tokens ((image_size / patch_size)^2 "
                             f"= ({self.spec.image_size} / {self.spec.patch_size})^2)")
        if self.family == "shapes" and self.caption_repeats + self.question_repeats == 0:
            raise ValueError("caption_repeats and question_repeats are both 0: nothing to train")
        if self.family == "rendered_text" and self.ocr_repeats + self.text_qa_repeats == 0:
            raise ValueError("ocr_repeats and text_qa_repeats are both 0: nothing to train")
        return self


# --- data -----------------------------------------------------------------------------------

def load_family(data_dir: Path, family: str, split: str, image_size: int | None
                ) -> tuple[Any, list[Any], Any]:
    """(image table, decoded images, question table or None) of one split, validated: the GE
    suite on each table, then every image decoded and size-checked, before any compute."""
    from stages.core.checks import read_parquet_checked
    from stages.tasks import rendered_text, shapes
    from stages.tasks.images import decode_all

    if family == "shapes":
        path = data_dir / "shapes" / f"{split}.parquet"
        df = read_parquet_checked(path, shapes.expectations(None, split))
        qa = read_parquet_checked(data_dir / "shapes" / f"{split}_questions.parquet",
                                  shapes.question_expectations(None, split))
        mode = "RGB"
    else:
        path = data_dir / "rendered_text" / f"{split}.parquet"
        df = read_parquet_checked(path, rendered_text.expectations(None, split))
        qa, mode = None, "L"
    # image_size None (a pretrained model, whose processor resizes): every image the size of
    # the first
    images = decode_all(df["image"], df["id"], mode=mode, source=str(path),
                        size=None if image_size is None else (image_size, image_size))
    return df, images, qa


def tokenizer_texts(family: str, df: Any, qa: Any, layout: vlm_model.Layout) -> list[str]:
    """Every text the model reads or writes (the tokenizer's vocabulary comes from these)."""
    texts = [layout.system, layout.sep, layout.tail, layout.text_system]
    texts += df["query"].to_list() + df["target"].to_list()
    if family == "shapes":
        texts += qa["query"].to_list() + qa["target"].to_list()
    else:
        texts += df["content"].to_list() + [OCR_QUERY]
    return texts


def build_examples(cfg: Config, family: str, df: Any, qa: Any, tokenizer: Any
                   ) -> list[dict[str, Any]]:
    """Training examples: {img: image index or -1, input_ids, labels} (loss on the target)."""
    layout = cfg.layout
    eos = tokenizer.eos_token_id

    def example(img: int, prompt: list[int], target: str) -> dict[str, Any]:
        t = tokenizer(target, add_special_tokens=False)["input_ids"] + [eos]
        return {"img": img, "input_ids": prompt + t, "labels": [-100] * len(prompt) + t}

    cache: dict[str, list[int]] = {}

    def image_prompt(query: str) -> list[int]:
        if query not in cache:
            cache[query] = vlm_model.encode_image_prompt(layout, tokenizer, query)
        return cache[query]

    rows: list[dict[str, Any]] = []
    if family == "shapes":
        index = {rid: i for i, rid in enumerate(df["id"].to_list())}
        for i, (q, t) in enumerate(zip(df["query"], df["target"])):
            rows += [example(i, image_prompt(q), t)] * cfg.caption_repeats
        for image_id, q, t in zip(qa["image_id"], qa["query"], qa["target"]):
            if image_id in index:
                rows += [example(index[image_id], image_prompt(q), t)] * cfg.question_repeats
    else:
        for i, (content, q, t) in enumerate(zip(df["content"], df["query"], df["target"])):
            rows += [example(i, image_prompt(OCR_QUERY), content)] * cfg.ocr_repeats
            text = vlm_model.encode_text_prompt(layout, tokenizer, content, q)
            rows += [example(-1, text, t)] * cfg.text_qa_repeats
    too_long = max(len(r["input_ids"]) for r in rows)
    if too_long > cfg.spec.max_positions:
        raise ValueError(f"spec.max_positions = {cfg.spec.max_positions} but an example has "
                         f"{too_long} tokens")
    return rows


class VLMCollator:
    """Right-pads a batch; the images of the rows that have one go to `pixel_values` in row
    order (LLaVA fills the `<image>` runs in that order)."""

    def __init__(self, images: list[Any], processor: Any, targets: Any = None):
        self.images, self.processor, self.targets = images, processor, targets
        self.pad_id = processor.tokenizer.pad_token_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            mask[i, :n] = 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        with_image = [r["img"] for r in rows if r["img"] >= 0]
        if with_image:
            batch["pixel_values"] = vlm_model.pixel_values(self.processor,
                                                           [self.images[i] for i in with_image])
            if self.targets is not None:
                batch["patch_targets"] = self.targets[with_image]
        return batch


# --- the auxiliary patch loss ---------------------------------------------------------------
# Trained end to end from scratch, the decoder learns its language long before it learns to look:
# at the start its attention averages ~70 visual tokens, so the gradient that reaches the patch
# encoder is faint, and in 800 steps (the cpu budget) the caption F1 stayed at chance (measured,
# see README). A linear head on every projected visual token, trained to name what that patch
# shows (shapes: the colour and shape word of the object over it, or <pad>; rendered text: the
# characters of its cells), gives the encoder a direct signal, as dense (per-region)
# supervision does in detection-pretrained encoders. The head is dropped before saving: the
# saved model is a plain LLaVA.

def patch_targets(family: str, df: Any, tokenizer: Any, spec: vlm_model.Spec,
                  text_cell: tuple[int, int]) -> Any:
    """(images, patch tokens, slots) token ids each visual token should name.

    shapes: 2 slots, the colour and the shape word of the object covering at least a quarter of
    the patch (<pad> for background); rendered_text: the tokens of the characters in the patch's
    glyph cells, row by row (pair tokenizer with 2 cells per patch: one slot)."""
    import torch

    p, side = spec.patch_size, spec.image_size // spec.patch_size
    ids = tokenizer.convert_tokens_to_ids
    if family == "shapes":
        out = torch.full((len(df), side * side, 2), tokenizer.pad_token_id, dtype=torch.long)
        for i, row in enumerate(df.select("objects", "xs", "ys", "sizes").iter_rows()):
            for name, x, y, s in zip(*row):
                colour, shape = name.split(" ")
                x0, y0 = x - s / 2, y - s / 2
                for t in range(side * side):
                    r, c = divmod(t, side)
                    w = min(x0 + s, (c + 1) * p) - max(x0, c * p)
                    h = min(y0 + s, (r + 1) * p) - max(y0, r * p)
                    if w > 0 and h > 0 and w * h >= p * p / 4:
                        out[i, t] = torch.tensor([ids(colour), ids(shape)])
        return out
    cw, ch = text_cell
    per_row, per_col = p // ch, p // cw            # glyph lines / columns inside one patch
    cols = spec.image_size // cw                   # characters per page line
    rows = []
    for content in df["content"]:
        page = content.ljust(cols * (spec.image_size // ch))
        chunks = []
        for t in range(side * side):
            r, c = divmod(t, side)
            chunks.append("".join(page[(r * per_row + a) * cols + c * per_col:
                                       (r * per_row + a) * cols + (c + 1) * per_col]
                                  for a in range(per_row)))
        # what the patch shows, in the model's own tokens (pair: one token; char: one each)
        rows.append([tokenizer(chunk, add_special_tokens=False)["input_ids"] for chunk in chunks])
    slots = max(len(ids) for r in rows for ids in r)
    out = torch.full((len(df), side * side, slots), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        for t, ids in enumerate(r):
            out[i, t, :len(ids)] = torch.tensor(ids)
    return out


def attach_aux_head(model: Any, slots: int, vocab: int, lm_head: bool = False
                    ) -> dict[str, Any]:
    """Add `model.aux_head` (hidden -> slots x vocab; with `lm_head`, the model's own output
    layer) and a hook that keeps the projector's output of the current forward; returns the
    dict the hook writes to."""
    import torch

    hidden = model.config.get_text_config().hidden_size
    seen: dict[str, Any] = {"shared": lm_head}
    if lm_head:
        model.aux_head = model.get_output_embeddings()
    else:
        model.aux_head = torch.nn.Linear(hidden, slots * vocab)

    def keep(module: Any, args: Any, output: Any) -> None:
        seen["features"] = output

    seen["hook"] = model.model.multi_modal_projector.register_forward_hook(keep)
    return seen


def detach_aux_head(model: Any, seen: dict[str, Any]) -> None:
    seen["hook"].remove()
    del model.aux_head          # with lm_head: only the second name goes, the layer stays


# --- training -------------------------------------------------------------------------------

def initial_vlm(cfg: Config, tokenizer: Any | None) -> vlm_model.VLM:
    """The model a seed starts from: a fresh tiny VLM (draws from the seeded global generator)
    or the local pretrained folder, loaded through `load_vlm` (the Auto classes, offline)."""
    if cfg.init == "pretrained":
        return vlm_model.load_vlm(cfg.pretrained_path or "", layout=cfg.layout)
    model, processor = vlm_model.build_vlm(cfg.spec, cfg.layout, tokenizer)
    return vlm_model.VLM(model=model, processor=processor, layout=cfg.layout,
                         sink_norm=cfg.spec.sink_norm)


def train_one(cfg: Config, vlm: vlm_model.VLM, examples: list[dict[str, Any]], images: list[Any],
              seed: int, log: Any = None, targets: Any = None) -> dict[str, float]:
    """SFT `vlm` in place on `examples` (HF Trainer, seeded), plus `aux_weight` x the patch loss
    on `targets` (see `patch_targets`) when given; returns the loop's numbers."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, tokenizer = vlm.model, vlm.tokenizer
    model.train()
    aux = None
    if targets is not None and cfg.aux_weight > 0:
        if cfg.aux_lm_head and targets.shape[-1] != 1:
            raise ValueError(f"aux_lm_head needs one patch target per visual token, got "
                             f"{targets.shape[-1]} (use the pair tokenizer)")
        aux = attach_aux_head(model, targets.shape[-1], len(tokenizer), cfg.aux_lm_head)
    aux_losses: list[float] = []

    class VLMTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            wanted = inputs.pop("patch_targets", None)
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            if aux is not None and wanted is not None:
                logits = model.aux_head(aux["features"])          # (images, tokens, slots*V)
                extra = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, len(tokenizer)), wanted.reshape(-1).to(logits.device))
                aux_losses.append(float(extra.detach()))
                loss = loss + cfg.aux_weight * extra
            return (loss, outputs) if return_outputs else loss

    class Callbacks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if vlm.sink_norm is not None and vlm.layout.sink_tokens:
                vlm_model.restore_sinks(model, tokenizer, vlm.sink_norm)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if log is not None and logs:
                log({f"train/{k}": float(v) for k, v in logs.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)},
                    state.global_step)

    with tempfile.TemporaryDirectory(prefix="paperline-vlm-") as scratch:
        args = TrainingArguments(
            output_dir=scratch, max_steps=cfg.steps, per_device_train_batch_size=cfg.batch_size,
            learning_rate=cfg.lr, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": cfg.min_lr_ratio}, warmup_steps=cfg.warmup,
            weight_decay=cfg.weight_decay, adam_beta2=cfg.adam_beta2,
            max_grad_norm=cfg.max_grad_norm, optim="adamw_torch", logging_steps=cfg.log_every,
            save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
            bf16=False, seed=seed, data_seed=seed, dataloader_pin_memory=False,
            remove_unused_columns=False, disable_tqdm=False)
        trainer = VLMTrainer(model=model, args=args, train_dataset=examples,
                             data_collator=VLMCollator(images, vlm.processor,
                                                       targets if aux is not None else None),
                             callbacks=[Callbacks()])
        wall, cpu = time.perf_counter(), time.process_time()
        result = trainer.train()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if aux is not None:
        detach_aux_head(model, aux)
    model.eval()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tail = losses[-max(1, len(losses) // 10):] or [math.nan]
    # CPU seconds beside wall seconds: on a shared machine the wall time measures the load.
    aux_tail = aux_losses[-max(1, len(aux_losses) // 10):] or [math.nan]
    return {"train_loss": sum(tail) / len(tail), "first_loss": losses[0] if losses else math.nan,
            "aux_loss": sum(aux_tail) / len(aux_tail), "train_seconds": wall,
            "train_cpu_seconds": cpu, "train_steps": float(result.global_step)}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from transformers import set_seed

    from stages.models.base import set_threads

    threads = set_threads(cfg.num_threads)
    data_dir = ctx.path(cfg.data)
    image_size = cfg.spec.image_size if cfg.init == "scratch" else None
    df, images, qa = load_family(data_dir, cfg.family, "train", image_size)
    if cfg.max_train_rows:
        df, images = df.head(cfg.max_train_rows), images[:cfg.max_train_rows]
    tokenizer = None
    if cfg.init == "scratch":
        tokenizer = vlm_model.build_tokenizer(cfg.tokenizer,
                                              tokenizer_texts(cfg.family, df, qa, cfg.layout))
    out = ctx.path(cfg.out)
    metrics: dict[str, float] = {"train_images": float(len(df))}
    with io.atomic_path(out, is_dir=True) as tmp:
        for seed in cfg.seeds:
            set_seed(seed)
            vlm = initial_vlm(cfg, tokenizer)
            examples = build_examples(cfg, cfg.family, df, qa, vlm.tokenizer)
            targets = (patch_targets(cfg.family, df, vlm.tokenizer, cfg.spec, cfg.text_cell)
                       if cfg.aux_weight > 0 and cfg.init == "scratch" else None)
            print(f"{ctx.stage}: seed {seed}: {len(df)} train images, {len(examples)} examples, "
                  f"vocab {len(vlm.tokenizer)}, {cfg.steps} steps x {cfg.batch_size}, "
                  f"{threads} threads")
            with ctx.method_run(ctx.stage, cfg.family, seed,
                                params=cfg.model_dump(mode="json")) as mr:
                m = (train_one(cfg, vlm, examples, images, seed, mr.log_metrics, targets)
                     if cfg.steps else {})
                vlm_model.save_vlm(vlm, tmp / f"seed{seed}")
                mr.log_metrics({k: v for k, v in m.items() if math.isfinite(v)})
            metrics.update({f"seed{seed}/{k}": v for k, v in m.items()})
            metrics["train_examples"] = float(len(examples))
            metrics["vocab_size"] = float(len(vlm.tokenizer))
            metrics["n_params"] = float(sum(p.numel() for p in vlm.model.parameters()))
    if cfg.register_as and ctx.tracker is not None:
        for i, seed in enumerate(cfg.seeds):
            ctx.tracker.register_model(
                out / f"seed{seed}", cfg.register_as,
                [f"seed-{seed}"] + (["champion"] if i == 0 else []),
                tags={"paperline.seed": str(seed), "vlm.family": cfg.family, "vlm.init": cfg.init,
                      "n_params": str(int(metrics["n_params"]))},
                artifact_path=f"model-seed{seed}")   # one run registers a version per seed
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the model's size and its final training loss (mean over seeds); each seed's
    in details/<stage>.json."""
    from stages.core.stats import mean_std

    out = {k: metrics[k] for k in ("n_params",) if k in metrics}
    losses = [v for k, v in metrics.items() if k.endswith("/train_loss")]
    if losses:
        out["train_loss"] = mean_std(losses)[0]
    return out
