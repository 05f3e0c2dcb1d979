"""RL arms of the TRACE pipeline: GRPO with reward 1[correct] (+ lambda * TRACE).

Paper [secondary]: GRPO on Qwen2.5-7B / GSM8K, accuracy-only reward 76.2 vs accuracy + TRACE
81.4. Reward form [reconstructed, spec §2]: r = 1[correct] + lambda * TRACE(CoT), lambda = 0.5;
`trace_weight: 0` is the accuracy-only arm, so both arms run this same module with identical
budgets. `gate_on_correct: true` pays the TRACE term only on correct responses (spec §6 reward-
hacking guard; off by default, as in the reconstructed form).

Engine: `stages.train.grpo` (TRL's GRPOTrainer with its clipped loss and the exact arith verifier
reward), extended, not copied: the TRACE term is one more reward (`TraceReward`, which loads the
tagger once per run) and the evaluation before and after training is TRACE's own
(`TraceEvaluation`: greedy accuracy, mean TRACE of the greedy CoTs, length, empty-set rate on the
held-out prompts), per seed.

    python -m stages trace rl_acc      # lambda = 0
    python -m stages trace rl_trace    # lambda = 0.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from stages.core.checks import read_json_checked
from stages.core import io
from stages.core.stats import mean_std
from stages.trace import trace
from stages.train import grpo

# Per-seed results kept in finals.parquet (and averaged into the metrics), in this order.
SCORES = ("acc", "trace", "len", "empty_set_rate")
FINALS = (*(f"initial_{k}" for k in SCORES), *(f"final_{k}" for k in SCORES),
          "steps", "rollouts")
# Wall times: averaged into the metrics only (each seed's own is in its MLflow run), never in
# finals.parquet, a DVC output that must be the same bytes for the same inputs.
TIMES = ("train_seconds",)


class Config(grpo.GRPOArm):
    family: Literal["arith"] = Field("arith", description="task family whose verifier gives "
                                                          "the reward (TRACE tags arith CoTs)")
    model: str = Field("policies", description="paths key of the policy folder")
    start: str = Field("d50_s200", description="condition (sub-folder) RL starts from")
    prompts: str = Field("corpus", description="paths key of train.parquet / test.parquet")
    tagger: str = Field("tagger", description="paths key of the tagger folder")
    tables: trace.Tables = Field(default_factory=trace.Tables)
    trace_weight: float = Field(0.5, ge=0, le=10, description="lambda [reconstructed: 0.5]; "
                                                              "0 = accuracy-only reward")
    gate_on_correct: bool = Field(False, description="TRACE term only on correct responses")
    eval_every: int | None = Field(None, ge=1, description="rounds between held-out "
                                   "evaluations (None: only before and after training)")


@dataclass(frozen=True)
class TraceReward:
    """The TRACE term of the reward, weight * TRACE(CoT) (times 1[correct] when gated); TRL adds
    it to the verifier's 0/1. The tagger is loaded once per run, when the engine binds it."""

    tagger_dir: Path
    tables: trace.Tables
    weight: float
    gate: bool = False

    def bind(self, model: Any, tokenizer: Any) -> grpo.RewardFunc:
        from stages.tasks import arith

        tagger = trace.ClassifierTagger.load(self.tagger_dir)
        tables, weight, gate = self.tables, self.weight, self.gate

        def trace_bonus(prompts: list[str], completions: list[str], answer: list[int],
                        **_: Any) -> list[float]:
            seqs = trace.tag_cots(tagger, [trace.cot_block(c) for c in completions])
            out = []
            for seq, c, a in zip(seqs, completions, answer):
                t = trace.trace_score(seq, tables)["trace"]
                if gate and not arith.verify_answer({"answer": a}, c):
                    t = 0.0
                out.append(weight * t)
            return out

        return trace_bonus


def evaluate(model: Any, tokenizer: Any, rows: list[dict[str, Any]], tagger_dir: Path,
             tables: trace.Tables, max_new_tokens: int, batch_size: int) -> dict[str, float]:
    """Greedy accuracy, mean TRACE, mean length and empty-set rate on `rows`."""
    from stages.models.generate import generate
    from stages.tasks import arith

    outs = [o[0] for o in generate(model, tokenizer, [r["prompt"] for r in rows],
                                   max_new_tokens=max_new_tokens, batch_size=batch_size)]
    tagger = trace.ClassifierTagger.load(tagger_dir)
    seqs = trace.tag_cots(tagger, [trace.cot_block(c) for c in outs])
    scores = [trace.trace_score(s, tables)["trace"] for s in seqs]
    n_sent = sum(len(s) for s in seqs)
    return {"acc": sum(arith.verify_answer(r, o) for r, o in zip(rows, outs)) / len(rows),
            "trace": sum(scores) / len(scores), "len": sum(map(len, outs)) / len(outs),
            "empty_set_rate": sum(1 for s in seqs for l in s if not l) / max(1, n_sent)}


