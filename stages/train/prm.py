"""A process reward model (PRM): a step-token classifier on the base backbone, and stage
`train_prm`, which trains one on every selected subset with the same budget rule.

Format (TRL's former PRMTrainer; BIS spec §2): the solution's steps follow the prompt, each
closed by a separator token; the label of step j (1 = the step is still right) sits on its
separator, every other position is ignored (label -100):

    <bos>Q: 23+45-17=? A: 23+45=68; 68-17=51;
                                  ^ y_1     ^ y_2

The model is `AutoModelForTokenClassification(num_labels=2)` loaded from the base causal LM
folder: the backbone keeps its weights, the 2-way head is new. Its cross-entropy over
{wrong, right} at the separators is the paper's loss (logits restricted to {"No", "Yes"} at each
`<prm>` token: a 2-way softmax, -[y log p + (1 - y) log(1 - p)]). The PRM's step score is
p = P(right | prefix through the step).

Budget rule (spec §6: "the step budget scales with rho"): ONE pass over the subset with the
paper's optimiser recipe (AdamW, weight decay 0.05, betas (0.9, 0.999), 5% linear warm-up, cosine
to 0), T = ceil(rollouts / batch_size) steps. A subset never gets extra epochs.

Evaluation (`step_f1`, `best_threshold`, `best_of_n`) is pure and lives here too, so the curve
logged during training and the `evaluate` stage measure the same thing.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io

IGNORE = -100
# The selected subsets train_prm reads (written by the BIS `select` stage): one row per kept rollout.
SUBSETS_SCHEMA = {"arm": pl.String, "seed": pl.Int64, "rollout_id": pl.String}


# --- data --------------------------------------------------------------------------------------------

def separator_id(tokenizer: Any, separator: str) -> int:
    """The id of the one token that closes each step; a separator that is not a single known
    token is an error (add it to the tokenizer first: `add_separator`)."""
    ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"separator {separator!r} is not one token of this tokenizer "
                         f"(got ids {ids}); pick another or set add_separator: true")
    return ids[0]


def encode_prm(tokenizer: Any, prompt: str, steps: Sequence[str], labels: Sequence[bool] | None,
               sep_id: int) -> dict[str, list[int]]:
    """`input_ids` = <bos> prompt, then " step" + separator per step; `labels` = -100 except at
    each separator (1 right, 0 wrong; all -100 when `labels` is None); `step_pos` = the
    separator positions."""
    if labels is not None and len(labels) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(labels)} labels")
    ids = list(tokenizer(prompt)["input_ids"])
    targets = [IGNORE] * len(ids)
    positions = []
    for j, step in enumerate(steps):
        piece = tokenizer(" " + step, add_special_tokens=False)["input_ids"]
        ids += piece + [sep_id]
        targets += [IGNORE] * len(piece) + [IGNORE if labels is None else int(labels[j])]
        positions.append(len(ids) - 1)
    return {"input_ids": ids, "labels": targets, "step_pos": positions}


def collate(rows: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, Any]:
    """Right-padded batch tensors (input_ids, attention_mask, labels)."""
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(r["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def load_prm(folder: str | Path, *, new_head: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) from a local folder; `new_head` loads a causal-LM folder as a 2-label
    token classifier (backbone weights kept, head freshly initialised). Never downloads."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from stages.models.generate import default_device

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; expected a save_pretrained folder")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    kwargs: dict[str, Any] = {"num_labels": 2, "id2label": {0: "wrong", 1: "right"},
                              "label2id": {"wrong": 0, "right": 1}} if new_head else {}
    model = AutoModelForTokenClassification.from_pretrained(str(folder), local_files_only=True,
                                                            **kwargs)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.to(default_device())   # a GPU worker's GPU; batches follow model.device
    return model, tokenizer


def step_probs(model: Any, encoded: Sequence[dict[str, list[int]]], pad_id: int,
               batch_size: int = 128) -> list[list[float]]:
    """P(step is right) at every separator of every encoded rollout."""
    import torch

    model.eval()
    out: list[list[float]] = []
    with torch.inference_mode():
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start:start + batch_size]
            batch = {k: v.to(model.device) for k, v in collate(chunk, pad_id).items()}
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits
            prob = torch.softmax(logits.float(), dim=-1)[..., 1]
            out += [prob[i, r["step_pos"]].tolist() for i, r in enumerate(chunk)]
    return out


# --- metrics (pure) ----------------------------------------------------------------------------------

def f1(pred: Sequence[bool], truth: Sequence[bool]) -> float:
    """F1 of the positive class (0 when there is no positive prediction and no positive)."""
    tp = sum(p and t for p, t in zip(pred, truth))
    fp = sum(p and not t for p, t in zip(pred, truth))
    fn = sum(t and not p for p, t in zip(pred, truth))
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def step_f1(probs: Sequence[float], truth: Sequence[bool], threshold: float) -> dict[str, float]:
    """Step-level F1 over ALL steps pooled (micro over sources): the F1 of right steps, of wrong
    steps, and `f1`, their mean (VisualProcessBench's per-class average)."""
    if len(probs) != len(truth) or not probs:
        raise ValueError(f"need equal, non-empty lists, got {len(probs)} and {len(truth)}")
    pred = [p >= threshold for p in probs]
    right = f1(pred, truth)
    wrong = f1([not p for p in pred], [not t for t in truth])
    return {"f1": (right + wrong) / 2, "f1_right": right, "f1_wrong": wrong}


def best_threshold(probs: Sequence[float], truth: Sequence[bool], grid: int = 99) -> float:
    """The threshold in {1/(grid+1), ..., grid/(grid+1)} with the highest `step_f1` (lowest
    threshold wins ties): the spec's "one global threshold tuned on a validation split"."""
    best, best_t = -1.0, 0.5
    for k in range(1, grid + 1):
        t = k / (grid + 1)
        score = step_f1(probs, truth, t)["f1"]
        if score > best + 1e-12:
            best, best_t = score, t
    return best_t


def solution_score(step_scores: Sequence[float], aggregate: str = "min") -> float:
    """One score per solution from its step scores: min (weakest step), prod, or last."""
    if not step_scores:
        raise ValueError("a solution needs at least one step score")
    if aggregate == "min":
        return min(step_scores)
    if aggregate == "prod":
        return math.prod(step_scores)
    if aggregate == "last":
        return step_scores[-1]
    raise ValueError(f"unknown aggregate {aggregate!r}: expected min, prod or last")


def best_of_n(groups: dict[str, list[tuple[float, bool]]]) -> float:
    """Share of problems whose highest-scoring solution is right (first one wins ties).
    `groups`: problem -> [(solution score, answer right)]."""
    if not groups:
        raise ValueError("best-of-N needs at least one problem")
    hits = [max(sols, key=lambda s: s[0])[1] for sols in groups.values()]
    return sum(hits) / len(hits)


def benchmark_split(rows: Sequence[dict[str, Any]], val_share: float = 0.5
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(val, test) rollouts of the held-out benchmark, split by problem (sorted ids; the first
    `val_share` of problems tune the threshold, the rest are reported)."""
    problems = sorted({r["problem_id"] for r in rows})
    cut = max(1, min(len(problems) - 1, round(len(problems) * val_share)))
    val_ids = set(problems[:cut])
    return ([r for r in rows if r["problem_id"] in val_ids],
            [r for r in rows if r["problem_id"] not in val_ids])


def evaluate_prm(model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], sep_id: int,
                 threshold: float | None = None, aggregate: str = "min",
                 batch_size: int = 128) -> dict[str, float]:
    """Step F1 against the exact verifier's labels (at `threshold`, or the best one on `rows`
    when None) and best-of-N answer accuracy with the PRM reranking each problem's solutions."""
    encoded = [encode_prm(tokenizer, r["prompt"], r["steps"], None, sep_id) for r in rows]
    probs = step_probs(model, encoded, tokenizer.pad_token_id, batch_size)
    flat = [p for ps in probs for p in ps]
    truth = [bool(t) for r in rows for t in r["step_correct"]]
    t = best_threshold(flat, truth) if threshold is None else threshold
    groups: dict[str, list[tuple[float, bool]]] = {}
    for r, ps in zip(rows, probs):
        groups.setdefault(r["problem_id"], []).append(
            (solution_score(ps, aggregate), bool(r["answer_correct"])))
    return {**step_f1(flat, truth, t), "threshold": t, "best_of_n": best_of_n(groups)}


# --- training ----------------------------------------------------------------------------------------

class PRMParams(BaseModel):
    """The budget rule and optimiser, identical for every subset (spec §2 recipe)."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(16, ge=1, le=65536, description="rollouts per step (paper: 512)")
    lr: float = Field(1e-5, gt=0, le=1, description="peak learning rate (paper: 1e-5)")
    weight_decay: float = Field(0.05, ge=0, le=1, description="AdamW weight decay (paper 0.05)")
    warmup: float = Field(0.05, ge=0, lt=1, description="linear warm-up share (paper: 5%)")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    passes: int = Field(1, ge=1, le=100, description="passes over the subset (paper: 1; spec "
                                                     "§6: never more for small subsets)")
    label: Literal["mc", "true"] = Field("mc", description="mc = y_j = 1[s_j > 0] (the paper); "
                                                           "true = the exact verifier (an "
                                                           "oracle upper bound, not in the paper)")
    separator: str = Field(";", min_length=1, description="token closing each step")
    add_separator: bool = Field(False, description="add `separator` as a new special token "
                                                   "(e.g. <prm> for a real tokenizer)")
    eval_every: int = Field(10, ge=1, description="validation F1 every k steps (the curve)")
    aggregate: Literal["min", "prod", "last"] = Field("min", description="solution score for "
                                                                        "best-of-N")
    eval_batch_size: int = Field(128, ge=1, le=65536, description="rollouts per scoring batch")

    def steps_for(self, n_rollouts: int) -> int:
        """T = ceil(passes * n / batch_size): the budget scales with the subset."""
        return math.ceil(self.passes * n_rollouts / self.batch_size)


def prepare(model: Any, tokenizer: Any, params: PRMParams) -> int:
    """The separator id, adding it to the tokenizer (and resizing the embeddings) when asked."""
    if params.add_separator and params.separator not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [params.separator]})
        model.resize_token_embeddings(len(tokenizer))
    return separator_id(tokenizer, params.separator)


def train_prm(params: PRMParams, base_dir: Path, train_rows: Sequence[dict[str, Any]],
              val_rows: Sequence[dict[str, Any]], seed: int, out_dir: Path | None = None,
              log: Callable[[dict[str, float], int], None] | None = None) -> dict[str, Any]:
    """Train a PRM from the causal LM at `base_dir` on `train_rows` (rollouts with steps and
    labels), one budget-rule pass; the validation F1 curve every `eval_every` steps. Saves the
    classifier to `out_dir` (safetensors) when given. Returns {"metrics", "curve"}."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    if not train_rows:
        raise ValueError("train_prm: the training subset is empty")
    torch.manual_seed(seed)
    model, tokenizer = load_prm(base_dir, new_head=True)
    sep_id = prepare(model, tokenizer, params)
    column = "mc_labels" if params.label == "mc" else "step_correct"
    encoded = [encode_prm(tokenizer, r["prompt"], r["steps"], r[column], sep_id)
               for r in train_rows]
    steps = params.steps_for(len(encoded))
    rng = random.Random(f"prm:{seed}")
    order: list[int] = []
    while len(order) < steps * params.batch_size:  # `passes` shuffled passes, cut at T steps
        perm = list(range(len(encoded)))
        rng.shuffle(perm)
        order += perm
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": params.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=params.lr, betas=(0.9, 0.999), eps=1e-8)
    sched = get_cosine_schedule_with_warmup(optim, math.ceil(params.warmup * steps), steps)
    val_truth = [bool(t) for r in val_rows for t in r["step_correct"]]
    val_enc = [encode_prm(tokenizer, r["prompt"], r["steps"], None, sep_id) for r in val_rows]

    def val_f1() -> float:
        probs = [p for ps in step_probs(model, val_enc, tokenizer.pad_token_id,
                                        params.eval_batch_size) for p in ps]
        return step_f1(probs, val_truth, best_threshold(probs, val_truth))["f1"]

    curve = [{"step": 0, "val_f1": val_f1()}] if val_rows else []
    started = time.perf_counter()
    losses: list[float] = []
    for step in range(1, steps + 1):
        model.train()
        idx = order[(step - 1) * params.batch_size: step * params.batch_size]
        batch = collate([encoded[i] for i in idx], tokenizer.pad_token_id)
        loss = model(**{k: v.to(model.device) for k, v in batch.items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), params.max_grad_norm)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if val_rows and (step % params.eval_every == 0 or step == steps):
            curve.append({"step": step, "val_f1": val_f1()})
            if log is not None:
                log({"train/loss": losses[-1], "val/f1": curve[-1]["val_f1"]}, step)
    seconds = time.perf_counter() - started
    model.eval()
    model.config.prm_separator_id = sep_id  # saved in config.json: scorers find the separator
    if out_dir is not None:
        io.save_model(model, tokenizer, out_dir)
    tail = losses[-max(1, len(losses) // 10):]
    return {"metrics": {"train_steps": float(steps), "train_rollouts": float(len(encoded)),
                        "train_loss": sum(tail) / len(tail), "train_seconds": seconds,
                        "val_f1": curve[-1]["val_f1"] if curve else float("nan")},
            "curve": curve, "model": model, "tokenizer": tokenizer, "sep_id": sep_id}


# --- stage `train_prm` -------------------------------------------------------------------------------

class Config(PRMParams):
    """Train a PRM on every subset of `select`, for every seed."""

    model: str = Field("base_model", description="paths key of the backbone (a causal LM folder)")
    mc_labels: str = Field("mc_labels", description="paths key of the MC-annotated rollouts")
    subsets: str = Field("subsets", description="paths key of the selected subsets")
    benchmark: str = Field("rollouts", description="paths key whose test.parquet is the held-out "
                                                   "process benchmark")
    val_share: float = Field(0.5, gt=0, lt=1, description="benchmark problems used for the "
                                                          "threshold / curve")
    out: str = Field("prms", description="paths key of the output folder")
    register_as: str | None = Field(None, description="registered model name (bis-prm)")
    register_arms: list[str] = Field(default_factory=list, description="arms whose first-seed "
                                     "PRM becomes a version of `register_as` (alias = arm)")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: default)")

    @model_validator(mode="after")
    def _register(self) -> "Config":
        if self.register_as and not self.register_arms:
            raise ValueError("register_as needs register_arms (the arms whose PRMs are "
                             "registered)")
        return self


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import DataValidationError, read_parquet_checked, spec_from_schema
    from stages.models import mc_annotate, rollouts
    from stages.models.base import set_threads

    pool = read_parquet_checked(ctx.path(cfg.mc_labels) / "train.parquet",
                                mc_annotate.expectations())
    subsets_path = ctx.path(cfg.subsets) / "subsets.parquet"
    subsets = read_parquet_checked(subsets_path, spec_from_schema(SUBSETS_SCHEMA))
    unknown = sorted(set(subsets["rollout_id"].to_list()) - set(pool["rollout_id"].to_list()))
    if unknown:
        raise DataValidationError(
            f"{subsets_path}: column 'rollout_id': rule 'known rollout' failed: {len(unknown)} "
            f"ids are not in {cfg.mc_labels}/train.parquet, e.g. {unknown[:3]}",
            source=str(subsets_path), column="rollout_id", rule="known rollout")
    bench = read_parquet_checked(ctx.path(cfg.benchmark) / "test.parquet",
                                 rollouts.expectations())
    val_rows, _ = benchmark_split(bench.to_dicts(), cfg.val_share)
    arms = list(dict.fromkeys(subsets["arm"].to_list()))
    unknown = [a for a in cfg.register_arms if a not in arms]
    if unknown:
        raise ValueError(f"register_arms {unknown} are not arms of select: {arms}")
    if cfg.num_threads:
        set_threads(cfg.num_threads)
    by_id = {r["rollout_id"]: r for r in pool.to_dicts()}
    settings = cfg.model_dump(include=set(PRMParams.model_fields))  # the PRM's own settings
    out = ctx.path(cfg.out)
    curves, metrics = [], {}
    with io.atomic_path(out, is_dir=True) as tmp:
        for arm in arms:
            for seed in subsets.filter(pl.col("arm") == arm)["seed"].unique().sort().to_list():
                ids = subsets.filter((pl.col("arm") == arm) & (pl.col("seed") == seed))
                rows = [by_id[i] for i in ids["rollout_id"].to_list()]
                with ctx.method_run("prm", arm, seed, params=settings) as mr:
                    got = train_prm(cfg, ctx.path(cfg.model), rows, val_rows, seed,
                                    tmp / arm / f"seed{seed}", log=mr.log_metrics)
                    mr.log_metrics(got["metrics"])
                curves += [{"arm": arm, "seed": seed, **p} for p in got["curve"]]
                for key in ("train_steps", "val_f1", "train_seconds"):
                    metrics[f"{arm}/seed{seed}/{key}"] = got["metrics"][key]
        io.write_parquet(tmp / "curves.parquet", pl.DataFrame(curves))
        io.write_json(tmp / "budget.json", settings)
        # which models go to the registry: the evaluation stage tags those versions with its
        # test scores (`StageTracker.annotate_model`)
        registered = {arm: int(subsets.filter(pl.col("arm") == arm)["seed"].min())
                      for arm in cfg.register_arms} if cfg.register_as else {}
        io.write_json(tmp / "registered.json", {f"{arm}/seed{seed}": cfg.register_as
                                                for arm, seed in registered.items()})
    if ctx.tracker is not None:
        for arm, seed in registered.items():
            ctx.tracker.register_model(out / arm / f"seed{seed}", cfg.register_as,
                                       aliases=[arm.replace("_", "-")],
                                       tags={"paperline.method": arm, "paperline.subset": arm,
                                             "paperline.seed": str(seed)},
                                       artifact_path=f"model-{arm}")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the mean final validation F1 over every PRM trained (`val_f1_mean`); each
    (arm, seed) in details/train_prm.json."""
    f1 = [v for k, v in metrics.items() if k.endswith("/val_f1") and math.isfinite(v)]
    return {"val_f1_mean": sum(f1) / len(f1)} if f1 else {}
