"""Stage `train` of SAME: every arm tuned on the five tasks in sequence, on the frozen tiny VLM.

For each `vlm-shapes` seed (the vlm pipeline's checkpoint, frozen: vision tower, projector,
decoder, embeddings and output layer) and each task order, every arm starts from the same
checkpoint with its own fresh adapter on the decoder FFN and sees the same batches in the same
order, `steps` optimiser steps per task (AdamW, warm-up then cosine, a new optimiser per task as
the code's one run per task). Arms (params `arms`): LoRA fine-tuning (one expert of the same
total rank), MoE-LoRA, + spectral router, + curvature, + adaptive freezing (= SAME).

After each task the test split of every task seen so far is scored (first-token greedy accuracy: the answer is
one word, so the answer's token is the argmax at the last prompt position), giving the matrix
a[i][j]. Also: the zero-shot accuracy of the frozen model, the first task's expert usage (mean
routing weight per layer) after task 1 and after the last task (router drift, JS divergence),
and the re-routing probe: experts frozen, only the routers retrained on the first task
(`probe_steps`), to tell router drift (accuracy comes back) from expert drift (it does not).

Speed: the frozen encoder and projector run once per image and seed (`image_features`); a step
runs the 4-layer decoder on ~75 tokens per example and reads only the last position's logits.

Outputs: `<same_runs>/matrix.parquet`, `runs.parquet`, `usage.parquet`; `<same_adapters>/
<arm>/seed<k>-order<o>/` (adapter.safetensors + adapter_config.json); the first run of each
arm registered as `same-adapter` with the arm as alias (`champion` = full SAME).

    python -m stages same train
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import polars as pl
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.core.pool import map_jobs
from stages.same import same

MATRIX_SCHEMA: dict[str, pl.DataType] = {
    "arm": pl.String, "seed": pl.Int64, "order": pl.Int64, "after": pl.Int64,
    "after_task": pl.String, "position": pl.Int64, "task": pl.String, "acc": pl.Float64}
RUNS_SCHEMA: dict[str, pl.DataType] = {
    "arm": pl.String, "seed": pl.Int64, "order": pl.Int64, "avg": pl.Float64,
    "bwt": pl.Float64, "router_js": pl.Float64, "probe_acc": pl.Float64,
    "first_after_first": pl.Float64, "first_after_last": pl.Float64,
    "zero_shot_avg": pl.Float64, "frozen_share": pl.Float64, "seconds": pl.Float64}
USAGE_SCHEMA: dict[str, pl.DataType] = {
    "arm": pl.String, "seed": pl.Int64, "order": pl.Int64, "when": pl.String,
    "layer": pl.Int64, "expert": pl.Int64, "usage": pl.Float64}


def default_arms() -> dict[str, same.Adapter]:
    moe = {"experts": 5, "rank": 4}
    return {"lora": same.Adapter(experts=1, rank=20),
            "moe_lora": same.Adapter(**moe),
            "spectral": same.Adapter(**moe, spectral_router=True),
            "curvature": same.Adapter(**moe, spectral_router=True, curvature=True),
            "same": same.Adapter(**moe, spectral_router=True, curvature=True, freezing=True)}


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: str = Field("same_tasks", description="path key: the tasks stage's folder")
    models: str = Field("vlm_shapes", description="path key: the vlm pipeline's seed<k>/ models")
    out: str = Field("same_runs", description="path key: matrix / runs / usage tables")
    adapters: str = Field("same_adapters", description="path key: saved adapters")
    register_as: str = Field("same-adapter", description="MLflow registered model name")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="seeds: adapter init and batches (and checkpoint)")
    checkpoint: int | None = Field(None, ge=0, description="vlm-shapes seed<k> folder every "
                                   "seed tunes; None: seed k tunes checkpoint seed<k>")
    layout: dict[str, Any] | None = Field(None, description="prompt layout of a real LLaVA "
                                          "folder without paperline_vlm.json (gpu profile)")
    image_size: int | None = Field(64, ge=8, le=4096, description="image side (None: the "
                                   "model's processor resizes, gpu)")
    orders: list[list[str]] = Field(min_length=1, description="task orders (each a "
                                                              "permutation of the same tasks)")
    arms: dict[str, same.Adapter] = Field(default_factory=default_arms, min_length=1,
                                          description="arm -> adapter and SAME's fixes")
    method: same.Method = Field(default_factory=same.Method, description="SAME's constants")
    steps: int = Field(150, ge=1, le=1_000_000, description="optimiser steps per task")
    batch_size: int = Field(16, ge=1, le=4096, description="examples per step")
    lr: float = Field(2e-3, gt=0, le=1, description="peak learning rate")
    warmup: float = Field(0.03, ge=0, lt=1, description="warm-up fraction of a task (code)")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay")
    probe_steps: int = Field(100, ge=0, le=1_000_000, description="re-routing probe steps")
    probe_lr: float = Field(2e-3, gt=0, le=1, description="re-routing probe learning rate")
    max_test_rows: int | None = Field(None, ge=1, description="score at most this many rows")
    num_threads: int = Field(0, ge=0, le=256, description="torch threads (workers = 1); 0 = all "
                                                         "cores")
    cache_features: bool = Field(True, description="compute the frozen visual tokens once per "
                                 "image (False: per batch, for a real VLM at gpu)")
    workers: int = Field(1, ge=1, le=64, description="processes over the (seed, order) runs, "
                                                     "one torch thread each")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        from stages.tasks.shapes_tasks import TASKS

        first = sorted(self.orders[0])
        for i, order in enumerate(self.orders):
            bad = sorted(set(order) - set(TASKS))
            if bad:
                raise ValueError(f"orders[{i}]: unknown tasks {bad}; known {list(TASKS)}")
            if sorted(order) != first or len(set(order)) != len(order):
                raise ValueError(f"orders[{i}] = {order} is not a permutation of orders[0]")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        return self


# --- data: prompts, answers, image features --------------------------------------------------

class TaskData:
    """One task split on one checkpoint: prompt ids (N, L), answer ids (N,) and the projected
    visual tokens (N, P, d), computed once (`feats`) or per batch from `images` (a real VLM at
    `gpu`: 576 x 4096 floats per image do not fit in memory for a whole split)."""

    def __init__(self, ids: torch.Tensor, answers: torch.Tensor, feats: torch.Tensor | None,
                 images: list | None = None, vlm: Any = None):
        self.ids, self.answers, self.feats = ids, answers, feats
        self.images, self.vlm = images, vlm

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        if self.feats is not None:
            return self.feats[idx]
        return image_features(self.vlm, [self.images[int(i)] for i in idx])


def read_split(folder: Any, task: str, split: str, image_size: int | None
               ) -> tuple[pl.DataFrame, list]:
    from stages.core.checks import read_parquet_checked
    from stages.tasks import shapes_tasks
    from stages.tasks.images import decode_all

    path = folder / task / f"{split}.parquet"
    df = read_parquet_checked(path, shapes_tasks.expectations(None, task, split))
    images = decode_all(df["image"], df["id"], mode="RGB", source=str(path),
                        size=None if image_size is None else (image_size, image_size))
    return df, images


def encode(vlm: Any, df: pl.DataFrame, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids and answer token ids (an answer's first token: answers are one word, and a
    task's answer words must start with distinct tokens). A query word the tokenizer does not
    know fails here, naming it: it would be <unk> for every task."""
    from stages.models import vlm as vlm_model

    tok = vlm.tokenizer
    unk = tok.unk_token_id
    for q in df["query"].unique():
        bad = [w for w in q.split() if unk is not None
               and unk in tok(w, add_special_tokens=False)["input_ids"]]
        if bad:
            raise ValueError(f"task {task!r}: query words {bad} are not in the model's "
                             f"vocabulary (they would all be <unk>)")
    first = {}
    for word in df["target"].unique():
        ids = tok(word, add_special_tokens=False)["input_ids"]
        if not ids or (unk is not None and unk in ids):
            raise ValueError(f"task {task!r}: answer {word!r} is not in the model's vocabulary")
        first[word] = ids[0]
    if len(set(first.values())) != len(first):
        raise ValueError(f"task {task!r}: answers {sorted(first)} share a first token")
    prompts = [vlm_model.encode_image_prompt(vlm.layout, tok, q) for q in df["query"]]
    if len({len(p) for p in prompts}) != 1:
        raise ValueError(f"task {task!r}: prompts of different lengths (one query length per "
                         f"task keeps batches unpadded)")
    return torch.tensor(prompts), torch.tensor([first[t] for t in df["target"]])


