"""Stage `train_judge` of ProofVerify: a tiny judge and a tiny GenSelect selector, fine-tuned from
the base model on labelled candidates (the spec's "learned mode", §4).

- Judge: `judge_prompt(problem, solution)` -> ` Yes` (the solution is valid: every step and the
  answer right) or ` No`, then <eos>. Loss on the verdict only (completion-only SFT, the base
  model's own trainer `stages.models.base.train`). Classes are balanced by down-sampling the
  larger one (`balance`), since valid solutions outnumber the rest.
- Selector: `genselect_prompt(problem, a, b)` -> ` 1` or ` 2`, the valid one of a pair whose
  validity differs (the only pairs with a right answer); which position holds the valid one is a
  coin flip per pair, so the selector cannot learn a position bias from the data.

Both are saved with `save_pretrained` and read back through the LLM backend (`backend.py`) like
any Hugging Face model; the judge is registered as `proofverify-judge`, the selector as
`proofverify-selector`. At the `gpu` profile the paper prompts real models instead
(`train: false`): this stage then writes only a note, and the judge / genselect stages point
their `backend` at the served model. RL on the judge (the paper's prompt-sensitivity result) is
not implemented here.

    python -m stages proofverify train_judge
"""

from __future__ import annotations

import random
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.proofverify import proofverify as pv


class Recipe(BaseModel):
    """SFT settings of one fine-tuned verifier (AdamW, cosine to `min_lr_ratio`)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(300, ge=1, le=1_000_000, description="optimizer steps")
    batch_size: int = Field(32, ge=1, le=4096, description="sequences per step")
    lr: float = Field(5e-4, gt=0, le=1, description="peak learning rate")
    warmup: float = Field(0.05, ge=0, lt=1, description="linear warmup, fraction of steps")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train: bool = Field(True, description="fine-tune the tiny verifiers; false: the judge and "
                        "selector are prompted served models (gpu profile), nothing is trained")
    base_model: str = Field("base_model", description="paths key of the model fine-tuned")
    candidates: str = Field("candidates", description="paths key of the candidates folder")
    judge_out: str = Field("judge_model", description="paths key of the judge folder")
    selector_out: str = Field("selector_model", description="paths key of the selector folder")
    prompt_style: pv.PromptStyle = Field("compact", description="judge/selector prompt format")
    judge: Recipe = Field(default_factory=Recipe, description="judge SFT recipe")
    selector: Recipe = Field(default_factory=Recipe, description="selector SFT recipe")
    balance: bool = Field(True, description="down-sample the larger verdict class to the smaller")
    pairs_per_problem: int = Field(4, ge=1, le=1024, description="selector pairs drawn per "
                                   "training problem (valid vs invalid)")
    val_share: float = Field(0.1, ge=0, lt=1, description="training problems held out for the "
                             "validation accuracy")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: default)")
    register_as: str = Field("proofverify-judge", description="registered judge model name")
    register_selector_as: str = Field("proofverify-selector",
                                      description="registered selector model name")


def judge_target(question: str, solution: str, valid: bool, style: pv.PromptStyle) -> str:
    """What the judge is trained to reply: ` Yes|No` (compact), or the step check trace then
    ` Verdict: Yes|No` (check)."""
    verdict = "Yes" if valid else "No"
    if style == "check":
        return f" {pv.check_trace(question, solution)} Verdict: {verdict}"
    return f" {verdict}"


def selector_target(question: str, first: str, second: str, best: int,
                    style: pv.PromptStyle) -> str:
    """` 1|2` (compact), or both check traces then ` Best: 1|2` (check)."""
    if style == "check":
        return (f" [1] {pv.check_trace(question, first)} [2] "
                f"{pv.check_trace(question, second)} Best: {best}")
    return f" {best}"


def judge_rows(df: pl.DataFrame, style: pv.PromptStyle, balance: bool,
               rng: random.Random) -> tuple[list[str], list[str]]:
    """(prompts, targets) of the judge's SFT data; balanced by down-sampling when asked."""
    items = [(pv.judge_prompt(r["prompt"], r["completion"], style),
              judge_target(r["question"], r["completion"], r["valid"], style))
             for r in df.iter_rows(named=True)]
    if balance:
        yes = [x for x in items if x[1].endswith("Yes")]
        no = [x for x in items if x[1].endswith("No")]
        k = min(len(yes), len(no))
        if k == 0:
            raise ValueError("judge training data has only one verdict class; sample more "
                             "candidates or raise candidates.corrupt_rate")
        items = rng.sample(yes, k) + rng.sample(no, k)
        rng.shuffle(items)
    return [p for p, _ in items], [t for _, t in items]


def selector_rows(df: pl.DataFrame, style: pv.PromptStyle, per_problem: int,
                  rng: random.Random) -> tuple[list[str], list[str]]:
    """(prompts, targets): pairs (valid, invalid) of one problem, the valid one at a random
    position, target its number."""
    prompts, targets = [], []
    for (_,), g in df.group_by(["problem_id"], maintain_order=True):
        rows = g.to_dicts()
        good = [r for r in rows if r["valid"]]
        bad = [r for r in rows if not r["valid"]]
        pairs = [(a, b) for a in good for b in bad]
        for a, b in rng.sample(pairs, min(per_problem, len(pairs))):
            first, second, best = (a, b, 1) if rng.random() < 0.5 else (b, a, 2)
            prompts.append(pv.genselect_prompt(a["prompt"], first["completion"],
                                               second["completion"], style))
            targets.append(selector_target(a["question"], first["completion"],
                                           second["completion"], best, style))
    return prompts, targets


