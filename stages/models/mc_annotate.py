"""Stage `mc_annotate`: Monte Carlo step labels for process reward data (Math-Shepherd style, as
used by VisualPRM400K and hence BIS).

For step j of a rollout, K continuations are sampled from the policy starting at the solution
prefix through step j; the step's MC score is the share that reach the right final answer:

    s_j = K_j / K            (K = 16 in the paper)
    y_j = 1[s_j > 0]         (the paper's hard label, tau = 0; BIS spec §2)

A step counts as "positive" as soon as ONE continuation recovers, so a right step followed by a
weak generator can still get s_j = 0 (a noisy negative), and a low s_j is an unreliable positive:
the two effects BIS's score balances. The exact verifier's `step_correct` stays beside the MC
label, so the label noise is measured, not assumed (metrics `label_*`).

Batched: every step prefix of every rollout is generated in one `generate` call with
`num_samples=K`. With `share_prefixes` (default) identical prefixes (same problem, same text so
far: common, since many samples agree on their first steps) are continued once and share their
K continuations [our choice, for speed: per-rollout annotation would draw fresh continuations
for each copy; the expected score is the same, only the noise across copies is shared].

    <out>/train.parquet   the rollouts of `<rollouts>/train.parquet` + mc_scores, mc_labels
"""

from __future__ import annotations

import time
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.models import rollouts as rollouts_stage

SCHEMA: dict[str, Any] = {**rollouts_stage.SCHEMA, "mc_scores": pl.List(pl.Float64),
                          "mc_labels": pl.List(pl.Boolean)}


def expectations() -> Any:
    """The annotated pool as its readers (select, train_prm) rely on it: a rollouts file plus one
    MC score in [0, 1] (never NaN) and one hard label per step."""
    from dataclasses import replace

    from stages.core.checks import ColumnSpec

    spec = rollouts_stage.expectations()
    return replace(spec, columns={
        **spec.columns,
        "mc_scores": ColumnSpec(dtype=pl.List(pl.Float64), min_len=1,
                                elements=ColumnSpec(dtype=pl.Float64, min=0.0, max=1.0)),
        "mc_labels": ColumnSpec(dtype=pl.List(pl.Boolean), min_len=1,
                                elements=ColumnSpec(dtype=pl.Boolean))})


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: str = Field("arith", description="task family (its answer verifier scores the "
                                             "continuations)")
    model: str = Field("base_model", description="paths key of the policy that continues")
    rollouts: str = Field("rollouts", description="paths key of the rollouts folder")
    out: str = Field("mc_labels", description="paths key of the output folder")
    k: int = Field(16, ge=1, le=4096, description="continuations per step prefix "
                                                  "(paper: N = 16)")
    temperature: float = Field(1.0, gt=0, le=10, description="continuation sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    max_new_tokens: int = Field(48, ge=1, le=32768, description="continuation budget, tokens")
    batch_size: int = Field(256, ge=1, le=65536, description="sequences generated together")
    share_prefixes: bool = Field(True, description="continue identical prefixes once "
                                                   "[our choice, see the module docstring]")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: default)")


def step_prefixes(rollouts: list[dict[str, Any]]) -> list[list[str]]:
    """For each rollout, the text each step's continuations start from: `prompt` followed by the
    completion through that step."""
    return [[r["prompt"] + r["completion"][:end] for end in r["step_ends"]] for r in rollouts]


def mc_score(successes: int, k: int) -> float:
    """s_j = K_j / K (BIS spec §2)."""
    if k < 1 or not 0 <= successes <= k:
        raise ValueError(f"need 0 <= successes <= k and k >= 1, got successes={successes}, k={k}")
    return successes / k


