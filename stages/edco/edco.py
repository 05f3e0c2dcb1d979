"""EDCO: Entropy-based Dynamic Curriculum Orchestration (Pang et al., ICML 2026, arXiv 2601.03725).

The method in three lines:
    every round, the CURRENT model answers every pool prompt once (sampled, T=0.7, top_p=0.7);
    a prompt's score is its inference entropy: per generated token the entropy (bits) of the
    top-20 log-probs renormalised, aggregated by the mean of the top 20% tokens; the model then
    trains one pass on the N highest-scoring samples (SFT) or runs GRPO on those prompts (RL).

Estimator exactly as the official code (`data_selection_by_entropy.py`, spec §2 [code]):
    p_t(v)  = softmax over the top-20 logits at position t            (vLLM `logprobs=20`)
    H_t     = -sum_v p_t(v) log2 p_t(v)                               bits, <= log2 20 = 4.32
    score   = mean of the k largest H_t, k = max(1, int(0.2 * T))     T = generated tokens
    prefix  = only the first L generated tokens are sampled and scored (the code: max_tokens=128)
    select  = sort the whole pool by score, keep the first N (no de-duplication across rounds)

Departures (all parameters, listed in pipelines/edco/README.md):
- Quick-Answer Prompting: the tiny model follows no instruction, so the QAP prefix is a param
  (`qap_prefix`, default empty): here the estimator scores the plain prompt.
- Which log-probs: `logits: raw` (default) takes the model's own distribution, as vLLM V1 returns
  by default; `processed` takes it after temperature and top-p (vLLM V0's sampler) [reconstructed].
- Ties (e.g. every score equal): the earlier pool row wins, so a selection is deterministic.
- Scores are sampled, hence noisy (spec pitfall): each round scores with a fixed seed.

This module holds the estimator (pure math + the sampling pass), the selection and the static
orderings the baselines use, and the stage `entropy_estimate`: prefix vs full-response estimate
on the pool under the base model (Spearman rho; cost as tokens decoded, the deterministic
measure of the paper's "83.5% less time", in the tracked metrics; the wall-time reduction of
this machine in MLflow only).

    python -m stages edco entropy_estimate            # one stage; sizes from the active profile
    dvc repro pipelines/edco/dvc.yaml                  # the whole pipeline (then README table)
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io
from stages.core.stats import spearman


class EstimatorParams(BaseModel):
    """How a prompt's inference entropy is estimated (shared by every stage that scores)."""

    model_config = ConfigDict(extra="forbid")

    prefix_tokens: int = Field(16, ge=1, le=32768, description="L: generated tokens scored "
                                                              "(the code: max_tokens = 128)")
    top_logprobs: int = Field(20, ge=1, le=1000, description="top-k log-probs renormalised per "
                                                             "position (the code: logprobs=20)")
    aggregate: Literal["top_frac", "mean"] = Field(
        "top_frac", description="top_frac: mean of the largest top_frac share of per-token "
                                "entropies (the code); mean: all tokens (the paper's text)")
    top_frac: float = Field(0.2, gt=0, le=1, description="share of tokens kept by top_frac, "
                                                         "k = max(1, int(top_frac * T))")
    temperature: float = Field(0.7, gt=0, le=10, description="sampling temperature of the "
                                                             "scoring answer (the code: 0.7)")
    top_p: float = Field(0.7, gt=0, le=1, description="nucleus of the scoring answer (0.7)")
    logits: Literal["raw", "processed"] = Field(
        "raw", description="entropy of the model's raw distribution, or after temperature and "
                           "top-p (vLLM V0)")
    qap_prefix: str = Field("", max_length=1000, description="Quick-Answer-Prompting text put "
                            "before every prompt (the code: a 'answer briefly' instruction; "
                            "empty here: the tiny model follows no instruction)")
    batch_size: int = Field(256, ge=1, le=65536, description="prompts sampled together")


# --- the estimator: pure math ------------------------------------------------------------------

def topk_entropy_bits(logits: Any, k: int = 20) -> Any:
    """Entropy in bits of the softmax over the k largest logits of the last dimension.

    logits (..., V) -> (..., ). Entries of -inf (masked by top-p) get probability 0 and add 0.
    With V <= k every logit is kept (the plain entropy of the distribution).
    """
    import torch

    k = min(k, logits.shape[-1])
    top = torch.topk(logits.float(), k, dim=-1).values               # (..., k)
    logp = torch.log_softmax(top, dim=-1)                             # renormalised over top-k
    p = logp.exp()
    terms = torch.where(p > 0, p * logp, torch.zeros_like(p))         # 0 log 0 = 0
    return -terms.sum(-1) / math.log(2.0)


