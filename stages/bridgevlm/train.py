"""Stage `train` of BridgeVLM: every arm, every seed, on the same pairs and the same steps;
then each model answers the test split. (BridgeVLM spec §3-4, arXiv 2606.11745.)

Arms (params `arms`; all from scratch with the vlm substrate's spec, one tokenizer):
- `answer_only`   images -> answer (spec §3 (b));
- `prompt_level`  images -> textual graph + trace + answer (spec §3 (c), the paper's 33.2%);
- `bridgevlm`     images + Causal Tokens (soft DAG, RAMP, node + graph tokens) -> answer, with
                  the M3S losses and the RAMP residual again inside the decoder
                  (stages/bridgevlm/causal.py);
- `bridgevlm_concat`  the same, RAMP before the decoder only (input-concat; spec §6 ablation);
- `no_dag`, `no_node`, `no_graph`  the spec's ablations of BridgeVLM;
- `oracle`        the true levels as text instead of the images -> answer (the ceiling).
Every image arm also gets the substrate's auxiliary patch loss (each visual token names the
level of the panel it lies in; stages/train/vlm.py explains why a from-scratch tiny VLM needs
it to look at the image within a cpu budget); the head is dropped before saving.

Held-out SCMs (those not in `edge_label_scms`, i.e. `relay`): no training signal names their
edges. Their rows train on the intervention and counterfactual questions only (no structure
question; the prompt-level target is `=> answer`, without graph or trace), and the M3S edge
and graph-head losses are masked on them. The test split still asks them all three questions.

Engine: a plain torch loop (AdamW, warm-up + cosine). The forward splices a second kind of
token (Causal Tokens) into the LLaVA's input embeddings and adds the M3S losses over A, which
the transformers Trainer would need a subclassed forward and collator for; 40 lines of loop
read more plainly.

Model selection (`select_every`): every N steps each run answers the validation split and
keeps the checkpoint with the best mean of intervention and counterfactual accuracy; the test
split is answered once, by that checkpoint. The same rule for every arm, so no arm gets more
tuning than another, and nothing about the test split chooses anything.

Test metrics per arm and seed: intervention-target accuracy, counterfactual accuracy (all four
levels right), structure-question accuracy and structure F1 from the yes/no answers (pooled
over questions), per SCM and overall; for the arms with a learned DAG, structure F1 of A after
Hungarian node <-> variable alignment, soft and hard (threshold 0.5), per SCM, and the gap of
mean A between the two SCMs (0 = one graph for every input, i.e. memorised).

    python -m stages bridgevlm train
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.bridgevlm import causal as causal_lib
from stages.bridgevlm import model as bmodel
from stages.core import io
from stages.models import vlm as vlm_model
from stages.tasks import pendulum

CAUSAL_FILE, CAUSAL_CONFIG = "causal.safetensors", "causal.json"


class Arm(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str = Field("images", pattern="^(images|values)$",
                       description="images (before, after) or the true levels as text (oracle)")
    target: str = Field("answer", pattern="^(answer|trace)$",
                        description="answer only, or graph + trace + answer (prompt-level)")
    causal: bool = Field(False, description="Causal Tokens from the causal module")
    dag: bool = Field(True, description="causal arms: learned soft DAG (False: A = all ones)")
    node_tokens: bool = Field(True, description="causal arms: node tokens in the decoder input")
    graph_tokens: bool = Field(True, description="causal arms: graph tokens (and feedback)")
    decoder_ramp: bool = Field(True, description="causal arms: the RAMP residual also runs "
                                                 "inside the decoder at causal.decoder_layers "
                                                 "(False: input-concat only; spec §2, §6)")

    @model_validator(mode="after")
    def _check(self) -> "Arm":
        if self.causal and not (self.node_tokens or self.graph_tokens):
            raise ValueError("a causal arm needs node_tokens or graph_tokens")
        if self.causal and self.input != "images":
            raise ValueError("a causal arm reads images (input: images)")
        return self


class Losses(BaseModel):
    """M3S weights (spec §2: lambda_e = 1, lambda_a = 0.1, lambda_d = 0.1 ramped, lambda_g =
    0.5 [reconstructed]) and the auxiliary weights [ours]."""

    model_config = ConfigDict(extra="forbid")

    edge: float = Field(1.0, ge=0, le=100, description="lambda_e: BCE on labelled edges")
    align: float = Field(0.1, ge=0, le=100, description="lambda_a: node/description InfoNCE")
    acyclic: float = Field(0.1, ge=0, le=100, description="lambda_d: NOTEARS h(A)")
    acyclic_ramp: float = Field(0.5, ge=0, le=1, description="lambda_d reaches its value after "
                                                             "this fraction of the steps")
    graph: float = Field(0.5, ge=0, le=100, description="lambda_g: graph-level head on mean(G)")
    node: float = Field(1.0, ge=0, le=100, description="[ours] node-state CE (levels)")
    patch: float = Field(1.0, ge=0, le=100, description="[ours] patch loss, every image arm")
    align_temperature: float = Field(0.1, gt=0, le=10, description="InfoNCE temperature")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str = Field("bridgevlm_data", description="path key of the data stage's folder")
    out: str = Field("bridgevlm_models", description="path key: <arm>/seed<k>/ per model")
    register_as: str | None = Field("bridgevlm-vlm", description="MLflow registered model; "
                                    "aliases <arm> (first seed) and <arm>-seed-<k>")
    arms: dict[str, Arm] = Field(description="arm name -> its inputs, target and module")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="training seeds (pairs for the claims)")
    spec: vlm_model.Spec = Field(default_factory=lambda: vlm_model.Spec(image_size=32),
                                 description="tiny VLM architecture (the vlm substrate's)")
    causal: causal_lib.CausalSpec = Field(default_factory=causal_lib.CausalSpec,
                                          description="causal module shape")
    losses: Losses = Field(default_factory=Losses, description="loss weights")
    edge_label_scms: list[str] = Field(default_factory=lambda: ["pendulum"],
                                       description="SCMs whose edges training sees (M3S "
                                                   "edge / graph losses, structure questions, "
                                                   "the prompt-level graph); the others are "
                                                   "held out")
    steps: int = Field(300, ge=1, le=1_000_000, description="optimiser steps per arm and seed")
    batch_size: int = Field(32, ge=1, le=4096, description="examples per step")
    lr: float = Field(3e-3, gt=0, le=1.0, description="peak learning rate")
    warmup: float = Field(0.05, ge=0, lt=1, description="linear warm-up, fraction of steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr * this")
    weight_decay: float = Field(0.01, ge=0, le=1, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    split: str = Field("test", pattern="^(val|test)$", description="split the arms answer")
    max_eval_rows: int | None = Field(None, ge=1, description="answer at most this many rows")
    answer_tokens: int = Field(6, ge=1, le=64, description="greedy tokens, answer-only arms")
    trace_tokens: int = Field(48, ge=1, le=256, description="greedy tokens, prompt-level arm")
    eval_batch: int = Field(64, ge=1, le=4096, description="prompts per greedy batch")
    log_every: int = Field(50, ge=1, description="log the loss every N steps")
    select_every: int | None = Field(None, ge=1, description="every N steps (and at the last) "
                                     "answer the validation split and keep the checkpoint with "
                                     "the best mean of intervention and counterfactual accuracy; "
                                     "the test split answers with that one. None: the last step")
    select_rows: int | None = Field(None, ge=1, description="validation rows the selection "
                                                            "answers (None: all)")
    num_threads: int = Field(1, ge=0, le=256, description="torch threads per process; 0 = "
                             "all cores (1: a tiny model runs best on one thread per core)")
    workers: int = Field(1, ge=1, le=64, description="processes training (arm, seed) runs in "
                                                     "parallel (2: one per core)")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if not self.arms:
            raise ValueError("arms is empty: nothing to train")
        if self.select_every is not None and self.split == "val":
            raise ValueError("select_every picks a checkpoint on the val split, and split: val "
                             "answers on it too: answer on test, or select_every: null")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        if self.causal.nodes < len(pendulum.VARIABLES):
            raise ValueError(f"causal.nodes = {self.causal.nodes} < {len(pendulum.VARIABLES)} "
                             f"variables: every variable needs a node")
        unknown = sorted(set(self.edge_label_scms) - set(pendulum.SCMS))
        if unknown:
            raise ValueError(f"edge_label_scms {unknown} unknown; expected some of "
                             f"{sorted(pendulum.SCMS)}")
        in_decoder = sorted(n for n, a in self.arms.items()
                            if a.causal and a.decoder_ramp and a.node_tokens)
        deep = [k for k in self.causal.decoder_layers if k >= self.spec.num_layers]
        if in_decoder and deep:
            raise ValueError(f"causal.decoder_layers {deep} do not exist in a "
                             f"{self.spec.num_layers}-layer decoder")
        if in_decoder and not self.causal.decoder_layers:
            raise ValueError(f"arms {in_decoder} run RAMP inside the decoder (decoder_ramp) but "
                             f"causal.decoder_layers is empty: name the layers, or set "
                             f"decoder_ramp: false")
        side = self.spec.image_size // self.spec.patch_size
        if side % 2:
            raise ValueError(f"image_size / patch_size = {side} patches per side: must be even "
                             f"(each 2x2 panel whole patches)")
        return self


# --- data -----------------------------------------------------------------------------------

def load_split(folder: Path, split: str, size: int) -> tuple[Any, list[Any], list[Any]]:
    """(table, before images, after images), checked: the GE suite, then every PNG decoded."""
    from stages.core.checks import read_parquet_checked
    from stages.tasks.images import decode_all

    path = folder / f"{split}.parquet"
    df = read_parquet_checked(path, pendulum.expectations(None, split))
    kw = {"size": (size, size), "mode": "RGB", "source": str(path)}
    return (df, decode_all(df["image_before"], df["id"], **kw),
            decode_all(df["image_after"], df["id"], **kw))


def tokenizer_texts(rows: list[dict]) -> list[str]:
    texts = [bmodel.BEFORE, bmodel.AFTER, bmodel.TAIL, " ".join(map(str, range(pendulum.LEVELS)))]
    for row in rows:
        for kind in bmodel.QUESTION_KINDS:
            texts += [bmodel.query_of(row, kind), bmodel.trace_target(row, kind)]
    return texts


def build_examples(rows: list[dict], arm: Arm, tok: Any, image_tokens: int, causal_tokens: int,
                   max_positions: int, edge_label_scms: Sequence[str]
                   ) -> list[dict[str, Any]]:
    """One example per (row, question kind): ids, kinds, labels (loss on the target only).

    Rows of an SCM not in `edge_label_scms` (held out: `relay`) train on the intervention and
    counterfactual questions only, and the prompt-level target drops the graph and the trace
    for them (`=> answer`): their structure answers and graph text would supervise the edges
    that the induction claim says no training signal reveals. The data stage is unchanged:
    the held-out rows keep their structure questions for evaluation."""
    out = []
    for i, row in enumerate(rows):
        values = (row["before"], row["after"]) if arm.input == "values" else None
        labelled = row["scm"] in edge_label_scms
        for kind in bmodel.QUESTION_KINDS:
            if kind == "structure" and not labelled:
                continue
            ids, kinds = bmodel.encode_prompt(tok, bmodel.query_of(row, kind), image_tokens,
                                              causal_tokens, values)
            target = (bmodel.trace_target(row, kind, graph=labelled) if arm.target == "trace"
                      else bmodel.answer_of(row, kind))
            t = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.append({"row": i, "ids": ids + t, "kinds": kinds + [0] * len(t),
                        "labels": [-100] * len(ids) + t})
    longest = max(len(e["ids"]) for e in out)
    if longest > max_positions:
        raise ValueError(f"spec.max_positions = {max_positions} but an example has {longest} "
                         f"tokens")
    return out


class Batches:
    """Tensors for a list of examples: right-padded for training, left-padded for decoding;
    the two images and the row labels (true A, edge mask, levels) of each example's row."""

    def __init__(self, rows: list[dict], before: Any, after: Any, tok: Any, arm: Arm,
                 edge_label_scms: list[str], side: int):
        import torch

        self.arm, self.pad = arm, tok.pad_token_id
        self.before = pixel_values_cache(before) if arm.input == "images" else None
        self.after = pixel_values_cache(after) if arm.input == "images" else None
        self.true_a = torch.tensor([pendulum.adjacency(r["scm"]) for r in rows],
                                   dtype=torch.float32)
        self.edge_mask = torch.tensor([float(r["scm"] in edge_label_scms) for r in rows])
        self.states = torch.tensor([list(zip(r["before"], r["after"])) for r in rows])
        panel = torch.tensor(bmodel.panel_of_patch(side))
        self.patch_before = torch.stack([torch.tensor(r["before"])[panel] for r in rows])
        self.patch_after = torch.stack([torch.tensor(r["after"])[panel] for r in rows])

    def collate(self, examples: list[dict], left: bool = False) -> dict[str, Any]:
        import torch

        width = max(len(e["ids"]) for e in examples)
        n = len(examples)
        ids = torch.full((n, width), self.pad, dtype=torch.long)
        kinds = torch.zeros((n, width), dtype=torch.long)
        labels = torch.full((n, width), -100, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, e in enumerate(examples):
            k = len(e["ids"])
            sl = slice(width - k, width) if left else slice(0, k)
            ids[i, sl] = torch.tensor(e["ids"])
            kinds[i, sl] = torch.tensor(e["kinds"])
            mask[i, sl] = 1
            if "labels" in e:
                labels[i, sl] = torch.tensor(e["labels"])
        rows = torch.tensor([e["row"] for e in examples])
        batch = {"ids": ids, "kinds": kinds, "labels": labels, "mask": mask, "rows": rows}
        if self.before is not None:
            batch["images"] = (self.before[rows], self.after[rows])
        return batch


def pixel_values_cache(images: list[Any]) -> Any:
    """uint8 (H, W, 3) arrays -> (n, 3, H, W) floats in [-1, 1], as the substrate's CLIP
    processor gives them (do_rescale, mean = std = 0.5); computed once per split."""
    import numpy as np
    import torch

    arr = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    return arr / 127.5 - 1.0


# --- one arm, one seed ----------------------------------------------------------------------

def build_model(cfg: Config, arm: Arm, tok: Any) -> bmodel.BridgeVLM:
    import torch

    layout = vlm_model.Layout(sink_tokens=0, image_tokens=cfg.spec.patch_tokens)
    llava, processor = vlm_model.build_vlm(cfg.spec, layout, tok)
    vlm = vlm_model.VLM(model=llava, processor=processor, layout=layout, sink_norm=None)
    module = None
    if arm.causal:
        module = causal_lib.CausalModule(cfg.spec.hidden_size, cfg.causal,
                                         len(pendulum.VARIABLES), pendulum.LEVELS, dag=arm.dag,
                                         node_tokens=arm.node_tokens,
                                         graph_tokens=arm.graph_tokens,
                                         decoder_ramp=arm.decoder_ramp)
    head = (torch.nn.Linear(cfg.spec.hidden_size, pendulum.LEVELS)
            if arm.input == "images" and cfg.losses.patch > 0 else None)
    return bmodel.BridgeVLM(vlm, module, head)


def descriptions(model: bmodel.BridgeVLM, tok: Any) -> Any:
    """E_text(desc_k): the decoder's mean input embedding of variable k's name, detached (spec
    §5: the frozen LLM embedding, mean-pooled)."""
    import torch

    table = model.llava.get_input_embeddings().weight
    rows = [table[torch.tensor(tok(name, add_special_tokens=False)["input_ids"])].mean(0)
            for name in pendulum.VARIABLES]
    return torch.stack(rows).detach()


# What model selection asks the validation split: its score is the mean of these two
# accuracies, so the structure question (a third of the greedy decoding) is not asked there.
SELECTION_KINDS = ("intervention", "counterfactual")


def selection_points(steps: int, every: int | None) -> list[int]:
    """The steps (0-based, after their update) at which the validation split is answered."""
    if every is None:
        return [steps - 1]
    return sorted({*range(every - 1, steps, every), steps - 1})


def pick_best(scores: dict[int, float]) -> int:
    """The step with the best validation score; the earliest of tied steps (less training)."""
    return max(sorted(scores), key=lambda step: scores[step])


def train_arm(cfg: Config, arm: Arm, model: bmodel.BridgeVLM, data: Batches,
              examples: list[dict], tok: Any, seed: int, log: Any,
              val: tuple[Batches, list[dict]] | None = None) -> dict[str, float]:
    """`val`: the validation split; with `cfg.select_every` the model ends holding the
    checkpoint that answered it best (early stopping by model selection, never on test)."""
    import copy

    import torch
    from torch.nn import functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    warm = max(1, int(cfg.warmup * cfg.steps))

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, cfg.steps - warm)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(seed)
    order: list[int] = []
    model.train()
    history: list[dict[str, float]] = []
    wall, cpu = time.perf_counter(), time.process_time()
    points = set(selection_points(cfg.steps, cfg.select_every)) if val is not None else set()
    scores: dict[int, float] = {}
    best_state: dict[str, Any] | None = None
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        picked, order = order[:cfg.batch_size], order[cfg.batch_size:]
        batch = data.collate([examples[i] for i in picked])
        emb, extra = model.embed(batch["ids"], batch["kinds"], batch.get("images"))
        logits = model.logits(emb, batch["mask"], batch["kinds"], extra)
        terms = {"answer": F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           batch["labels"][:, 1:].reshape(-1))}
        rows = batch["rows"]
        if model.patch_head is not None:
            fb, fa = extra["features"]
            pl = model.patch_head(torch.cat([fb, fa], dim=1))
            pt = torch.cat([data.patch_before[rows], data.patch_after[rows]], dim=1)
            terms["patch"] = cfg.losses.patch * F.cross_entropy(pl.reshape(-1, pl.shape[-1]),
                                                                pt.reshape(-1))
        if model.causal is not None:
            w = causal_lib.ramp_weight(step, cfg.steps, cfg.losses.acyclic,
                                       cfg.losses.acyclic_ramp)
            terms.update(causal_lib.m3s_loss(
                model.causal, extra["causal"], descriptions=descriptions(model, tok),
                true_a=data.true_a[rows], edge_mask=data.edge_mask[rows],
                states=data.states[rows], weights=cfg.losses, acyclic_weight=w))
        loss = sum(terms.values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        record = {f"loss_{k}": float(v.detach()) for k, v in terms.items()}
        record["loss"] = float(loss.detach())
        history.append(record)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            log({f"train/{k}": v for k, v in record.items()}, step)
        if step in points:
            model.eval()
            vm = evaluate(cfg, arm, model, val[0], val[1], tok, SELECTION_KINDS)
            model.train()
            scores[step] = vm["average_acc"]
            log({"val/average_acc": vm["average_acc"]}, step)
            if pick_best(scores) == step:
                best_state = copy.deepcopy(model.state_dict())
    model.eval()
    tail = history[-max(1, len(history) // 10):]
    out = {k: sum(h.get(k, math.nan) for h in tail) / len(tail) for k in history[-1]}
    out["first_loss"] = history[0]["loss"]
    if scores:
        best = pick_best(scores)
        model.load_state_dict(best_state)
        out["selected_step"] = float(best + 1)
        out["selected_val_acc"] = scores[best]
    out["train_seconds"] = time.perf_counter() - wall
    out["train_cpu_seconds"] = time.process_time() - cpu
    return out


def evaluate(cfg: Config, arm: Arm, model: bmodel.BridgeVLM, data: Batches, rows: list[dict],
             tok: Any, kinds: Sequence[str] = bmodel.QUESTION_KINDS) -> dict[str, float]:
    """Greedy answers to the questions `kinds` (all three: the test split) of every row;
    structure from the answers and from A when `structure` is asked. Model selection asks
    intervention and counterfactual only: its score is their mean (`average_acc`)."""
    import torch

    unknown = sorted(set(kinds) - set(bmodel.QUESTION_KINDS))
    if unknown or not {"intervention", "counterfactual"} <= set(kinds):
        raise ValueError(f"kinds {list(kinds)}: need intervention and counterfactual, "
                         f"optionally structure ({list(bmodel.QUESTION_KINDS)})")
    with torch.no_grad():
        return _evaluate(cfg, arm, model, data, rows, tok, kinds)


def _evaluate(cfg: Config, arm: Arm, model: bmodel.BridgeVLM, data: Batches, rows: list[dict],
              tok: Any, asked: Sequence[str]) -> dict[str, float]:
    import numpy as np
    import torch

    n_causal = model.causal.n_tokens if model.causal is not None else 0
    image_tokens = cfg.spec.patch_tokens
    correct: dict[str, list[tuple[str, int]]] = {k: [] for k in asked}
    struct: list[tuple[str, int, int]] = []          # (scm, predicted yes, true label)
    a_rows: list[Any] = []
    s_rows: list[Any] = []
    max_new = cfg.trace_tokens if arm.target == "trace" else cfg.answer_tokens
    for kind in asked:
        prompts = []
        for i, row in enumerate(rows):
            values = (row["before"], row["after"]) if arm.input == "values" else None
            ids, kinds = bmodel.encode_prompt(tok, bmodel.query_of(row, kind), image_tokens,
                                              n_causal, values)
            prompts.append({"row": i, "ids": ids, "kinds": kinds})
        for b in range(0, len(prompts), cfg.eval_batch):
            chunk = prompts[b:b + cfg.eval_batch]
            batch = data.collate(chunk, left=True)
            outs, extra = model.greedy(batch["ids"], batch["kinds"], batch["mask"],
                                       batch.get("images"), max_new, tok.eos_token_id)
            for e, toks in zip(chunk, outs):
                row = rows[e["row"]]
                text = tok.decode(toks, skip_special_tokens=True)
                got = bmodel.parse_answer(text) if arm.target == "trace" else text.strip()
                want = bmodel.answer_of(row, kind)
                correct[kind].append((row["scm"], int(got == want)))
                if kind == "structure":
                    struct.append((row["scm"], int(got == "yes"), row["struct_label"]))
            if kind == "structure" and "causal" in extra and model.causal.dag:
                out = extra["causal"]
                a_rows.append(out["a"].float().numpy())
                s_rows.append(causal_lib.alignment_scores(
                    model.causal.desc_proj(out["z"]), descriptions(model, tok)).numpy())
    m: dict[str, float] = {}
    scms = sorted({r["scm"] for r in rows})
    for kind, name in (("intervention", "intervention_acc"), ("counterfactual", "cf_acc"),
                       ("structure", "structure_acc")):
        if kind not in correct:
            continue
        m[name] = float(np.mean([c for _, c in correct[kind]]))
        for scm in scms:
            m[f"{name}_{scm}"] = float(np.mean([c for s, c in correct[kind] if s == scm]))
    m["average_acc"] = (m["intervention_acc"] + m["cf_acc"]) / 2
    if "structure" not in correct:
        return m

    def answers_f1(items: list[tuple[str, int, int]]) -> float:
        pred = np.array([p for _, p, _ in items], dtype=float)
        true = np.array([t for _, _, t in items], dtype=float)
        tp, fp, fn = (pred * true).sum(), (pred * (1 - true)).sum(), ((1 - pred) * true).sum()
        return 1.0 if tp + fp + fn == 0 else float(2 * tp / (2 * tp + fp + fn))

    m["structure_f1"] = answers_f1(struct)
    m["struct_yes_rate"] = float(np.mean([p for _, p, _ in struct]))
    for scm in scms:
        m[f"structure_f1_{scm}"] = answers_f1([x for x in struct if x[0] == scm])
    if a_rows:
        a = np.concatenate(a_rows)                 # (rows, m, m), rows in `rows` order
        perm = causal_lib.align_nodes(np.concatenate(s_rows).mean(0))
        m["aligned_identity"] = float(perm == list(range(len(pendulum.VARIABLES))))
        av = causal_lib.permute_edges(a, perm)
        m["acyclicity"] = float(causal_lib.acyclicity(torch.from_numpy(a)).mean())
        means = {}
        for scm in scms:
            idx = [i for i, r in enumerate(rows) if r["scm"] == scm]
            truth = np.array(pendulum.adjacency(scm))
            for hard, key in ((False, "a_f1_soft"), (True, "a_f1_hard")):
                m[f"{key}_{scm}"] = float(np.mean([causal_lib.structure_f1(av[i], truth,
                                                                           hard=hard)
                                                   for i in idx]))
            means[scm] = av[idx].mean(0)
        for hard, key in ((False, "a_f1_soft"), (True, "a_f1_hard")):
            m[key] = float(np.mean([m[f"{key}_{s}"] for s in scms]))
        if len(scms) > 1:
            off = 1 - np.eye(len(pendulum.VARIABLES))
            gap = np.abs(means[scms[0]] - means[scms[1]]) * off
            m["a_scm_gap"] = float(gap.sum() / off.sum())
    return m


def save_model(model: bmodel.BridgeVLM, arm_name: str, arm: Arm, cfg: Config, path: Path
               ) -> None:
    """save_pretrained of the LLaVA (+ processor, layout), and the causal module's weights and
    shape beside it (safetensors + json). The patch head is training-only and not saved."""
    from safetensors.torch import save_file

    vlm_model.save_vlm(model.vlm, path)
    if model.causal is not None:
        state = {k: v.detach().contiguous() for k, v in model.causal.state_dict().items()}
        save_file(state, str(path / CAUSAL_FILE))
        io.write_text(path / CAUSAL_CONFIG, json.dumps(
            {"arm": arm_name, **arm.model_dump(), "spec": cfg.causal.model_dump(),
             "variables": list(pendulum.VARIABLES), "levels": pendulum.LEVELS}, indent=2) + "\n")


_LOADED: dict[tuple, Any] = {}


def prepared(cfg: Config, folder: Path) -> dict[str, Any]:
    """The splits (checked, decoded) and the tokenizer, once per process: the tokenizer is built
    from the train split's texts, so every process and every arm gets the same one."""
    key = (str(folder), cfg.split, cfg.spec.image_size, cfg.max_eval_rows, cfg.select_every,
           cfg.select_rows)
    if key not in _LOADED:
        size = cfg.spec.image_size
        train_df, train_b, train_a = load_split(folder, "train", size)
        test_df, test_b, test_a = load_split(folder, cfg.split, size)
        n = cfg.max_eval_rows or test_df.height
        train_rows = train_df.to_dicts()
        _LOADED[key] = {"train": (train_rows, train_b, train_a),
                        "test": (test_df.head(n).to_dicts(), test_b[:n], test_a[:n]),
                        "tok": vlm_model.build_tokenizer("word", tokenizer_texts(train_rows))}
        if cfg.select_every is not None:
            val_df, val_b, val_a = load_split(folder, "val", size)
            v = cfg.select_rows or val_df.height
            _LOADED[key]["val"] = (val_df.head(v).to_dicts(), val_b[:v], val_a[:v])
    return _LOADED[key]


def causal_tokens(cfg: Config, arm: Arm) -> int:
    if not arm.causal:
        return 0
    return (cfg.causal.nodes if arm.node_tokens else 0) + \
        (cfg.causal.graph_queries if arm.graph_tokens else 0)


def train_job(job: tuple[Config, str, str, int, str, int]) -> tuple[list[dict], dict[str, float]]:
    """One (arm, seed): train, answer the test split, save to `<out>/<arm>/seed<k>`. Runs in
    the stage's process or in a spawned worker (`workers` > 1); returns the logged training
    records and the metrics (MLflow logging stays in the stage's process)."""
    import torch

    cfg, folder, name, seed, out, threads = job
    torch.set_num_threads(threads)
    data = prepared(cfg, Path(folder))
    tok, arm = data["tok"], cfg.arms[name]
    side = cfg.spec.image_size // cfg.spec.patch_size
    examples = build_examples(data["train"][0], arm, tok, cfg.spec.patch_tokens,
                              causal_tokens(cfg, arm), cfg.spec.max_positions,
                              cfg.edge_label_scms)
    train_data = Batches(*data["train"], tok, arm, cfg.edge_label_scms, side)
    test_data = Batches(*data["test"], tok, arm, cfg.edge_label_scms, side)
    torch.manual_seed(seed)
    random.seed(seed)
    val = None
    if "val" in data:
        val = (Batches(*data["val"], tok, arm, cfg.edge_label_scms, side), data["val"][0])
    model = build_model(cfg, arm, tok)
    records: list[dict] = []
    tm = train_arm(cfg, arm, model, train_data, examples, tok, seed,
                   lambda m, step: records.append({"step": step, **m}), val)
    started = time.perf_counter()
    em = evaluate(cfg, arm, model, test_data, data["test"][0], tok)
    em["eval_seconds"] = time.perf_counter() - started
    save_model(model, name, arm, cfg, Path(out) / name / f"seed{seed}")
    em["n_params"] = float(sum(p.numel() for p in model.parameters()))
    print(f"train: {name} seed {seed}: intervention {em['intervention_acc']:.3f} counterfactual "
          f"{em['cf_acc']:.3f} structure F1 {em['structure_f1']:.3f} ({tm['train_seconds']:.0f}"
          f" s train, {em['eval_seconds']:.0f} s eval)", flush=True)
    return records, {**tm, **em}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.pool import map_jobs
    from stages.models.base import set_threads

    threads = set_threads(cfg.num_threads)
    folder = ctx.path(cfg.data)
    data = prepared(cfg, folder)          # checks every table and image before any training
    tok = data["tok"]
    for name, arm in cfg.arms.items():    # a too-long prompt fails before any training
        build_examples(data["train"][0][:50], arm, tok, cfg.spec.patch_tokens,
                       causal_tokens(cfg, arm), cfg.spec.max_positions, cfg.edge_label_scms)
    out = ctx.path(cfg.out)
    metrics: dict[str, float] = {"train_pairs": float(len(data["train"][0])),
                                 "test_pairs": float(len(data["test"][0])),
                                 "vocab_size": float(len(tok))}
    jobs = [(name, seed) for name in cfg.arms for seed in cfg.seeds]
    print(f"{ctx.stage}: {len(jobs)} runs ({len(cfg.arms)} arms x {len(cfg.seeds)} seeds), "
          f"{cfg.steps} steps x {cfg.batch_size} each, {cfg.workers} worker(s) x {threads} "
          f"thread(s)", flush=True)
    with io.atomic_path(out, is_dir=True) as tmp:
        args = [(cfg, str(folder), name, seed, str(tmp), threads) for name, seed in jobs]
        # spawned workers (no torch / MLflow threads copied), results in job order
        results = map_jobs(train_job, args, cfg.workers)
        for (name, seed), (records, m) in zip(jobs, results):
            with ctx.method_run(ctx.stage, name, seed,
                                params={"arm": name, **cfg.arms[name].model_dump()}) as mr:
                for r in records:
                    mr.log_metrics({k: v for k, v in r.items() if k != "step"}, r["step"])
                mr.log_metrics({k: v for k, v in m.items() if math.isfinite(v)})
            metrics.update({f"seed{seed}/{name}/{k}": v for k, v in m.items()
                            if k != "n_params"})
            metrics[f"{name}/n_params"] = m["n_params"]
    if cfg.register_as and ctx.tracker is not None:
        for name in cfg.arms:
            for i, seed in enumerate(cfg.seeds):
                ctx.tracker.register_model(
                    out / name / f"seed{seed}", cfg.register_as,
                    [f"{name}-seed-{seed}"] + ([name] if i == 0 else []),
                    tags={"paperline.seed": str(seed), "bridgevlm.arm": name},
                    artifact_path=f"model-{name}-seed{seed}")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: intervention accuracy of the prompt-level baseline and of BridgeVLM, and
    BridgeVLM's hard structure F1 from A on the held-out `relay` SCM, the one no training signal
    reveals (means over seeds; the mean over both SCMs would mix in Pendulum's supervised, i.e.
    memorised, edges); the rest in details/train.json."""
    from stages.core.stats import mean_std

    out: dict[str, float] = {}
    for arm, key, short in (("prompt_level", "intervention_acc", "prompt_interv"),
                            ("bridgevlm", "intervention_acc", "bridge_interv"),
                            ("bridgevlm", "a_f1_hard_relay", "bridge_a_f1_relay")):
        vals = [v for k, v in metrics.items() if k.endswith(f"/{arm}/{key}")]
        if vals:
            out[short] = mean_std(vals)[0]
    return out