def label_noise(mc_labels: list[bool], true_labels: list[bool]) -> dict[str, float]:
    """How the MC hard labels disagree with the exact step verifier: the share of true-wrong steps
    labelled positive (false positives) and of true-right steps labelled negative (false
    negatives), and overall agreement."""
    if len(mc_labels) != len(true_labels) or not mc_labels:
        raise ValueError(f"need equal, non-empty label lists, got {len(mc_labels)} and "
                         f"{len(true_labels)}")
    pairs = list(zip(mc_labels, true_labels))
    wrong = [m for m, t in pairs if not t]
    right = [m for m, t in pairs if t]
    return {
        "label_agreement": sum(m == t for m, t in pairs) / len(pairs),
        "label_false_pos_rate": sum(wrong) / len(wrong) if wrong else 0.0,
        "label_false_neg_rate": sum(not m for m in right) / len(right) if right else 0.0,
        "true_wrong_share": len(wrong) / len(pairs),
    }


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.models.base import set_threads
    from stages.models.generate import generate, load_model
    from stages.tasks import get_family

    from stages.core.checks import read_parquet_checked

    family = get_family(cfg.family)
    df = read_parquet_checked(ctx.path(cfg.rollouts) / "train.parquet",
                              rollouts_stage.expectations())
    rollouts = df.to_dicts()
    prefixes = step_prefixes(rollouts)
    # Which prefix texts to continue: one per (problem, text) when shared, else one per step.
    keys = [[(r["problem_id"], p) if cfg.share_prefixes else (r["rollout_id"], j)
             for j, p in enumerate(ps)] for r, ps in zip(rollouts, prefixes)]
    unique: dict[Any, tuple[str, dict[str, Any], int]] = {}
    for r, ps, ks in zip(rollouts, prefixes, keys):
        for j, (p, key) in enumerate(zip(ps, ks)):
            unique.setdefault(key, (p, r, r["step_ends"][j]))
    order = list(unique)
    if cfg.num_threads:
        set_threads(cfg.num_threads)
    model, tokenizer = load_model(ctx.path(cfg.model))
    start = time.perf_counter()
    outs = generate(model, tokenizer, [unique[k][0] for k in order],
                    max_new_tokens=cfg.max_new_tokens, do_sample=True,
                    temperature=cfg.temperature, top_p=cfg.top_p, num_samples=cfg.k,
                    batch_size=cfg.batch_size, seed=ctx.seed)
    seconds = time.perf_counter() - start
    score: dict[Any, float] = {}
    for key, conts in zip(order, outs):
        _, row, end = unique[key]
        done = row["completion"][:end]
        wins = sum(family.verify_answer(row, done + c) for c in conts)
        score[key] = mc_score(wins, cfg.k)
    scores = [[score[k] for k in ks] for ks in keys]
    out = df.with_columns(
        pl.Series("mc_scores", scores, dtype=pl.List(pl.Float64)),
        pl.Series("mc_labels", [[s > 0 for s in ss] for ss in scores], dtype=pl.List(pl.Boolean)))
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        io.write_parquet(tmp / "train.parquet", out)
    flat_mc = [s > 0 for ss in scores for s in ss]
    flat_true = [bool(t) for r in rollouts for t in r["step_correct"]]
    n_pos = [sum(s > 0 for s in ss) for ss in scores]
    continuations = len(order) * cfg.k
    return {
        "rollouts": float(len(rollouts)), "steps": float(len(flat_mc)),
        "prefixes_continued": float(len(order)), "continuations": float(continuations),
        "seconds": seconds, "continuations_per_s": continuations / max(seconds, 1e-9),
        "mean_mc_score": sum(s for ss in scores for s in ss) / len(flat_mc),
        "negative_step_share": 1 - sum(flat_mc) / len(flat_mc),
        "mixed_rollout_share": sum(0 < p < len(ss) for p, ss in zip(n_pos, scores)) / len(scores),
        **label_noise(flat_mc, flat_true),
    }


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: agreement of the MC labels with the exact verifier and the share of steps
    labelled negative; the rest in details/mc_annotate.json."""
    return {k: metrics[k] for k in ("label_agreement", "negative_step_share") if k in metrics}