def aggregate_entropy(entropies: Sequence[float], how: str = "top_frac",
                      frac: float = 0.2) -> float:
    """One score from per-token entropies: the mean of the k = max(1, int(frac*T)) largest
    (`top_frac`, the code) or the mean of all (`mean`). No token is an error."""
    values = [float(h) for h in entropies]
    if not values:
        raise ValueError("aggregate_entropy: no generated token to score")
    if how == "mean":
        return sum(values) / len(values)
    if how != "top_frac":
        raise ValueError(f"aggregate = {how!r}: expected 'top_frac' or 'mean'")
    k = max(1, int(frac * len(values)))
    return sum(sorted(values, reverse=True)[:k]) / k


def valid_token_mask(token_ids: Any, eos_id: int) -> Any:
    """(B, T) bool: positions up to and including each row's first <eos> (the answer's tokens;
    what `generate` adds after a row finished is padding)."""
    import torch

    is_eos = token_ids == eos_id
    finished_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return finished_before == 0


# --- selection and the static orderings of the baselines (pure) --------------------------------

def select_top_n(scores: Sequence[float], n: int) -> list[int]:
    """Indices of the n highest scores, highest first; ties go to the earlier index.

    The code sorts the whole pool and keeps the first N. An empty pool, n < 1, n larger than
    the pool or a non-finite score is an error (a curriculum of fewer than N rows would break
    the equal-budget comparison silently).
    """
    if len(scores) == 0:
        raise ValueError("select_top_n: the pool is empty")
    if n < 1 or n > len(scores):
        raise ValueError(f"select_top_n: N = {n} but the pool has {len(scores)} rows "
                         f"(expected 1 <= N <= pool size)")
    bad = [i for i, s in enumerate(scores) if not math.isfinite(float(s))]
    if bad:
        raise ValueError(f"select_top_n: non-finite score at rows {bad[:5]}")
    return sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:n]


def easy_to_hard_order(difficulty: Sequence[int], seed: int) -> list[int]:
    """Pool indices by ascending difficulty, a seeded random order within each level."""
    rng = random.Random(f"easy_to_hard:{seed}")
    key = [rng.random() for _ in difficulty]
    return sorted(range(len(difficulty)), key=lambda i: (difficulty[i], key[i]))


def score_order(scores: Sequence[float], ascending: bool = True) -> list[int]:
    """Pool indices sorted by a static score (e.g. base-model perplexity); ties by index."""
    sign = 1.0 if ascending else -1.0
    return sorted(range(len(scores)), key=lambda i: (sign * float(scores[i]), i))


def random_order(size: int, epochs: int, seed: int) -> list[int]:
    """`epochs` concatenated seeded permutations of range(size) (a fresh shuffle per epoch)."""
    rng = random.Random(f"random:{seed}")
    out: list[int] = []
    for _ in range(epochs):
        perm = list(range(size))
        rng.shuffle(perm)
        out += perm
    return out


def tile_schedule(order: Sequence[int], n: int, rounds: int) -> list[list[int]]:
    """A static curriculum at EDCO's budget: walk `order` (repeated as needed) and cut the first
    rounds * n entries into `rounds` chunks of n, one chunk trained per round."""
    if not order:
        raise ValueError("tile_schedule: empty order (empty pool)")
    if n < 1 or rounds < 1:
        raise ValueError(f"tile_schedule: N = {n}, rounds = {rounds}: both must be >= 1")
    reps = math.ceil(n * rounds / len(order))
    flat = list(order) * reps
    return [flat[r * n:(r + 1) * n] for r in range(rounds)]


def budget_n(pool_size: int, rounds: int, epochs: float) -> int:
    """N per round from the code's rule N = pool * epochs / R (Qwen3-4B SFT: 7000 * 2 / 8)."""
    return int(pool_size * epochs / rounds)


# --- the estimator on a model ------------------------------------------------------------------

