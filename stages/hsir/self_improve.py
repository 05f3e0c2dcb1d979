"""Self-improvement arms of HSIR (Zhong et al., arXiv 2605.24998): STaR, ReST-EM, the length
filter, and STaR + VeriExit / + InDiv / both (= HSIR), all by one loop (spec §2):

    theta_0 = the seed model (stage `seed_sft`: SFT on a concise / overthinking mix)
    for t in 1..T:
        sample K solutions per training query from theta_{t-1}; verify each answer exactly
        pool = the arm's rule over the samples                  (`build_pool`, pure)
        theta_t = SFT(theta_{t-1}, pool), the SAME number of gradient steps in every arm

The arms differ only in the pool rule (`stages.hsir.hsir`): STaR keeps the correct samples,
ReST-EM caps them per query, the length filter keeps the shortest 70%, VeriExit adds wrong
samples cut after the first step whose result is gold, InDiv drops correct samples whose steps
are near-duplicates in the model's own hidden space (score < tau). After every round the model
is evaluated greedily on held-out prompts of the training distribution and on a hard split
(deeper expressions): accuracy and generated tokens per solved query (HSIR's "overhead").

Where this departs from the paper (details in pipelines/hsir/README.md):
- SFT only; the paper's headline arm is HSIR-DPO (pairs), not implemented here.
- tau: the paper's -0.5 lives on its own (unknown) InDiv scale; with `tau: null` it is calibrated
  in round 1 so that `drop_frac` of the candidate solutions fall below it, then kept fixed.
- Every round trains from theta_{t-1} (the spec's loop), not from the seed model (STaR's).

    python -m stages hsir star             # one arm; sizes from the active profile
    dvc repro pipelines/hsir/dvc.yaml      # every arm, then `compare`
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.core.stats import mean_std
from stages.hsir import hsir


class Config(BaseModel):
    """One self-training arm: its pool rule, the shared budget, where to start, which seeds."""

    model_config = ConfigDict(extra="forbid")

    family: Literal["arith"] = Field("arith", description="task family (VeriExit and the "
                                                          "seed traces are arith-specific)")
    # The arm.
    pool: Literal["star", "rest_em", "length_filter"] = Field(
        "star", description="base rule: star = every correct sample; rest_em = at most "
                            "max_per_query per query; length_filter = the shortest keep_frac")
    veriexit: bool = Field(False, description="add VeriExit recoveries (pool: star only)")
    indiv_filter: bool = Field(False, description="drop candidates with InDiv < tau "
                                                  "(pool: star only)")
    max_per_query: int = Field(3, ge=1, le=1000, description="ReST-EM cap per query")
    keep_frac: float = Field(0.7, gt=0, le=1, description="length filter: share kept")
    # Budget: equal across arms (the compare stage checks it).
    rounds: int = Field(3, ge=1, le=100, description="T, self-improvement iterations")
    samples_per_query: int = Field(10, ge=1, le=1024, description="K, samples per query")
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature")
    max_new_tokens: int = Field(128, ge=1, le=32768, description="generation budget, tokens")
    sft_steps_per_round: int = Field(40, ge=1, le=1_000_000, description="gradient steps per "
                                                                         "round, every arm")
    batch_size: int = Field(32, ge=1, le=8192, description="SFT rows per gradient step")
    lr: float = Field(2e-4, gt=0, le=1, description="SFT peak learning rate")
    warmup: float = Field(0.0, ge=0, lt=1, description="linear warmup, share of a round's steps")
    min_lr_ratio: float = Field(1.0, ge=0, le=1, description="cosine decay to lr * this "
                                                             "(1.0 = constant)")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay")
    # InDiv (spec §2 [reconstructed]).
    indiv_method: Literal["eigenscore", "spectral_entropy"] = Field(
        "eigenscore", description="InDiv formula (stages.hsir.hsir.INDIV_METHODS)")
    indiv_layer: int | Literal["middle"] = Field(-1, description="hidden layer InDiv reads")
    tau: float | None = Field(None, description="InDiv threshold; None: calibrate in round 1 "
                                                "(paper: -0.5 on its own scale)")
    drop_frac: float = Field(0.3, ge=0, le=1, description="share of round-1 candidates below "
                                                          "the calibrated tau (spec: 20-40%)")
    # Bookkeeping.
    hard_difficulty: int = Field(5, ge=1, description="a query with difficulty >= this is hard "
                                                      "(pool statistics)")
    eval_rows: int | None = Field(200, ge=1, description="held-out prompts per split (None: all)")
    gen_batch_size: int = Field(256, ge=1, le=65536, description="sequences decoded together")
    indiv_batch_size: int = Field(64, ge=1, le=8192, description="rows per InDiv forward pass")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="training seeds; each starts from the seed model")
    model: str = Field("seed_model", description="paths key of the starting model folder")
    prompts: str = Field("hsir_prompts", description="paths key of the training prompts "
                                                     "(train.parquet, test.parquet)")
    hard_prompts: str = Field("hard_prompts", description="paths key of the hard split "
                                                          "(its test.parquet)")
    out: str = Field("runs", description="paths key of the folder holding <out>/<stage>/")
    method: str | None = Field(None, description="method name (default: the stage name)")
    register_as: str | None = Field(None, description="registered model name (the first "
                                                      "seed's model; alias = method)")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: all cores)")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.pool != "star" and (self.veriexit or self.indiv_filter):
            raise ValueError(f"veriexit / indiv_filter build on STaR's pool; pool = "
                             f"{self.pool!r} takes neither")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        return self

    @property
    def budget(self) -> dict[str, Any]:
        """What must be equal across the arms of a fair comparison."""
        return {"rounds": self.rounds, "samples_per_query": self.samples_per_query,
                "sft_steps_per_round": self.sft_steps_per_round, "batch_size": self.batch_size,
                "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "lr": self.lr}


# --- the pool of one round (pure) -------------------------------------------------------------

def label_samples(rows: Sequence[Mapping[str, Any]], completions: Sequence[Sequence[str]],
                  verify: Callable[[Mapping[str, Any], str], bool]) -> list[dict[str, Any]]:
    """One sample dict per (query, completion): what the pool rules of `hsir` read."""
    return [{"query_id": r["id"], "difficulty": int(r["difficulty"]), "prompt": r["prompt"],
             "completion": c, "correct": bool(verify(r, c)), "sample": j}
            for r, outs in zip(rows, completions) for j, c in enumerate(outs)]


def build_pool(samples: Sequence[Mapping[str, Any]], question_of: Mapping[Any, str],
               gold_of: Mapping[Any, int], *, pool: str = "star", veriexit: bool = False,
               indiv_filter: bool = False, max_per_query: int = 3, keep_frac: float = 0.7,
               indiv_of: hsir.IndivOf | None = None, tau: float | None = None,
               drop_frac: float = 0.3) -> tuple[list[dict[str, Any]], float | None]:
    """(pool, tau) of one round by the arm's rule.

    With the InDiv filter and `tau=None`, tau is calibrated on this round's candidates (correct +
    VeriExit rows) so that `drop_frac` of them fall below it, and returned for later rounds;
    with no candidate the pool is empty and tau stays None. InDiv is computed once per candidate.
    """
    if pool == "rest_em":
        return hsir.rest_em_pool(samples, max_per_query), tau
    if pool == "length_filter":
        return hsir.length_filter_pool(samples, keep_frac), tau
    if pool != "star":
        raise ValueError(f"pool = {pool!r}: expected star, rest_em or length_filter")
    if not indiv_filter:
        return hsir.hsir_pool(samples, question_of, gold_of, None, 0.0, veriexit, False), tau
    if indiv_of is None:
        raise ValueError("indiv_filter needs indiv_of")
    candidates = hsir.hsir_pool(samples, question_of, gold_of, None, 0.0, veriexit, False)
    scores = list(indiv_of(candidates))
    if tau is None:
        if not any(math.isfinite(s) for s in scores):
            return [], None
        tau = hsir.calibrate_threshold(scores, drop_frac)
    # The same candidates in the same order: hand hsir_pool the scores computed above.
    return hsir.hsir_pool(samples, question_of, gold_of, lambda rows: scores, tau, veriexit,
                          True), tau


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def pool_stats(pool: Sequence[Mapping[str, Any]], samples: Sequence[Mapping[str, Any]],
               hard_difficulty: int) -> dict[str, float]:
    """What each arm's pool looks like (keys `pool_*`): size, hard share, VeriExit rows and their
    faithfulness, overthinking (re-verification steps); and the sampling accuracy it came from."""
    hard_queries = {s["query_id"] for s in samples if s["difficulty"] >= hard_difficulty}
    covered = {r["query_id"] for r in pool}
    veri = [r for r in pool if r.get("source") == "veriexit"]
    repeats = [hsir.count_repeats(r["completion"]) for r in pool]
    return {
        "pool_size": float(len(pool)),
        "pool_queries": float(len(covered)),
        "pool_hard_share": _mean([float(r["difficulty"] >= hard_difficulty) for r in pool]),
        "pool_hard_coverage": (len(covered & hard_queries) / len(hard_queries)
                               if hard_queries else math.nan),
        "pool_veriexit_rows": float(len(veri)),
        "pool_veriexit_faithful": float(sum(bool(r.get("faithful")) for r in veri)),
        "pool_faithful_rate": _mean([float(bool(r.get("faithful"))) for r in veri]),
        "pool_mean_repeats": _mean([float(n) for n in repeats]),
        "pool_verbose_share": _mean([float(n > 0) for n in repeats]),
        "pool_chars": _mean([float(len(r["completion"])) for r in pool]),
        "sample_acc": _mean([float(s["correct"]) for s in samples]),
    }


# --- model steps: evaluate, score ------------------------------------------------------------

def greedy_eval(model: Any, tokenizer: Any, rows: list[dict[str, Any]], family: str,
                max_new_tokens: int, batch_size: int) -> dict[str, float]:
    """One greedy pass over `rows`: accuracy, generated tokens per SOLVED query (HSIR's
    overhead), mean tokens, share of outputs that re-verify (>= 1 "check" step) and their mean
    count. The tokens exclude <eos>."""
    from stages.models.generate import generate
    from stages.tasks import get_family

    fam = get_family(family)
    model.eval()
    outs = [o[0] for o in generate(model, tokenizer, [r["prompt"] for r in rows],
                                   max_new_tokens=max_new_tokens, batch_size=batch_size)]
    ok = [fam.verify_answer(r, o) for r, o in zip(rows, outs)]
    tokens = [len(tokenizer(o, add_special_tokens=False)["input_ids"]) for o in outs]
    repeats = [hsir.count_repeats(o) for o in outs]
    return {"acc": _mean([float(x) for x in ok]) if ok else 0.0,
            "tokens_per_solved": _mean([float(t) for t, c in zip(tokens, ok) if c]),
            "mean_tokens": _mean([float(t) for t in tokens]),
            "verbose_share": _mean([float(n > 0) for n in repeats]),
            "mean_repeats": _mean([float(n) for n in repeats])}


def eval_splits(model: Any, tokenizer: Any, splits: Mapping[str, list[dict[str, Any]]],
                family: str, max_new_tokens: int, batch_size: int) -> dict[str, float]:
    """`greedy_eval` per split, keys prefixed by the split name unless it is "" (e.g. acc,
    hard_acc)."""
    out: dict[str, float] = {}
    for name, rows in splits.items():
        prefix = f"{name}_" if name else ""
        for k, v in greedy_eval(model, tokenizer, rows, family, max_new_tokens,
                                batch_size).items():
            out[prefix + k] = v
    return out


def indiv_scorer(model: Any, tokenizer: Any, method: str, layer: Any,
                 batch_size: int) -> hsir.IndivOf:
    """rows -> InDiv of each row's completion after its prompt, under `model`."""
    def score(rows: list[dict[str, Any]]) -> list[float]:
        if not rows:
            return []
        return hsir.indiv_scores(model, tokenizer, [r["prompt"] for r in rows],
                                 [r["completion"] for r in rows], layer=layer, method=method,
                                 batch_size=batch_size)
    return score


