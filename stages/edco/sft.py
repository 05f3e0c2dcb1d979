"""Curriculum SFT arms of EDCO (spec §2 loop, §4 curricula), all at one budget:

    theta = the base model;  D = the pool (with ~5% label-noise rows, flagged)
    for r in 1..R:
        C_r = the arm's N pool rows for this round
        theta = SFT(theta, C_r): one pass, N / batch_size gradient steps    (equal in every arm)
        evaluate theta greedily on the clean held-out set of the new domain

Arms differ only in how C_r is chosen (`strategy`):
- `edco`: the current model scores EVERY pool prompt by inference entropy
  (`stages.edco.edco.prompt_entropy`, prefix of L tokens, top-20% aggregation) and C_r is the
  top N; nothing stops a row from being picked in several rounds (as in the code).
- `loss`: the dynamic loss baseline of the official code: top N by the current model's loss on
  the target (a label-noise row has a high loss: the noise magnet at its plainest).
- `random`: a fresh seeded shuffle of the pool per epoch, cut into R chunks of N.
- `easy_to_hard`: the pool sorted by difficulty (number of operands), walked in R chunks of N.
- `ppl`: the pool sorted once by the base model's perplexity of the target (ascending = easy
  first), walked in R chunks of N.
With N = 2 * |pool| / R (the code's rule: 2 epochs), every static arm walks the pool twice.

Logged per round (MLflow child run per seed, curve.parquet): held-out accuracy overall, per
difficulty and on rows with / without `*`; the selection's noisy share (spec pitfall "noise
magnet"), share of `*` rows, mean difficulty, rows new to the curriculum, mean score.

    python -m stages edco sft_edco                 # one arm; sizes from the active profile
    dvc repro pipelines/edco/dvc.yaml              # every arm, then `compare`
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.edco import edco

STRATEGIES = ("edco", "loss", "random", "easy_to_hard", "ppl")


class Config(BaseModel):
    """One curriculum-SFT arm: its strategy, the shared budget, where to start, which seeds."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["edco", "loss", "random", "easy_to_hard", "ppl"] = Field(
        "edco", description="how each round's N rows are chosen (module docstring)")
    estimator: edco.EstimatorParams = Field(default_factory=edco.EstimatorParams,
                                            description="entropy estimator (strategy: edco)")
    ppl_order: Literal["ascending", "descending"] = Field(
        "ascending", description="static PPL curriculum: low perplexity (easy) first or last")
    # Budget: equal across arms (the compare stage checks it).
    rounds: int = Field(4, ge=1, le=1000, description="R, curriculum rounds (the code: 8)")
    top_n: int = Field(448, ge=1, le=10_000_000, description="N, rows trained per round "
                                                             "(the code: pool * 2 / R)")
    batch_size: int = Field(32, ge=1, le=8192, description="rows per gradient step (global "
                                                           "batch; the code: 8)")
    lr: float = Field(3e-4, gt=0, le=1, description="AdamW peak learning rate")
    warmup: float = Field(0.0, ge=0, lt=1, description="linear warmup, share of a round's steps")
    min_lr_ratio: float = Field(1.0, ge=0, le=1, description="cosine decay to lr * this within "
                                                             "a round (1.0 = constant)")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay")
    # Evaluation and bookkeeping.
    eval_rows: int | None = Field(None, ge=1, description="held-out rows evaluated (None: all)")
    max_new_tokens: int = Field(64, ge=1, le=32768, description="greedy evaluation budget")
    gen_batch_size: int = Field(256, ge=1, le=65536, description="sequences decoded together")
    nll_batch_size: int = Field(128, ge=1, le=65536, description="rows per loss forward pass")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="training seeds; each starts from the same model")
    family: Literal["arith"] = Field("arith", description="task family of the pool")
    model: str = Field("base_model", description="paths key of the starting model folder")
    pool: str = Field("edco_pool", description="paths key of the pool folder")
    out: str = Field("runs", description="paths key of the folder holding <out>/<stage>/")
    method: str | None = Field(None, description="method name (default: the stage name)")
    register_as: str | None = Field(None, description="registered model name (the first "
                                                      "seed's model; alias = method)")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: all cores)")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.top_n % self.batch_size:
            raise ValueError(f"top_n = {self.top_n} must be a multiple of batch_size = "
                             f"{self.batch_size}: a round is one pass of whole batches")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        return self

    @property
    def steps_per_round(self) -> int:
        return self.top_n // self.batch_size

    @property
    def budget(self) -> dict[str, Any]:
        """What must be equal across the arms of a fair comparison."""
        return {"rounds": self.rounds, "top_n": self.top_n, "batch_size": self.batch_size,
                "steps_per_round": self.steps_per_round, "lr": self.lr, "warmup": self.warmup,
                "min_lr_ratio": self.min_lr_ratio, "weight_decay": self.weight_decay}