def sample_entropies(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int,
                     params: EstimatorParams, seed: int = 0
                     ) -> tuple[list[list[float]], list[str]]:
    """Sample one answer per prompt (<= max_new_tokens tokens) and return, per prompt, the
    entropy in bits of every generated token (up to and including <eos>) and the answer text.

    Prompts are sorted by length and decoded `params.batch_size` at a time with the KV cache;
    sampling is reproducible for a given seed, batch size and prompt list, and the answer's first
    L tokens do not depend on `max_new_tokens` (the global RNG is left alone).
    """
    import torch

    prompts = [params.qap_prefix + p for p in prompts]
    if not prompts:
        return [], []
    was_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = tokenizer(prompts)["input_ids"]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    entropies: list[list[float]] = [[] for _ in prompts]
    texts: list[str] = ["" for _ in prompts]
    device = next(model.parameters()).device
    model.eval()
    try:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            for start in range(0, len(order), params.batch_size):
                # A seed per batch: the RNG a batch consumes does not depend on how long the
                # batches before it ran, so a prefix of L tokens is exactly the first L tokens
                # of the answer a longer pass samples (same seed and batch size).
                torch.manual_seed(seed * 1_000_003 + start)
                idx = order[start:start + params.batch_size]
                batch = tokenizer.pad({"input_ids": [encoded[i] for i in idx]},
                                      return_tensors="pt").to(device)
                with torch.inference_mode():
                    out = model.generate(
                        **batch, max_new_tokens=max_new_tokens, do_sample=True,
                        temperature=params.temperature, top_p=params.top_p, top_k=0,
                        pad_token_id=pad, eos_token_id=eos, use_cache=True,
                        return_dict_in_generate=True, output_logits=params.logits == "raw",
                        output_scores=params.logits == "processed")
                steps = out.logits if params.logits == "raw" else out.scores
                new = out.sequences[:, batch["input_ids"].shape[1]:]          # (B, T)
                h = topk_entropy_bits(torch.stack(steps, dim=1), params.top_logprobs)  # (B, T)
                mask = valid_token_mask(new, eos)
                decoded = tokenizer.batch_decode(new, skip_special_tokens=True)
                for j, i in enumerate(idx):
                    entropies[i] = h[j][mask[j]].tolist()
                    texts[i] = decoded[j]
    finally:
        tokenizer.padding_side = was_side
    return entropies, texts


def prompt_entropy(model: Any, tokenizer: Any, prompts: Sequence[str], params: EstimatorParams,
                   seed: int = 0, max_new_tokens: int | None = None) -> list[float]:
    """EDCO's score of each prompt: the aggregated entropy of a sampled answer's first L tokens
    (L = params.prefix_tokens unless `max_new_tokens` is given)."""
    per_token, _ = sample_entropies(model, tokenizer, prompts, params=params, seed=seed,
                                    max_new_tokens=max_new_tokens or params.prefix_tokens)
    return [aggregate_entropy(h, params.aggregate, params.top_frac) for h in per_token]


def target_nll(model: Any, tokenizer: Any, prompts: Sequence[str], targets: Sequence[str],
               batch_size: int = 128) -> list[float]:
    """Mean per-token negative log-likelihood (nats) of each target (+ <eos>) after its prompt:
    log-perplexity for the static PPL order and the dynamic loss baseline."""
    import torch

    from stages.models.base import CompletionCollator, encode_sft_rows

    max_len = getattr(model.config, "max_position_embeddings", 256)
    rows = encode_sft_rows(tokenizer, list(prompts), list(targets), max_len)
    collate = CompletionCollator(tokenizer.pad_token_id)
    out: list[float] = []
    model.eval()
    with torch.inference_mode():
        for i in range(0, len(rows), batch_size):
            batch = {k: v.to(model.device) for k, v in collate(rows[i:i + batch_size]).items()}
            logits = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits[:, :-1].float()
            labels = batch["labels"][:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels,
                                                    ignore_index=-100, reduction="none")
            count = (labels != -100).sum(1).clamp(min=1)
            out += (nll.sum(1) / count).tolist()
    return out


# --- the stage `entropy_estimate`: prefix vs full-response estimate ----------------------------