@torch.no_grad()
def image_features(vlm: Any, images: list, batch: int = 256) -> torch.Tensor:
    """Projected visual tokens (N, P, d) of the frozen encoder + projector, once per image."""
    from stages.models import vlm as vlm_model

    m = vlm.model
    out = []
    for i in range(0, len(images), batch):
        pv = vlm_model.pixel_values(vlm.processor, images[i:i + batch]).to(m.device)
        f = m.model.get_image_features(
            pixel_values=pv, vision_feature_layer=m.config.vision_feature_layer,
            vision_feature_select_strategy=m.config.vision_feature_select_strategy)
        out.append(torch.stack(list(f.pooler_output)))
    return torch.cat(out)


def last_logits(vlm: Any, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Logits (B, V) at the last prompt position: LLaVA's merge (visual tokens replace the
    `<image>` embeddings) done here from cached features, then the decoder."""
    m = vlm.model
    lm = m.model.language_model
    ids = ids.to(m.device)
    emb = lm.embed_tokens(ids)
    image = ids == m.config.image_token_id
    emb = emb.masked_scatter(image[..., None],
                             feats.to(emb.device, emb.dtype).reshape(-1, emb.shape[-1]))
    hidden = lm(inputs_embeds=emb).last_hidden_state[:, -1]
    return m.lm_head(hidden)


@torch.no_grad()
def accuracy(vlm: Any, data: TaskData, batch: int = 128) -> float:
    hits = 0
    for i in range(0, len(data), batch):
        idx = torch.arange(i, min(i + batch, len(data)))
        pred = last_logits(vlm, data.ids[idx], data.features(idx)).argmax(-1).cpu()
        hits += int((pred == data.answers[idx]).sum())
    return hits / len(data)


@torch.no_grad()
def usage(vlm: Any, layers: list[same.MoELoRAMLP], data: TaskData, batch: int = 128
          ) -> list[list[float]]:
    """Mean routing weight per expert over every token of `data`, per layer."""
    same.set_recording(layers, True)
    total = None
    for i in range(0, len(data), batch):
        idx = torch.arange(i, min(i + batch, len(data)))
        last_logits(vlm, data.ids[idx], data.features(idx))
        u = torch.tensor(same.routing_usage(layers)) * min(batch, len(data) - i)
        total = u if total is None else total + u
    same.set_recording(layers, False)
    return (total / len(data)).tolist()


# --- one arm on one task sequence ------------------------------------------------------------

def lr_at(step: int, total: int, warmup: float) -> float:
    """Linear warm-up then cosine decay to 0 (the code's schedule), as a factor of lr."""
    w = max(1, int(round(warmup * total)))
    if step < w:
        return (step + 1) / w
    return 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, total - w)))