def _fit(cfg: Config, recipe: Recipe, prompts: list[str], targets: list[str], seed: int,
         ctx: Any, role: str) -> tuple[Any, Any, dict[str, float]]:
    from stages.models import base
    from stages.models.generate import load_model

    model, tokenizer = load_model(ctx.path(cfg.base_model))
    model.train()
    max_len = model.config.max_position_embeddings
    rows = base.encode_sft_rows(tokenizer, prompts, targets, max_len + 1)
    kept = [r for r in rows if len(r["input_ids"]) <= max_len]
    if not kept:
        raise ValueError(f"train_judge/{role}: every example is longer than the model's "
                         f"{max_len} positions")
    dropped = len(rows) - len(kept)   # e.g. pairs of two runaway candidates: dropped, counted
    rows = kept
    bcfg = base.Config(steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr,
                       warmup=recipe.warmup, log_every=max(1, recipe.steps // 10))
    stats = base.train(bcfg, model, tokenizer, rows, seed)
    model.eval()
    stats["dropped_too_long"] = float(dropped)
    return model, tokenizer, {f"{role}_{k}": v for k, v in stats.items()}


def _val_accuracy(model: Any, tokenizer: Any, prompts: list[str], targets: list[str],
                  parse: Any) -> tuple[float, float]:
    """Greedy accuracy and parse-failure rate on held-out prompts."""
    from stages.models.generate import generate

    if not prompts:
        return float("nan"), float("nan")
    longest = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in targets)
    outs = [o[0] for o in generate(model, tokenizer, prompts, max_new_tokens=longest + 4,
                                   batch_size=256)]
    got = [parse(o) for o in outs]
    want = [parse(t) for t in targets]
    return (sum(g == w for g, w in zip(got, want)) / len(got),
            sum(g is None for g in got) / len(got))


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import read_parquet_checked
    from stages.models.base import set_threads
    from stages.proofverify.candidates import expectations

    judge_dir, selector_dir = ctx.path(cfg.judge_out), ctx.path(cfg.selector_out)
    if not cfg.train:
        note = {"trained": False, "why": "train_judge.train = false: the judge and selector are "
                "prompted served models; see the judge/genselect/hybrid backend params"}
        for d in (judge_dir, selector_dir):
            with io.atomic_path(d, is_dir=True) as tmp:
                io.write_json(tmp / "PROMPTED.json", note)
        return {"trained": 0.0}
    df = read_parquet_checked(ctx.path(cfg.candidates) / "train.parquet", expectations("train"))
    set_threads(cfg.num_threads)
    rng = random.Random(f"proofverify-train:{ctx.seed}")
    problems = df["problem_id"].unique(maintain_order=True).to_list()
    n_val = int(len(problems) * cfg.val_share)
    val_ids = set(rng.sample(problems, n_val))
    train_df = df.filter(~pl.col("problem_id").is_in(list(val_ids)))
    val_df = df.filter(pl.col("problem_id").is_in(list(val_ids)))

    metrics: dict[str, float] = {"trained": 1.0}
    jp, jt = judge_rows(train_df, cfg.prompt_style, cfg.balance, rng)
    sp, st = selector_rows(train_df, cfg.prompt_style, cfg.pairs_per_problem, rng)
    if not sp:
        raise ValueError("train_judge: no training problem has both a valid and an invalid "
                         "candidate; the selector has nothing to learn from")
    metrics |= {"judge_rows": float(len(jp)),
                "judge_yes_share": sum(t.endswith("Yes") for t in jt) / len(jt),
                "selector_rows": float(len(sp)),
                "selector_first_share": sum(t.endswith("1") for t in st) / len(st)}
    vjp, vjt = judge_rows(val_df, cfg.prompt_style, False, rng) if n_val else ([], [])
    vsp, vst = selector_rows(val_df, cfg.prompt_style, cfg.pairs_per_problem, rng) \
        if n_val else ([], [])
    for role, recipe, prompts, targets, vp, vt, parse, out, name in (
            ("judge", cfg.judge, jp, jt, vjp, vjt, pv.parse_judgement, judge_dir,
             cfg.register_as),
            ("selector", cfg.selector, sp, st, vsp, vst, pv.parse_choice, selector_dir,
             cfg.register_selector_as)):
        model, tokenizer, stats = _fit(cfg, recipe, prompts, targets, ctx.seed, ctx, role)
        metrics |= stats
        acc, fail = _val_accuracy(model, tokenizer, vp, vt, parse)
        metrics |= {f"{role}_val_acc": acc, f"{role}_val_parse_fail": fail}
        print(f"train_judge/{role}: {len(prompts)} rows, val acc {acc:.3f}")
        io.save_model(model, tokenizer, out)
        io.write_json(out / "verifier.json", {"role": role, "prompt_style": cfg.prompt_style,
                                              "rows": len(prompts), "registered_as": name})
        if ctx.tracker is not None:
            ctx.tracker.register_model(out, name, ["candidate", "champion"],
                                       tags={"paperline.method": role,
                                             "prompt_style": cfg.prompt_style})
            # its scores as `metric.*` tags; the selection stages add their test scores
            ctx.tracker.annotate_model(out, {"val_acc": acc, "val_parse_fail": fail})
    ctx.log_params({"val_problems": n_val})
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the judge's and the selector's validation accuracy; the training record in
    details/train_judge.json."""
    return {k: metrics[k] for k in ("judge_val_acc", "selector_val_acc") if k in metrics}