class Config(BaseModel):
    """Prefix estimator vs the full-response estimate on the pool, under the base model."""

    model_config = ConfigDict(extra="forbid")

    estimator: EstimatorParams = Field(default_factory=EstimatorParams)
    prefix_lengths: list[int] = Field([2, 4, 8, 16], min_length=1,
                                      description="prefix lengths L compared with the full answer")
    full_max_tokens: int = Field(64, ge=1, le=32768, description="generation cap of the full "
                                 "answer (longest arith answer here: ~60 tokens)")
    n_items: int | None = Field(1000, ge=2, description="pool rows scored (None: all; spec: 1k)")
    family: Literal["arith"] = Field("arith", description="task family of the pool")
    model: str = Field("base_model", description="paths key of the model folder")
    pool: str = Field("edco_pool", description="paths key of the pool folder (pool.parquet)")
    out: str = Field("estimator", description="paths key of the output folder")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: all cores)")

    @field_validator("prefix_lengths")
    @classmethod
    def _sorted_unique(cls, value: list[int]) -> list[int]:
        if any(v < 1 for v in value) or len(set(value)) != len(value):
            raise ValueError(f"prefix_lengths {value}: expected distinct lengths >= 1")
        return sorted(value)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.models.base import set_threads
    from stages.models.generate import load_model
    from stages.tasks import get_family
    from stages.edco.pool import read_pool

    set_threads(cfg.num_threads)
    pool = read_pool(ctx.path(cfg.pool) / "pool.parquet")
    if cfg.n_items:
        pool = pool.head(cfg.n_items)
    rows = pool.to_dicts()
    prompts = [r["prompt"] for r in rows]
    model, tokenizer = load_model(ctx.path(cfg.model))
    est = cfg.estimator
    fam = get_family(cfg.family)
    # Warm-up (first-call overheads) so neither timed pass pays them.
    sample_entropies(model, tokenizer, prompts[:est.batch_size], max_new_tokens=4, params=est)

    started = time.perf_counter()
    full_h, full_text = sample_entropies(model, tokenizer, prompts, params=est, seed=ctx.seed,
                                         max_new_tokens=cfg.full_max_tokens)
    full_seconds = time.perf_counter() - started
    frame: dict[str, Any] = {"id": pool["id"], "difficulty": pool["difficulty"],
                             "noisy": pool["noisy"],
                             "has_mul": [("*" in r["question"]) for r in rows],
                             "full_tokens": [len(h) for h in full_h],
                             "full_correct": [fam.verify_answer({"answer": r["clean_answer"]}, t)
                                              for r, t in zip(rows, full_text)]}
    full_tokens = sum(map(len, full_h))
    metrics: dict[str, float] = {"items": float(len(rows)),
                                 "full_mean_tokens": full_tokens / len(full_h)}
    # The estimator's cost: tokens decoded (deterministic, the same on every machine) in the
    # tracked metrics; wall time per item and its reduction, measurements of this machine, in
    # MLflow only (quiet-machine timings: benchmarks/edco_estimator.py).
    timings = {"full_seconds_per_item": full_seconds / len(rows)}
    for how in ("top_frac", "mean"):
        frame[f"full_{how}"] = [aggregate_entropy(h, how, est.top_frac) for h in full_h]
    for L in cfg.prefix_lengths:
        started = time.perf_counter()
        pre_h, _ = sample_entropies(model, tokenizer, prompts, params=est, seed=ctx.seed,
                                    max_new_tokens=L)
        seconds = time.perf_counter() - started
        timings[f"L{L}/seconds_per_item"] = seconds / len(rows)
        timings[f"L{L}/time_reduction"] = 1.0 - seconds / full_seconds
        pre_tokens = sum(map(len, pre_h))
        metrics[f"L{L}/mean_tokens"] = pre_tokens / len(pre_h)
        metrics[f"L{L}/token_reduction"] = 1.0 - pre_tokens / max(full_tokens, 1)
        for how in ("top_frac", "mean"):
            frame[f"L{L}_{how}"] = [aggregate_entropy(h, how, est.top_frac) for h in pre_h]
            key = "spearman" if how == est.aggregate else f"spearman_{how}"
            metrics[f"L{L}/{key}"] = spearman(frame[f"L{L}_{how}"], frame[f"full_{how}"])
        ctx.log_metrics({"spearman": metrics[f"L{L}/spearman"],
                         "token_reduction": metrics[f"L{L}/token_reduction"],
                         "time_reduction": timings[f"L{L}/time_reduction"]}, step=L)
    ctx.log_metrics(timings)
    df = pl.DataFrame(frame)
    # What the full-answer entropy says about the pool: error, new operator, noise.
    full = df[f"full_{est.aggregate}"]
    metrics["spearman_full_vs_difficulty"] = spearman(full.to_list(),
                                                      df["difficulty"].cast(float).to_list())
    for name, col in (("wrong", ~df["full_correct"]), ("mul", df["has_mul"]),
                      ("noisy", df["noisy"])):
        inside, outside = full.filter(col), full.filter(~col)
        if len(inside) and len(outside):
            metrics[f"entropy_{name}_minus_rest"] = float(inside.mean() - outside.mean())
    metrics["full_sample_acc"] = float(df["full_correct"].mean())
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        io.write_parquet(tmp / "scores.parquet", df)
        io.write_json(tmp / "summary.json", {**metrics, "aggregate": est.aggregate,
                                             "prefix_lengths": cfg.prefix_lengths,
                                             "full_max_tokens": cfg.full_max_tokens})
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the prefix estimator's rank agreement with the full answer at each prefix
    length (`L<n>/spearman`); tokens, the other aggregation and the pool's entropy differences
    in details/entropy_estimate.json, wall times in MLflow."""
    return {k: v for k, v in metrics.items() if k.startswith("L") and k.endswith("/spearman")}