# --- selection statistics and evaluation --------------------------------------------------------

def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def selection_stats(rows: Sequence[dict[str, Any]], picked: Sequence[int],
                    seen: set[int], scores: Sequence[float] | None) -> dict[str, float]:
    """What a round's selection looks like: noisy share (noise magnet), `*` share, difficulty,
    rows never selected before in this run, mean score of the selection (NaN for static arms)."""
    sel = [rows[i] for i in picked]
    return {"selected": float(len(sel)),
            "noisy_frac": _mean([float(r["noisy"]) for r in sel]),
            "mul_share": _mean([float("*" in r["question"]) for r in sel]),
            "mean_difficulty": _mean([float(r["difficulty"]) for r in sel]),
            "new_items": float(len(set(picked) - seen)),
            "mean_score": (_mean([float(scores[i]) for i in picked]) if scores is not None
                           else math.nan),
            "pool_mean_score": _mean([float(s) for s in scores]) if scores is not None
            else math.nan}


def evaluate(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int,
             batch_size: int) -> dict[str, float]:
    """Greedy accuracy on clean held-out rows: overall, per difficulty, with / without `*`."""
    from stages.models.generate import generate
    from stages.tasks import arith

    model.eval()
    outs = generate(model, tokenizer, [r["prompt"] for r in rows],
                    max_new_tokens=max_new_tokens, batch_size=batch_size)
    ok = [float(arith.verify_answer({"answer": r["clean_answer"]}, o[0]))
          for r, o in zip(rows, outs)]
    out = {"acc": _mean(ok),
           "acc_mul": _mean([k for r, k in zip(rows, ok) if "*" in r["question"]]),
           "acc_plus_minus": _mean([k for r, k in zip(rows, ok) if "*" not in r["question"]])}
    for d in sorted({int(r["difficulty"]) for r in rows}):
        out[f"acc_d{d}"] = _mean([k for r, k in zip(rows, ok) if int(r["difficulty"]) == d])
    return out


def static_schedule(cfg: Config, rows: Sequence[dict[str, Any]], seed: int,
                    base_nll: Sequence[float] | None) -> list[list[int]]:
    """The R chunks of a static arm (random / easy_to_hard / ppl)."""
    size = len(rows)
    if cfg.strategy == "random":
        epochs = math.ceil(cfg.top_n * cfg.rounds / size)
        order = edco.random_order(size, epochs, seed)
    elif cfg.strategy == "easy_to_hard":
        order = edco.easy_to_hard_order([int(r["difficulty"]) for r in rows], seed)
    elif cfg.strategy == "ppl":
        if base_nll is None:
            raise ValueError("strategy ppl needs the base model's target NLL")
        order = edco.score_order(base_nll, ascending=cfg.ppl_order == "ascending")
    else:
        raise ValueError(f"strategy {cfg.strategy!r} is dynamic, not a static schedule")
    return edco.tile_schedule(order, cfg.top_n, cfg.rounds)


# --- the loop ----------------------------------------------------------------------------------