# --- the loop ----------------------------------------------------------------------------------

def self_train(cfg: Config, start: Path, train_rows: list[dict[str, Any]],
               eval_sets: Mapping[str, list[dict[str, Any]]], seed: int, out_dir: Path,
               pools_dir: Path, log: Callable[[dict[str, float], int], None] | None = None,
               name: str = "self_train") -> list[dict[str, float]]:
    """T rounds of sample -> pool -> SFT from the model at `start`; saves the final model to
    `out_dir` and each round's pool to `pools_dir/round<t>_seed<seed>.parquet`. Returns one
    curve row per round t >= 1 (evaluation after the round + pool statistics)."""
    from transformers import set_seed

    from stages.models.generate import generate, load_model
    from stages.tasks import get_family
    from stages.train.sft import sft

    fam = get_family(cfg.family)
    set_seed(seed)
    model, tokenizer = load_model(start)
    question_of = {r["id"]: r["question"] for r in train_rows}
    gold_of = {r["id"]: int(r["answer"]) for r in train_rows}
    scorer = indiv_scorer(model, tokenizer, cfg.indiv_method, cfg.indiv_layer,
                          cfg.indiv_batch_size)
    tau, curve, rollouts = cfg.tau, [], 0
    for t in range(1, cfg.rounds + 1):
        started = time.perf_counter()
        outs = generate(model, tokenizer, [r["prompt"] for r in train_rows],
                        max_new_tokens=cfg.max_new_tokens, do_sample=True,
                        temperature=cfg.temperature, num_samples=cfg.samples_per_query,
                        batch_size=cfg.gen_batch_size, seed=1000 * seed + t)
        samples = label_samples(train_rows, outs, fam.verify_answer)
        rollouts += len(samples)
        pool, tau = build_pool(samples, question_of, gold_of, pool=cfg.pool,
                               veriexit=cfg.veriexit, indiv_filter=cfg.indiv_filter,
                               max_per_query=cfg.max_per_query, keep_frac=cfg.keep_frac,
                               indiv_of=scorer, tau=tau, drop_frac=cfg.drop_frac)
        stats = pool_stats(pool, samples, cfg.hard_difficulty)
        _write_pool(pools_dir / f"round{t}_seed{seed}.parquet", pool)
        steps = 0
        if pool:  # nothing to learn from: the round keeps theta_{t-1} (a result, not a bug)
            sft(model, tokenizer, [r["prompt"] for r in pool], [r["completion"] for r in pool],
                steps=cfg.sft_steps_per_round, batch_size=cfg.batch_size, lr=cfg.lr,
                seed=1000 * seed + t, warmup=cfg.warmup, min_lr_ratio=cfg.min_lr_ratio,
                weight_decay=cfg.weight_decay, log=log,
                step_offset=(t - 1) * cfg.sft_steps_per_round)
            steps = cfg.sft_steps_per_round
        point = {"round": float(t), "rollouts": float(rollouts), "sft_steps": float(steps),
                 "tau": math.nan if tau is None else float(tau), **stats,
                 **eval_splits(model, tokenizer, eval_sets, cfg.family, cfg.max_new_tokens,
                               cfg.gen_batch_size)}
        curve.append(point)
        # the wall time goes to MLflow only: the curve is a DVC output (same inputs, same bytes)
        if log:
            log({k: v for k, v in point.items() if math.isfinite(v)}
                | {"round_seconds": time.perf_counter() - started}, t * cfg.sft_steps_per_round)
        print(f"{name} seed {seed} round {t}: pool {len(pool)}, "
              f"acc {point['acc']:.3f}, hard {point['hard_acc']:.3f}, "
              f"tokens/solved {point['tokens_per_solved']:.1f}", flush=True)
    model.eval()
    io.save_model(model, tokenizer, out_dir)
    return curve