def train_task(vlm: Any, layers: list[same.MoELoRAMLP], data: TaskData, cfg: Config,
               params: list[torch.nn.Parameter], generator: torch.Generator, steps: int,
               lr: float, *, hist: list[same.History] | None = None,
               freezers: list[same.Freezer] | None = None) -> tuple[float, float]:
    """`steps` AdamW steps on one task; returns (mean loss of the last 10%, frozen share)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, cfg.warmup))
    record = hist is not None or freezers is not None
    same.set_recording(layers, record)
    for layer in layers:
        layer.train()
        layer.route_mask = cfg.method.freeze_mode == "mask"
    losses, frozen_steps = [], 0.0
    for _ in range(steps):
        idx = torch.randint(len(data), (cfg.batch_size,), generator=generator)
        logits = last_logits(vlm, data.ids[idx], data.features(idx))
        loss = torch.nn.functional.cross_entropy(logits, data.answers[idx].to(logits.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        keep: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(layers):
            if hist is not None:
                hist[i].observe(layer.seen, cfg.method.centre)
                same.apply_gradients(layer, hist[i], cfg.method)
            frozen = ~layer.mask.bool()
            if frozen.any():          # frozen experts: no update (AdamW would still move them)
                for p in layer.expert_params():
                    keep.append((p, frozen, p.detach()[frozen].clone()))
                    if p.grad is not None:
                        p.grad[frozen] = 0
        routers = [layer.router.detach().clone() for layer in layers] if hist else []
        opt.step()
        sched.step()
        for layer, h, before in zip(layers, hist or [], routers):
            same.project_router_update(layer, before, h, cfg.method)
        with torch.no_grad():
            for p, frozen, old in keep:
                p[frozen] = old
        if freezers is not None:
            for layer, fr in zip(layers, freezers):
                layer.mask.copy_((~fr.step(layer.seen)).float())
                frozen_steps += float((~layer.mask.bool()).float().mean()) / len(layers)
        losses.append(loss.item())
    for layer in layers:
        layer.eval()
        layer.mask.fill_(1.0)         # inference uses every expert
    same.set_recording(layers, False)
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail), frozen_steps / steps


def run_sequence(vlm: Any, arm: str, adapter: same.Adapter, order: list[str],
                 data: dict[str, dict[str, TaskData]], cfg: Config, seed: int, order_idx: int,
                 log: Any) -> dict[str, Any]:
    """One arm over one task order: the accuracy matrix, usage, probe and adapter state."""
    lm = vlm.model.model.language_model
    layers = same.attach(lm, adapter, seed=1000 * seed + order_idx)
    for layer in layers:
        layer.to(vlm.model.device)
    try:
        params = same.trainable(layers)
        hist = ([same.History() for _ in layers]
                if adapter.spectral_router or adapter.curvature else None)
        freezers = ([same.Freezer(adapter.experts, cfg.method) for _ in layers]
                    if adapter.freezing else None)
        first = data[order[0]]["test"]
        acc: list[list[float]] = []
        use: dict[str, list[list[float]]] = {}
        frozen = []
        for t, task in enumerate(order):
            if freezers is not None:
                for fr in freezers:
                    fr.reset(t)
            # the same batches for every arm: the generator depends on (seed, order, task) only
            g = torch.Generator().manual_seed(10_000 * seed + 100 * order_idx + t)
            torch.manual_seed(10_000 * seed + 100 * order_idx + t)   # the same dropout masks too
            loss, share = train_task(vlm, layers, data[task]["train"], cfg, params, g,
                                     cfg.steps, cfg.lr, hist=hist, freezers=freezers)
            frozen.append(share)
            if hist is not None:
                for h in hist:
                    h.end_task(cfg.method.delta)
            # a[t][j] for the tasks seen so far (j <= t): what BWT and the final average need
            acc.append([accuracy(vlm, data[j]["test"]) for j in order[:t + 1]])
            log({f"loss_task{t}": loss, f"acc_task{t}": acc[-1][t]}, t)
            if adapter.experts > 1 and t in (0, len(order) - 1):
                use["after_first" if t == 0 else "after_last"] = usage(vlm, layers, first)
        state = same.adapter_state(layers)
        probe = math.nan
        if adapter.experts > 1 and cfg.probe_steps > 0:
            for layer in layers:
                for p in layer.expert_params():
                    p.requires_grad_(False)
            g = torch.Generator().manual_seed(10_000 * seed + 100 * order_idx + 99)
            train_task(vlm, layers, data[order[0]]["train"], cfg,
                       [layer.router for layer in layers], g, cfg.probe_steps, cfg.probe_lr)
            probe = accuracy(vlm, first)
    finally:
        same.detach(lm)
    js = math.nan
    if "after_last" in use:
        js = sum(same.js_divergence(p, q) for p, q in zip(use["after_first"], use["after_last"])
                 ) / len(use["after_first"])
    return {"acc": acc, "usage": use, "probe": probe, "js": js, "state": state,
            "frozen_share": sum(frozen) / len(frozen)}


def save_adapter(path: Any, state: dict[str, torch.Tensor], adapter: same.Adapter,
                 meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    with io.atomic_path(path, is_dir=True) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(
            {"adapter": adapter.model_dump(), "target": "decoder FFN (gate/up/down)", **meta},
            indent=2) + "\n")


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Every arm on one (seed, order): one process (a worker when `workers` > 1), one thread."""
    from stages.models import vlm as vlm_model
    from stages.models.base import set_threads

    cfg = Config.model_validate(job["cfg"])
    set_threads(job["threads"])
    seed, o = job["seed"], job["order"]
    order = cfg.orders[o]
    vlm = vlm_model.load_vlm(job["model"], layout=cfg.layout)
    for p in vlm.model.parameters():
        p.requires_grad_(False)
    data: dict[str, dict[str, TaskData]] = {}
    for t, splits in job["tables"].items():
        data[t] = {}
        for split, (df, images) in splits.items():
            ids, answers = encode(vlm, df, t)
            feats = image_features(vlm, images) if cfg.cache_features else None
            data[t][split] = TaskData(ids, answers, feats, images, vlm)
    zero = {t: accuracy(vlm, data[t]["test"]) for t in order}
    results = []
    for arm, adapter in cfg.arms.items():
        started = time.perf_counter()
        logs: list[tuple[dict[str, float], int]] = []
        res = run_sequence(vlm, arm, adapter, order, data, cfg, seed, o,
                           lambda m, step: logs.append((m, step)))
        res.update(arm=arm, logs=logs, seconds=time.perf_counter() - started)
        acc = res["acc"]
        print(f"train: seed {seed} order {o} {arm}: avg {same.average_accuracy(acc):.3f}, BWT "
              f"{same.bwt(acc):+.3f}, JS {res['js']:.3f}, probe {res['probe']:.3f} "
              f"({res['seconds']:.1f} s)", flush=True)
        results.append(res)
    return {"seed": seed, "order": o, "zero": zero, "results": results}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    folder = ctx.path(cfg.models)
    ckpt = {s: s if cfg.checkpoint is None else cfg.checkpoint for s in cfg.seeds}
    missing = sorted({ckpt[s] for s in cfg.seeds
                      if not (folder / f"seed{ckpt[s]}" / "config.json").is_file()})
    if missing:
        raise FileNotFoundError(f"{folder}: no vlm-shapes model for seeds {missing}; run the vlm "
                                f"pipeline (paperline repro vlm) with these seeds")
    tasks_dir = ctx.path(cfg.tasks)
    tasks = list(cfg.orders[0])
    # every table checked and every image decoded here, before any compute
    tables = {t: {s: read_split(tasks_dir, t, s, cfg.image_size) for s in ("train", "test")}
              for t in tasks}
    if cfg.max_test_rows:
        tables = {t: {**v, "test": (v["test"][0].head(cfg.max_test_rows),
                                    v["test"][1][:cfg.max_test_rows])} for t, v in tables.items()}
    jobs = [{"cfg": cfg.model_dump(), "seed": s, "order": o, "tables": tables,
             "model": str(folder / f"seed{ckpt[s]}"),
             "threads": cfg.num_threads if cfg.workers == 1 else 1}
            for s in cfg.seeds for o in range(len(cfg.orders))]
    outs = map_jobs(run_job, jobs, cfg.workers)
    matrix, runs, usage_rows = [], [], []
    metrics: dict[str, float] = {}
    adapters = ctx.path(cfg.adapters)
    registered: set[str] = set()
    for out in outs:
        seed, o = out["seed"], out["order"]
        order = cfg.orders[o]
        for t, v in out["zero"].items():
            metrics[f"seed{seed}/zero_shot/{t}"] = v
        for res in out["results"]:
            arm, acc = res["arm"], res["acc"]
            adapter = cfg.arms[arm]
            row = {"arm": arm, "seed": seed, "order": o,
                   "avg": same.average_accuracy(acc), "bwt": same.bwt(acc),
                   "router_js": res["js"], "probe_acc": res["probe"],
                   "first_after_first": acc[0][0], "first_after_last": acc[-1][0],
                   "zero_shot_avg": sum(out["zero"].values()) / len(out["zero"]),
                   "frozen_share": res["frozen_share"], "seconds": res["seconds"]}
            with ctx.method_run(ctx.stage, arm, seed * len(cfg.orders) + o,
                                params={"arm": arm, "seed": seed, "order": o,
                                        "tasks": ",".join(order), "steps": cfg.steps,
                                        **adapter.model_dump()}) as mr:
                for m, step in res["logs"]:
                    mr.log_metrics(m, step)
                mr.log_metrics({k: v for k, v in row.items()
                                if isinstance(v, float) and math.isfinite(v)})
            runs.append(row)
            for i, after in enumerate(order):
                for j, task in enumerate(order[:i + 1]):
                    matrix.append({"arm": arm, "seed": seed, "order": o, "after": i,
                                   "after_task": after, "position": j, "task": task,
                                   "acc": acc[i][j]})
            for when, layers_use in res["usage"].items():
                for li, u in enumerate(layers_use):
                    usage_rows += [{"arm": arm, "seed": seed, "order": o, "when": when,
                                    "layer": li, "expert": e, "usage": float(x)}
                                   for e, x in enumerate(u)]
            for k in ("avg", "bwt", "router_js", "probe_acc"):
                metrics[f"seed{seed}/order{o}/{arm}/{k}"] = row[k]
            path = adapters / arm / f"seed{seed}-order{o}"
            save_adapter(path, res["state"], adapter,
                         {"arm": arm, "seed": seed, "order": order,
                          "base": str(folder / f"seed{ckpt[seed]}")})
            if arm not in registered:
                aliases = [arm.replace("_", "-")] + (["champion"] if arm == "same" else [])
                if ctx.tracker is not None:
                    ctx.tracker.register_model(path, cfg.register_as, aliases,
                                               tags={"arm": arm})
                registered.add(arm)
    out_dir = ctx.path(cfg.out)
    io.write_parquet(out_dir / "matrix.parquet", pl.DataFrame(matrix, schema=MATRIX_SCHEMA))
    io.write_parquet(out_dir / "runs.parquet", pl.DataFrame(runs, schema=RUNS_SCHEMA))
    io.write_parquet(out_dir / "usage.parquet", pl.DataFrame(usage_rows, schema=USAGE_SCHEMA))
    metrics["runs"] = float(len(runs))
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the number of runs (arms side by side: compare's headline)."""
    return {"runs": metrics.get("runs", 0.0)}


def runs_spec() -> Any:
    """The checks `compare` runs on runs.parquet before any statistics."""
    from stages.core.checks import ColumnSpec, FrameSpec

    acc = {"dtype": pl.Float64, "min": 0.0, "max": 1.0}
    nan_ok = {"dtype": pl.Float64, "nullable": True}
    return FrameSpec(columns={
        "arm": ColumnSpec(dtype=pl.String), "seed": ColumnSpec(dtype=pl.Int64, min=0),
        "order": ColumnSpec(dtype=pl.Int64, min=0), "avg": ColumnSpec(**acc),
        "bwt": ColumnSpec(dtype=pl.Float64, min=-1.0, max=1.0),
        "router_js": ColumnSpec(**nan_ok), "probe_acc": ColumnSpec(**nan_ok),
        "first_after_first": ColumnSpec(**acc), "first_after_last": ColumnSpec(**acc),
        "zero_shot_avg": ColumnSpec(**acc), "frozen_share": ColumnSpec(dtype=pl.Float64),
        "seconds": ColumnSpec(dtype=pl.Float64, min=0.0)}, min_rows=1)


def matrix_spec() -> Any:
    from stages.core.checks import ColumnSpec, FrameSpec

    return FrameSpec(columns={
        "arm": ColumnSpec(dtype=pl.String), "seed": ColumnSpec(dtype=pl.Int64, min=0),
        "order": ColumnSpec(dtype=pl.Int64, min=0), "after": ColumnSpec(dtype=pl.Int64, min=0),
        "after_task": ColumnSpec(dtype=pl.String), "position": ColumnSpec(dtype=pl.Int64, min=0),
        "task": ColumnSpec(dtype=pl.String),
        "acc": ColumnSpec(dtype=pl.Float64, min=0.0, max=1.0)}, min_rows=1)
