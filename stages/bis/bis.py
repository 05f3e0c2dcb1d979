"""BIS, the Balanced-Information Score (Li et al., ICML 2026, arXiv 2602.04145): which Monte
Carlo-annotated rollouts a process reward model (PRM) should be trained on.

A rollout x has n steps with MC scores s_j = K_j / N (share of N continuations from the prefix
through step j that reach the right answer) and hard labels y_j = 1[s_j > 0]. The paper's
teacher-student analysis says a rollout gives informative gradients when

- its labels MIX positives and negatives: the expected squared gradient of a logistic model is
  q(1 - q)||phi||^2, estimated per rollout by p_pos (1 - p_pos); and
- its positive labels are RELIABLE: under label-flip noise eta the useful part shrinks by
  (1 - 4 eta), and a positive with few successful continuations (low s_j) is likely a flipped
  negative, so the mean MC score of the positives, R(x), measures reliability.

The two multiply (spec §2, exact, cross-checked against the official `build_bis_subset.py`):

    p_pos  = (1/n) sum_j y_j
    R(x)   = mean{ s_j : y_j = 1 }   if any positive, else 1.0   (an all-negative rollout is a
                                                                  noise-free negative)
    BIS(x) = (p_pos (1 - p_pos) + alpha) * R(x),        alpha = 0.05

alpha keeps unmixed rollouts (92% of the paper's corpus) in play, ranked by reliability.
Selection ranks rollouts WITHIN each source (the paper's 38 source files; here a difficulty
bucket) and keeps max(1, int(m * rho)) of a source's m rollouts: a global ranking would
over-sample the sources with more errors (spec §6).

The ablation rules of the paper's Table (same per-source keep counts): `mixed` (mixture term
only), `reliable` (R only), `low_mc` (lowest mean MC score first), `random` (a seeded uniform
draw per source: the same per-source sizes as every other rule [our choice: stratified]), `full`.

    python -m stages bis select        # reads <mc_labels>/train.parquet, writes <subsets>
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any, Callable, Literal, Sequence

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io

ALPHA = 0.05  # paper's default; 0.02 -> 64.84 and 0.08 -> 64.86 micro-F1 against 65.46 (InternVL)


# --- the score (pure) ------------------------------------------------------------------------------

def _check_scores(mc_scores: Sequence[float]) -> None:
    if len(mc_scores) == 0:
        raise ValueError("a rollout needs at least one step score")
    bad = [s for s in mc_scores if not 0.0 <= s <= 1.0]
    if bad:
        raise ValueError(f"MC scores must lie in [0, 1], got {bad[:3]}")


def positive_share(mc_scores: Sequence[float]) -> float:
    """p_pos = (1/n) sum_j 1[s_j > 0]."""
    _check_scores(mc_scores)
    return sum(s > 0 for s in mc_scores) / len(mc_scores)


def reliability(mc_scores: Sequence[float]) -> float:
    """R(x): mean MC score of the positive steps; 1.0 when there is none (spec §6: not 0)."""
    _check_scores(mc_scores)
    positives = [s for s in mc_scores if s > 0]
    return sum(positives) / len(positives) if positives else 1.0


def mixture(mc_scores: Sequence[float]) -> float:
    """p_pos (1 - p_pos): 0 for an unmixed rollout, 1/4 at an even mix."""
    p = positive_share(mc_scores)
    return p * (1.0 - p)


def bis_score(mc_scores: Sequence[float], alpha: float = ALPHA) -> float:
    """BIS(x) = (p_pos (1 - p_pos) + alpha) * R(x)."""
    if alpha < 0:
        raise ValueError(f"alpha = {alpha}: must be >= 0")
    return (mixture(mc_scores) + alpha) * reliability(mc_scores)


def low_mc_score(mc_scores: Sequence[float]) -> float:
    """The Low-MC heuristic ranks rollouts with LOW mean MC score first: score = -mean(s)."""
    _check_scores(mc_scores)
    return -sum(mc_scores) / len(mc_scores)


RULES: dict[str, Callable[..., float]] = {
    "bis": bis_score,
    "mixed": mixture,
    "reliable": reliability,
    "low_mc": low_mc_score,
}


# --- selection (pure) ------------------------------------------------------------------------------

def keep_count(m: int, rho: float) -> int:
    """max(1, int(m * rho)) rollouts of a source with m rollouts (the official code's count)."""
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho = {rho}: the kept share must lie in (0, 1]")
    if m < 1:
        raise ValueError(f"a source needs at least one rollout, got m = {m}")
    return max(1, int(m * rho))


def top_per_source(scores: Sequence[float], sources: Sequence[str], rho: float) -> list[int]:
    """Indices kept: within each source, the `keep_count` highest scores. Ties keep data order
    (a stable sort), so the result is deterministic. Returned in data order."""
    if len(scores) != len(sources):
        raise ValueError(f"{len(scores)} scores for {len(sources)} sources")
    if not scores:
        raise ValueError("nothing to select from: the pool is empty")
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, src in enumerate(sources):
        by_source[src].append(i)
    kept: list[int] = []
    for idx in by_source.values():
        ranked = sorted(idx, key=lambda i: -scores[i])  # sorted() is stable
        kept += ranked[:keep_count(len(idx), rho)]
    return sorted(kept)


def random_per_source(sources: Sequence[str], rho: float, seed: int) -> list[int]:
    """A uniform draw of `keep_count` rollouts per source (seeded; same sizes as the rules)."""
    if not sources:
        raise ValueError("nothing to select from: the pool is empty")
    rng = random.Random(f"bis-random:{seed}")
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, src in enumerate(sources):
        by_source[src].append(i)
    kept: list[int] = []
    for src in sorted(by_source):
        idx = by_source[src]
        kept += rng.sample(idx, keep_count(len(idx), rho))
    return sorted(kept)


def select(rule: str, mc_scores: Sequence[Sequence[float]], sources: Sequence[str], rho: float,
           *, alpha: float = ALPHA, seed: int = 0) -> list[int]:
    """Indices of the rollouts an arm keeps. `rule`: full | random | bis | mixed | reliable |
    low_mc."""
    if rule == "full":
        if rho != 1.0:
            raise ValueError(f"rho = {rho} with rule 'full': the full arm keeps every rollout, so "
                             "its rho must be 1 (use rule 'random' to keep a share)")
        if not mc_scores:
            raise ValueError("nothing to select from: the pool is empty")
        return list(range(len(mc_scores)))
    if rule == "random":
        return random_per_source(sources, rho, seed)
    if rule not in RULES:
        raise ValueError(f"unknown selection rule {rule!r}: expected full, random, "
                         f"{', '.join(RULES)}")
    fn = RULES[rule]
    scores = [fn(s, alpha) if rule == "bis" else fn(s) for s in mc_scores]
    return top_per_source(scores, sources, rho)


# --- stage `select` --------------------------------------------------------------------------------

class Arm(BaseModel):
    """One training subset: a rule at a kept share."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[a-z0-9_]+$", description="arm name in tables and MLflow")
    rule: Literal["full", "random", "bis", "mixed", "reliable", "low_mc"]
    rho: float = Field(1.0, gt=0, le=1, description="kept share per source (rule full: must be "
                       "1, it keeps every rollout)")
    alpha: float = Field(ALPHA, ge=0, le=10, description="BIS floor term (rule bis only)")

    @model_validator(mode="after")
    def _full_keeps_everything(self) -> "Arm":
        if self.rule == "full" and self.rho != 1.0:
            raise ValueError(f"arm {self.name!r}: rule 'full' keeps every rollout, so rho must "
                             f"be 1 (or unset), not {self.rho} (use rule 'random' for a share)")
        return self


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mc_labels: str = Field("mc_labels", description="paths key of the MC-annotated rollouts")
    out: str = Field("subsets", description="paths key of the output folder")
    arms: list[Arm] = Field(..., min_length=1, description="the subsets to build")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1,
                             description="training seeds; a random arm draws a new subset per "
                                         "seed, deterministic rules repeat theirs")

    @model_validator(mode="after")
    def _unique(self) -> "Config":
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names repeat: {names}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeat a value")
        return self


def subset_stats(rows: list[dict[str, Any]]) -> dict[str, float]:
    """What an arm's subset holds: rollouts, steps, the share of negative steps and of mixed
    rollouts (by MC label), the mean MC score, and the share of steps the MC label gets wrong."""
    labels = [lab for r in rows for lab in r["mc_labels"]]
    truth = [t for r in rows for t in r["step_correct"]]
    mixed = [0 < sum(r["mc_labels"]) < len(r["mc_labels"]) for r in rows]
    return {"rollouts": float(len(rows)), "steps": float(len(labels)),
            "negative_share": 1 - sum(labels) / len(labels),
            "mixed_share": sum(mixed) / len(rows),
            "mean_mc": sum(s for r in rows for s in r["mc_scores"]) / len(labels),
            "label_error": sum(a != b for a, b in zip(labels, truth)) / len(labels)}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.models import mc_annotate

    rows = read_parquet_checked(ctx.path(cfg.mc_labels) / "train.parquet",
                                mc_annotate.expectations()).to_dicts()
    scores = [r["mc_scores"] for r in rows]
    sources = [r["source"] for r in rows]
    table, metrics = [], {}
    for arm in cfg.arms:
        for seed in cfg.seeds:
            kept = select(arm.rule, scores, sources, arm.rho, alpha=arm.alpha, seed=seed)
            table += [{"arm": arm.name, "seed": seed, "rollout_id": rows[i]["rollout_id"]}
                      for i in kept]
            if seed == cfg.seeds[0]:
                for key, value in subset_stats([rows[i] for i in kept]).items():
                    metrics[f"{arm.name}/{key}"] = value
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        io.write_parquet(tmp / "subsets.parquet", pl.DataFrame(
            table, schema={"arm": pl.String, "seed": pl.Int64, "rollout_id": pl.String}))
        io.write_json(tmp / "arms.json", [a.model_dump() for a in cfg.arms])
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: how many subsets were selected (`arms`); each subset's composition in
    details/select.json."""
    return {"arms": float(len({k.split("/")[0] for k in metrics if k.endswith("/steps")}))}