def curriculum_sft(cfg: Config, start: Path, rows: list[dict[str, Any]],
                   test_rows: list[dict[str, Any]], seed: int, out_dir: Path,
                   base_nll: Sequence[float] | None = None,
                   log: Callable[[dict[str, float], int], None] | None = None,
                   name: str = "sft") -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    """R rounds of select -> one SFT pass from the model at `start`; saves the final model to
    `out_dir`. Returns (one curve row per round >= 1, one selection row per selected item)."""
    from transformers import set_seed

    from stages.models.generate import load_model
    from stages.train.sft import sft

    if not rows:
        raise ValueError("curriculum_sft: the pool is empty")
    if cfg.top_n > len(rows):
        raise ValueError(f"top_n = {cfg.top_n} but the pool has only {len(rows)} rows: "
                         f"lower top_n or grow the pool (N <= pool size)")
    set_seed(seed)
    model, tokenizer = load_model(start)
    prompts = [r["prompt"] for r in rows]
    schedule = (None if cfg.strategy in ("edco", "loss")
                else static_schedule(cfg, rows, seed, base_nll))
    seen: set[int] = set()
    curve, picks = [], []
    for r in range(1, cfg.rounds + 1):
        started = time.perf_counter()
        scores = None
        if cfg.strategy == "edco":
            scores = edco.prompt_entropy(model, tokenizer, prompts, cfg.estimator,
                                         seed=1000 * seed + r)
            picked = edco.select_top_n(scores, cfg.top_n)
        elif cfg.strategy == "loss":
            scores = edco.target_nll(model, tokenizer, prompts, [x["target"] for x in rows],
                                     cfg.nll_batch_size)
            picked = edco.select_top_n(scores, cfg.top_n)
        else:
            picked = schedule[r - 1]
        select_seconds = time.perf_counter() - started
        stats = selection_stats(rows, picked, seen, scores)
        seen.update(picked)
        picks += [{"seed": seed, "round": r, "rank": k, "row": i, "id": rows[i]["id"],
                   "noisy": bool(rows[i]["noisy"]),
                   "score": math.nan if scores is None else float(scores[i])}
                  for k, i in enumerate(picked)]
        train = sft(model, tokenizer, [prompts[i] for i in picked],
                    [rows[i]["target"] for i in picked], steps=cfg.steps_per_round,
                    batch_size=cfg.batch_size, lr=cfg.lr, seed=1000 * seed + r,
                    warmup=cfg.warmup, min_lr_ratio=cfg.min_lr_ratio,
                    weight_decay=cfg.weight_decay, log=log,
                    log_every=max(1, cfg.steps_per_round // 2),
                    step_offset=(r - 1) * cfg.steps_per_round)
        point = {"round": float(r), "sft_steps": float(r * cfg.steps_per_round),
                 "train_loss": float(train["train_loss"]), **stats,
                 **evaluate(model, tokenizer, test_rows, cfg.max_new_tokens, cfg.gen_batch_size),
                 "unique_items": float(len(seen))}
        curve.append(point)
        # wall times go to MLflow only: the curve is a DVC output, same inputs -> same bytes
        times = {"select_seconds": select_seconds, "round_seconds": time.perf_counter() - started}
        if log:
            log({k: v for k, v in (point | times).items() if math.isfinite(v)},
                r * cfg.steps_per_round)
        print(f"{name} seed {seed} round {r}: acc {point['acc']:.3f} (x: {point['acc_mul']:.3f})"
              f", noisy {stats['noisy_frac']:.3f}, x-share {stats['mul_share']:.2f}, "
              f"select {select_seconds:.1f}s, round {times['round_seconds']:.1f}s", flush=True)
    model.eval()
    io.save_model(model, tokenizer, out_dir)
    return curve, picks


# --- the stage: one arm, several seeds ---------------------------------------------------------

def load_pool(ctx: Any, key: str, eval_rows: int | None) -> tuple[list[dict], list[dict]]:
    """(pool rows, held-out rows), validated at the stage boundary; the held-out set is clean."""
    from stages.edco.pool import read_pool

    folder = ctx.path(key)
    rows = read_pool(folder / "pool.parquet").to_dicts()
    test = read_pool(folder / "test.parquet", "test").to_dicts()
    if not rows:
        raise ValueError(f"{folder / 'pool.parquet'}: the pool is empty")
    return rows, (test[:eval_rows] if eval_rows else test)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.models.base import set_threads
    from stages.models.generate import load_model

    set_threads(cfg.num_threads)
    method = cfg.method or ctx.stage
    rows, test_rows = load_pool(ctx, cfg.pool, cfg.eval_rows)
    if cfg.top_n > len(rows):  # before any compute
        raise ValueError(f"{ctx.stage}.top_n = {cfg.top_n} but the pool has only {len(rows)} "
                         f"rows: expected N <= pool size")
    start = ctx.path(cfg.model)
    model, tokenizer = load_model(start)  # round 0: the base model, the same for every seed
    zero = evaluate(model, tokenizer, test_rows, cfg.max_new_tokens, cfg.gen_batch_size)
    base_nll = None
    if cfg.strategy == "ppl":  # static PPL: computed once, with the base model
        base_nll = edco.target_nll(model, tokenizer, [r["prompt"] for r in rows],
                                   [r["target"] for r in rows], cfg.nll_batch_size)
    del model
    out = ctx.path(cfg.out) / ctx.stage
    curve_rows, pick_rows = [], []
    with io.atomic_path(out, is_dir=True) as tmp:
        for seed in cfg.seeds:
            with ctx.method_run("sft", method, seed, params={
                    "strategy": cfg.strategy, **cfg.model_dump(mode="json")}) as mr:
                mr.log_metrics({k: v for k, v in zero.items() if math.isfinite(v)}, 0)
                curve, picks = curriculum_sft(cfg, start, rows, test_rows, seed,
                                              tmp / f"seed{seed}", base_nll,
                                              log=mr.log_metrics, name=method)
                mr.log_metrics({"final_acc": curve[-1]["acc"]})
            curve_rows.append({"method": method, "seed": seed, "round": 0.0, "sft_steps": 0.0,
                               **zero})
            curve_rows += [{"method": method, "seed": seed, **p} for p in curve]
            pick_rows += picks
        frame = pl.DataFrame(curve_rows, infer_schema_length=None)
        io.write_parquet(tmp / "curve.parquet", frame)
        io.write_parquet(tmp / "selections.parquet", pl.DataFrame(pick_rows,
                                                                  infer_schema_length=None))
        io.write_json(tmp / "budget.json", {"method": method, "kind": "sft",
                                            "strategy": cfg.strategy, "pool_size": len(rows),
                                            **cfg.budget})
    return finish(cfg, ctx, out, method, frame)


def finish(cfg: Any, ctx: Any, out: Path, method: str, frame: Any) -> dict[str, float]:
    """Register the first seed's model (`<register_as>`, alias = method, tag = strategy) and
    return the arm's flat metrics: final accuracy (mean, std over seeds), selection shares."""
    import polars as pl

    from stages.core.stats import mean_std

    final = frame.filter(pl.col("round") == float(cfg.rounds))
    if cfg.register_as and ctx.tracker is not None:
        first = out / f"seed{cfg.seeds[0]}"
        ctx.tracker.register_model(first, cfg.register_as, aliases=[method.replace("_", "-")],
                                   tags={"paperline.method": method,
                                         "edco.strategy": cfg.strategy,
                                         "edco.aggregate": (cfg.estimator.aggregate
                                                            if cfg.strategy == "edco" else "-"),
                                         "paperline.seed": str(cfg.seeds[0])})
        ctx.tracker.annotate_model(first, {"final_acc": final["acc"][0],
                                           "final_acc_mul": final["acc_mul"][0]})
    metrics: dict[str, float] = {}
    for key in ("acc", "acc_mul", "acc_plus_minus"):
        metrics[f"{key}_mean"], metrics[f"{key}_std"] = mean_std(final[key].to_list())
    trained = frame.filter(pl.col("round") > 0)
    for key in ("noisy_frac", "mul_share", "new_items"):
        metrics[key] = mean_std(trained[key].to_list())[0]
    metrics["initial_acc"] = float(frame.filter(pl.col("round") == 0.0)["acc"][0])
    metrics["seeds"] = float(len(cfg.seeds))
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the arm's final held-out accuracy (mean, std over seeds) and on rows with
    `*`; the curriculum statistics in details/<arm>.json."""
    return {k: metrics[k] for k in ("acc_mean", "acc_std", "acc_mul_mean") if k in metrics}
