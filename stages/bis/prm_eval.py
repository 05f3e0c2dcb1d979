"""Stage `evaluate` of the BIS pipeline: every trained PRM on the held-out process benchmark.

The benchmark is `<rollouts>/test.parquet`: sampled solutions to held-out problems whose GOLD
step labels come from the exact step verifier (not from MC estimates: the benchmark is clean,
like VisualProcessBench's human labels). Its problems are split in two (`prm.benchmark_split`):
the first part tunes ONE decision threshold per PRM (spec §4/§5: "one global threshold tuned on
a validation split"), the second part is reported:

- step F1: mean of the right-step and wrong-step F1 over all test steps pooled (micro over
  sources), at the tuned threshold;
- best-of-N: the PRM reranks each test problem's N sampled solutions (solution score = its
  weakest step, `aggregate`); accuracy of the chosen answers.

Reference points without a PRM, on the same test problems: `random` (expected accuracy of one
random solution = mean answer accuracy), `majority` (majority vote on the final answers, ties to
the first), `oracle` (pass@N: some solution is right).

    <out>/evaluation.parquet   arm, seed, f1, f1_right, f1_wrong, threshold, best_of_n
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core.checks import read_json_checked
from stages.core import io
from stages.train import prm


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: str = Field("arith", description="task family (answer extraction for majority vote)")
    prms: str = Field("prms", description="paths key of the trained PRMs (<arm>/seed<k>/)")
    benchmark: str = Field("rollouts", description="paths key whose test.parquet is the benchmark")
    val_share: float = Field(0.5, gt=0, lt=1, description="benchmark problems that tune the "
                                                          "threshold (same as train_prm)")
    aggregate: str = Field("min", pattern="^(min|prod|last)$",
                           description="solution score from step scores, for best-of-N")
    batch_size: int = Field(128, ge=1, le=65536, description="rollouts per scoring batch")
    out: str = Field("prm_eval", description="paths key of the output folder")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: default)")


def reference_selection(rows: list[dict[str, Any]], family: Any) -> dict[str, float]:
    """Best-of-N references without a PRM: random pick, majority vote, oracle (pass@N)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["problem_id"], []).append(r)
    rand, major, oracle = [], [], []
    for sols in groups.values():
        rand.append(sum(s["answer_correct"] for s in sols) / len(sols))
        oracle.append(float(any(s["answer_correct"] for s in sols)))
        answers = [family.extract_answer(s["completion"]) for s in sols]
        votes = Counter(a for a in answers if a is not None)
        pick = votes.most_common(1)[0][0] if votes else None
        major.append(float(pick is not None and pick == sols[0]["answer"]))
    n = len(groups)
    return {"random": sum(rand) / n, "majority": sum(major) / n, "oracle": sum(oracle) / n,
            "problems": float(n), "solutions_per_problem": len(rows) / n}


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.models import rollouts
    from stages.models.base import set_threads
    from stages.tasks import get_family

    bench = read_parquet_checked(ctx.path(cfg.benchmark) / "test.parquet",
                                 rollouts.expectations()).to_dicts()
    val_rows, test_rows = prm.benchmark_split(bench, cfg.val_share)
    folder = ctx.path(cfg.prms)
    models = sorted(p.parent for p in folder.glob("*/seed*/config.json"))
    if not models:
        raise FileNotFoundError(f"{folder}: no trained PRM (<arm>/seed<k>/config.json); run "
                                f"train_prm first")
    if cfg.num_threads:
        set_threads(cfg.num_threads)
    registered = folder / "registered.json"   # <arm>/seed<k> -> registered model name
    registered = read_json_checked(registered) if registered.is_file() else {}
    rows, metrics = [], {}
    for path in models:
        model, tokenizer = prm.load_prm(path)
        sep_id = getattr(model.config, "prm_separator_id", None)
        if sep_id is None:
            raise ValueError(f"{path}/config.json: no prm_separator_id; not a train_prm output")
        val = prm.evaluate_prm(model, tokenizer, val_rows, sep_id, None, cfg.aggregate,
                               cfg.batch_size)
        test = prm.evaluate_prm(model, tokenizer, test_rows, sep_id, val["threshold"],
                                cfg.aggregate, cfg.batch_size)
        arm, seed = path.parent.name, int(path.name.removeprefix("seed"))
        rows.append({"arm": arm, "seed": seed, "val_f1": val["f1"], **test})
        if f"{arm}/seed{seed}" in registered and ctx.tracker is not None:
            # the registered version carries its scores (tags `metric.<name>`)
            ctx.tracker.annotate_model(path, {"test_f1": test["f1"],
                                              "best_of_n": test["best_of_n"],
                                              "val_f1": val["f1"]})
    df = pl.DataFrame(rows)
    refs = reference_selection(test_rows, get_family(cfg.family))
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        io.write_parquet(tmp / "evaluation.parquet", df)
        io.write_json(tmp / "references.json", refs)
    for arm in df["arm"].unique(maintain_order=True).to_list():
        sub = df.filter(pl.col("arm") == arm)
        for key in ("f1", "best_of_n"):
            metrics[f"{arm}/{key}_mean"] = float(sub[key].mean())
    metrics |= {f"bon_{k}": v for k, v in refs.items()}
    metrics["test_steps"] = float(sum(len(r["steps"]) for r in test_rows))
    metrics["test_wrong_step_share"] = 1 - sum(t for r in test_rows for t in r["step_correct"]) \
        / metrics["test_steps"]
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the full-data PRM's test step F1 and best-of-N accuracy, and majority vote's
    best-of-N (the reference without a PRM); every subset in details/evaluate.json."""
    return {new: metrics[old] for new, old in (("full_f1", "full/f1_mean"),
                                               ("full_best_of_n", "full/best_of_n_mean"),
                                               ("bon_majority", "bon_majority")) if old in metrics}