@dataclass(frozen=True)
class TraceEvaluation:
    """The engine's evaluation hook: `evaluate` with this tagger and these tables."""

    tagger_dir: Path
    tables: trace.Tables
    max_new_tokens: int
    batch_size: int

    def __call__(self, model: Any, tokenizer: Any,
                 rows: list[dict[str, Any]]) -> dict[str, float]:
        return evaluate(model, tokenizer, rows, self.tagger_dir, self.tables,
                        self.max_new_tokens, self.batch_size)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.core.checks import read_parquet_checked
    from stages.tasks import arith

    method = cfg.method or ctx.stage
    prompts = ctx.path(cfg.prompts)
    train_rows = read_parquet_checked(prompts / "train.parquet",
                                      arith.expectations(None, "train")).to_dicts()
    eval_rows = read_parquet_checked(prompts / "test.parquet",
                                     arith.expectations(None, "test")).to_dicts()
    start = ctx.path(cfg.model) / cfg.start
    if not (start / "config.json").is_file():
        names = read_json_checked(ctx.path(cfg.model) / "conditions.json", kind=list)
        raise ValueError(f"{ctx.stage}.start = {cfg.start!r}: no such policy; conditions are "
                         f"{[c['condition'] for c in names]}")
    tagger_dir = ctx.path(cfg.tagger)
    rewards = ([TraceReward(tagger_dir, cfg.tables, cfg.trace_weight, cfg.gate_on_correct)]
               if cfg.trace_weight > 0 else [])
    evaluation = TraceEvaluation(tagger_dir, cfg.tables, cfg.max_completion_length,
                                 cfg.eval_batch_size)
    settings = cfg.model_dump(mode="json")
    out = ctx.path(cfg.out) / ctx.stage
    with io.atomic_path(out, is_dir=True) as tmp:
        results = grpo.train_seeds(
            cfg, start, cfg.family, train_rows, eval_rows, cfg.seeds, tmp, workers=cfg.workers,
            rewards=rewards, evaluate=evaluation,
            method_run=lambda seed: ctx.method_run("rl", method, seed, params=settings))
        rows = [{"method": method, "seed": seed,
                 **{k: results[seed]["metrics"][k] for k in FINALS}} for seed in cfg.seeds]
        io.write_parquet(tmp / "finals.parquet", pl.DataFrame(rows))
        io.write_json(tmp / "budget.json", {"method": method, "trace_weight": cfg.trace_weight,
                                            "tables": cfg.tables.version, **cfg.budget})
    if cfg.register_as and ctx.tracker is not None:
        first = out / f"seed{cfg.seeds[0]}"
        ctx.tracker.register_model(first, cfg.register_as, aliases=[method.replace("_", "-")],
                                   tags={"paperline.method": method,
                                         "paperline.seed": str(cfg.seeds[0])})
        ctx.tracker.annotate_model(first, {k: rows[0][k] for k in ("final_acc", "final_trace")})
    bad = [(r["seed"], k) for r in rows for k in FINALS if not math.isfinite(r[k])]
    if bad:
        raise ValueError(f"{ctx.stage}: NaN in the results of (seed, metric) {bad}")
    metrics: dict[str, float] = {}
    for key in FINALS:
        metrics[f"{key}_mean"], metrics[f"{key}_std"] = mean_std([r[key] for r in rows])
    for key in TIMES:
        metrics[f"{key}_mean"], metrics[f"{key}_std"] = mean_std(
            [results[seed]["metrics"][key] for seed in cfg.seeds])
    metrics["seeds"] = float(len(cfg.seeds))
    metrics["trace_weight"] = cfg.trace_weight
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the arm's final accuracy (`acc_mean`, `acc_std` over seeds) and TRACE
    (`trace_mean`): `final_*` in details/<arm>.json, with the rest."""
    return {new: metrics[old] for new, old in (("acc_mean", "final_acc_mean"),
                                               ("acc_std", "final_acc_std"),
                                               ("trace_mean", "final_trace_mean"))
            if old in metrics}