def _write_pool(path: Path, pool: list[dict[str, Any]]) -> None:
    """The pool as a table: what the SFT of this round saw (DVC-tracked with the arm)."""
    import polars as pl

    schema = {"query_id": pl.String, "difficulty": pl.Int64, "prompt": pl.String,
              "completion": pl.String, "source": pl.String, "faithful": pl.Boolean,
              "indiv": pl.Float64, "original_completion": pl.String}
    df = pl.DataFrame([{k: r.get(k) for k in schema} for r in pool], schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    io.write_parquet(path, df)


# --- the stage: one arm, several seeds ---------------------------------------------------------

def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked
    from stages.models.base import set_threads
    from stages.models.generate import load_model
    from stages.tasks import get_family

    set_threads(cfg.num_threads)
    method = cfg.method or ctx.stage
    expect = get_family(cfg.family).expectations
    prompts = ctx.path(cfg.prompts)
    train_rows = read_parquet_checked(prompts / "train.parquet", expect(None, "train")).to_dicts()
    test_rows = read_parquet_checked(prompts / "test.parquet", expect(None, "test")).to_dicts()
    hard_rows = read_parquet_checked(ctx.path(cfg.hard_prompts) / "test.parquet",
                                     expect(None, "test")).to_dicts()
    n = cfg.eval_rows
    eval_sets = {"": test_rows[:n] if n else test_rows, "hard": hard_rows[:n] if n else hard_rows}
    start = ctx.path(cfg.model)
    model, tokenizer = load_model(start)  # round 0: the seed model, the same for every seed
    zero = eval_splits(model, tokenizer, eval_sets, cfg.family, cfg.max_new_tokens,
                       cfg.gen_batch_size)
    del model
    out = ctx.path(cfg.out) / ctx.stage
    rows = []
    with io.atomic_path(out, is_dir=True) as tmp:
        for seed in cfg.seeds:
            with ctx.method_run("self_train", method, seed,
                                params=cfg.model_dump(mode="json")) as mr:
                mr.log_metrics({k: v for k, v in zero.items() if math.isfinite(v)}, 0)
                curve = self_train(cfg, start, train_rows, eval_sets, seed, tmp / f"seed{seed}",
                                   tmp / "pools", log=mr.log_metrics, name=method)
            rows.append({"method": method, "seed": seed, "round": 0.0, "rollouts": 0.0,
                         "sft_steps": 0.0, **zero})
            rows += [{"method": method, "seed": seed, **p} for p in curve]
        frame = pl.DataFrame(rows, infer_schema_length=None)
        io.write_parquet(tmp / "curve.parquet", frame)
        io.write_json(tmp / "budget.json", {"method": method, "kind": "self_train",
                                            "pool": cfg.pool, "veriexit": cfg.veriexit,
                                            "indiv_filter": cfg.indiv_filter,
                                            "train_queries": len(train_rows), **cfg.budget})
    final = frame.filter(pl.col("round") == float(cfg.rounds))
    if cfg.register_as and ctx.tracker is not None:
        first = out / f"seed{cfg.seeds[0]}"
        ctx.tracker.register_model(first, cfg.register_as, aliases=[method.replace("_", "-")],
                                   tags={"paperline.method": method,
                                         "paperline.seed": str(cfg.seeds[0])})
        ctx.tracker.annotate_model(first, {"final_acc": final["acc"][0],
                                           "final_hard_acc": final["hard_acc"][0]})
    metrics = summarize_curve(frame, cfg.rounds, len(train_rows))
    return {k: v for k, v in metrics.items() if math.isfinite(v)}  # n/a (e.g. no VeriExit) left out


def summarize_curve(frame: Any, rounds: int, train_queries: int) -> dict[str, float]:
    """Flat metrics of an arm: final-round evaluation (mean, std over seeds), pool statistics
    averaged over rounds and seeds, the seed model's (round 0) scores."""
    import polars as pl

    final = frame.filter(pl.col("round") == float(rounds))
    trained = frame.filter(pl.col("round") > 0)
    metrics: dict[str, float] = {}
    for key in ("acc", "hard_acc", "tokens_per_solved", "hard_tokens_per_solved", "mean_tokens",
                "verbose_share"):
        metrics[f"{key}_mean"], metrics[f"{key}_std"] = mean_std(final[key].to_list())
    for key in ("pool_size", "pool_hard_share", "pool_hard_coverage", "pool_veriexit_rows",
                "pool_mean_repeats", "pool_verbose_share", "sample_acc", "tau"):
        metrics[key] = mean_std(trained[key].to_list())[0]
    veri = float(trained["pool_veriexit_rows"].sum())
    metrics["pool_faithful_rate"] = (float(trained["pool_veriexit_faithful"].sum()) / veri
                                     if veri else math.nan)
    zero = frame.filter(pl.col("round") == 0.0)
    metrics["initial_acc"] = float(zero["acc"][0])
    metrics["initial_hard_acc"] = float(zero["hard_acc"][0])
    metrics["train_queries"] = float(train_queries)
    metrics["seeds"] = float(frame["seed"].n_unique())
    return metrics



def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the arm's final accuracy (mean, std over seeds), on the hard prompts, and
    tokens per solved prompt; the pool statistics and the rest in details/<arm>.json."""
    return {k: metrics[k] for k in ("acc_mean", "acc_std", "hard_acc_mean",
                                    "tokens_per_solved_mean") if k in metrics}
