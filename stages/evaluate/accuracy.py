"""Stage `evaluate`: greedy accuracy and pass@k by difficulty on a task family's test split.

For every test prompt the model decodes one greedy completion and, when `num_samples > 0`,
n sampled ones (temperature, top-p). Each completion is checked by the family's exact
verifier (`get_family(family).verify_answer(row, completion)`), and pass@k is the unbiased
estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code", eq. 1)
from the n samples, averaged over prompts:

    pass@k = E_prompts[ 1 - C(n - c, k) / C(n, k) ]      (c = correct samples out of n)

Outputs: flat metrics (`greedy_acc`, `greedy_acc_d2`, `pass@4`, `pass@4_d3`, ...), every
completion with its verdict (`paths.<samples_path>`, parquet) and a per-difficulty table for
`dvc plots show` (`paths.<plot_path>`, CSV). The model and outputs are named by their `paths:`
keys, so a paper's pipeline reuses this stage on its own policy.

    python -m stages base evaluate
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: str = Field("arith", description="task family (its module holds the verifier)")
    split: str = Field("test", description="split to evaluate on")
    model: str = Field("base_model", description="paths key of the save_pretrained model folder")
    samples_path: str = Field("eval_samples", description="paths key of the completions parquet")
    plot_path: str = Field("eval_plot", description="paths key of the per-difficulty plot CSV")
    max_rows: int | None = Field(60, ge=1, description="evaluate only the first N rows")
    max_new_tokens: int = Field(64, ge=1, le=4096, description="generation budget, tokens")
    batch_size: int = Field(256, ge=1, le=8192, description="sequences decoded together")
    num_samples: int = Field(8, ge=0, le=1024,
                             description="n sampled completions per prompt for pass@k (0: none)")
    temperature: float = Field(0.8, gt=0, le=10, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    pass_k: list[int] = Field(default_factory=lambda: [1, 4],
                              description="k values of pass@k (each <= num_samples)")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        too_big = [k for k in self.pass_k if k < 1 or k > self.num_samples]
        if self.num_samples and too_big:
            raise ValueError(f"pass_k {too_big}: each k must be in 1..num_samples "
                             f"({self.num_samples})")
        return self


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # Product form of the binomial ratio: stable for large n (Chen et al. 2021, fig. 3).
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def score(rows: list[dict[str, Any]], completions: list[list[str]],
          verify: Callable[[dict[str, Any], str], bool]) -> list[list[bool]]:
    """Verdict of the family's verifier for every completion of every row."""
    return [[bool(verify(row, text)) for text in texts] for row, texts in zip(rows, completions)]


def summarise(difficulty: list[int], greedy: list[bool], sampled: list[list[bool]] | None,
              pass_k: list[int]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Flat metrics (overall and `_d<difficulty>`) and one plot row per difficulty (+ 'all')."""
    groups: dict[str, list[int]] = {"all": list(range(len(greedy)))}
    for i, d in enumerate(difficulty):
        groups.setdefault(str(d), []).append(i)
    metrics: dict[str, float] = {}
    plot = []
    for name in sorted(groups, key=lambda g: (g == "all", int(g) if g != "all" else 0)):
        idx = groups[name]
        suffix = "" if name == "all" else f"_d{name}"
        row: dict[str, Any] = {"difficulty": name, "n": len(idx),
                               "greedy_acc": mean([float(greedy[i]) for i in idx])}
        metrics[f"greedy_acc{suffix}"] = row["greedy_acc"]
        if sampled is not None:
            for k in pass_k:
                val = mean([pass_at_k(len(sampled[i]), sum(sampled[i]), k) for i in idx])
                metrics[f"pass@{k}{suffix}"] = val
                row[f"pass_at_{k}"] = val
        plot.append(row)
    return metrics, plot


def _as_text(value: Any) -> str | None:
    return None if value is None else str(value)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    from stages.models.base import set_threads
    from stages.tasks import load_split
    from stages.models.generate import generate, load_model
    from stages.tasks import get_family

    set_threads(0)
    family = get_family(cfg.family)
    df = load_split(ctx.path("tasks"), cfg.family, cfg.split)  # validated at the boundary
    if cfg.max_rows:
        df = df.head(cfg.max_rows)
    rows = df.to_dicts()
    prompts = [r["prompt"] for r in rows]
    model, tokenizer = load_model(ctx.path(cfg.model))

    started = time.perf_counter()
    greedy_text = [t[0] for t in generate(model, tokenizer, prompts,
                                          max_new_tokens=cfg.max_new_tokens, do_sample=False,
                                          batch_size=cfg.batch_size, seed=ctx.seed)]
    greedy_ok = [ok[0] for ok in score(rows, [[t] for t in greedy_text], family.verify_answer)]
    print(f"evaluate: greedy accuracy {mean([float(g) for g in greedy_ok]):.3f} "
          f"on {len(rows)} {cfg.family}/{cfg.split} prompts")
    sampled_text = sampled_ok = None
    if cfg.num_samples:
        sampled_text = generate(model, tokenizer, prompts, max_new_tokens=cfg.max_new_tokens,
                                do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p,
                                num_samples=cfg.num_samples, batch_size=cfg.batch_size,
                                seed=ctx.seed)
        sampled_ok = score(rows, sampled_text, family.verify_answer)
    seconds = time.perf_counter() - started

    difficulty = [int(r["difficulty"]) for r in rows]
    metrics, plot = summarise(difficulty, greedy_ok, sampled_ok, cfg.pass_k)
    metrics["greedy_format_rate"] = mean([float("####" in t) for t in greedy_text])
    metrics["eval_seconds"] = seconds

    records = []
    for i, r in enumerate(rows):
        texts = [greedy_text[i]] + (sampled_text[i] if sampled_text else [])
        oks = [greedy_ok[i]] + (sampled_ok[i] if sampled_ok else [])
        for j, (text, ok) in enumerate(zip(texts, oks)):
            records.append({"id": r["id"], "difficulty": difficulty[i],
                            "mode": "greedy" if j == 0 else "sample", "sample": max(j - 1, 0),
                            "prompt": r["prompt"], "answer": str(r["answer"]),
                            "completion": text,
                            "prediction": _as_text(family.extract_answer(text)),
                            "correct": ok})
    samples = pl.DataFrame(records, schema_overrides={"prediction": pl.Utf8})
    io.write_parquet(ctx.path(cfg.samples_path), samples)
    with io.atomic_path(ctx.path(cfg.plot_path)) as tmp:
        pl.DataFrame(plot).write_csv(tmp)
    if ctx.tracker is not None:
        ctx.tracker.annotate_model(ctx.path(cfg.model), metrics)
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: accuracy over the whole split (greedy, pass@k) and the format rate; the same
    per difficulty (`*_d<n>`) stay in details/evaluate.json."""
    return {k: v for k, v in metrics.items() if not re.search(r"_d\d+$", k)}
