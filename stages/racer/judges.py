"""Stage `judges` of RACER: judgement items from `arith` and the two judges, fine-tuned from the
shared base model.

A judgement item is a (question, proposed answer) pair; its label is the exact verifier's
verdict (`arith.verify_answer`). Half the proposed answers are wrong by a small offset
(+-1..9 or +-10, +-20), so neither the last digit nor the size gives the verdict away.
Difficulty = number of operands (2 easy ... 5 hard).

    prompt      Check 51. Q: 23+45-17=? A:
    direct      " 23+45-17=51"                 (non-reasoning: the value at once, no steps)
    reasoning   " 23+45=68; 68-17=51 #### 51"  (chain of thought: every step, then the value)
    verdict     yes iff the stated value equals the proposed answer (`parse_verdict`)

A judge that writes ` yes`/` no` itself did not learn at this scale: after 300 steps the direct
judge's verdict loss sat at the label prior (chance accuracy at every difficulty), and a
stated-answer-then-verdict judge wrote the right value but a random verdict after 100 steps. So
each judge commits to a value and the verdict is the exact comparison with the proposed answer
(a recompute-and-match judge; README, deviations). Both judges are the base model fine-tuned
(completion-only SFT, `self_improve.sft`) on a uniform mix of difficulties, then used only
through the backend interface
(`stages.models.backend`) by `judge_outcomes`. The direct judge must compute the whole chain in
one token, so it should degrade with the number of operands; the reasoning judge recomputes it
step by step at a cost that grows with the number of operands (the paper's Qwen3 thinking vs
non-thinking modes, spec §2). Router data: pools drawn with an easy-heavy operand mix (train,
val, test_iid) and a hard-heavy one (test_hard: the distribution shift).

    python -m stages racer judges
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.tasks import arith

VERDICTS = ("yes", "no")
SPLITS = ("train", "val", "test_iid", "test_hard")


class SFT(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(200, ge=1, le=1_000_000, description="optimizer steps")
    batch_size: int = Field(32, ge=1, le=8192, description="rows per step")
    lr: float = Field(5e-4, gt=0, le=1, description="peak learning rate")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_operands: int = Field(2, ge=2, le=8, description="easiest items (operands)")
    max_operands: int = Field(5, ge=2, le=8, description="hardest items (operands)")
    max_value: int = Field(99, ge=1, le=100000, description="largest operand")
    operators: str = Field("+-", description="operators, a subset of '+-*'")
    wrong_share: float = Field(0.5, ge=0, le=1, description="share of wrong proposed answers")
    n_judge_train: int = Field(2000, ge=2, description="items the judges are fine-tuned on "
                                                       "(uniform difficulty)")
    pool: dict[str, int] = Field(description="router items per split: train, val, test_iid, "
                                             "test_hard")
    train_mix: list[float] = Field(description="operand-count weights (min..max) of train, val "
                                               "and test_iid: easy-heavy")
    shift_mix: list[float] = Field(description="operand-count weights of test_hard: hard-heavy")
    direct: SFT = Field(default_factory=SFT, description="SFT of the direct judge")
    reasoning: SFT = Field(default_factory=SFT, description="SFT of the reasoning judge")
    model: str = Field("base_model", description="paths key of the model both judges start from")
    items_out: str = Field("racer_items", description="paths key of the items folder")
    out: str = Field("racer_judges", description="paths key of the judges folder")
    num_threads: int = Field(0, ge=0, le=256, description="torch CPU threads (0: all cores)")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        k = self.max_operands - self.min_operands + 1
        if k < 1:
            raise ValueError(f"min_operands {self.min_operands} > max_operands {self.max_operands}")
        for name in ("train_mix", "shift_mix"):
            w = getattr(self, name)
            if len(w) != k or any(x < 0 for x in w) or sum(w) <= 0:
                raise ValueError(f"{name} = {w}: expected {k} non-negative weights (operands "
                                 f"{self.min_operands}..{self.max_operands}) with a positive sum")
        if set(self.pool) != set(SPLITS):
            raise ValueError(f"pool = {self.pool}: expected exactly the splits {list(SPLITS)}")
        if any(v < 1 for v in self.pool.values()):
            raise ValueError(f"pool = {self.pool}: every split needs >= 1 item")
        arith.Config(min_operands=self.min_operands, max_operands=self.max_operands,
                     max_value=self.max_value, operators=self.operators)
        return self


# --- items (pure) -----------------------------------------------------------------------------


def mix_counts(n: int, weights: list[float]) -> list[int]:
    """n split over the weights by largest remainder: counts sum to n exactly."""
    total = sum(weights)
    raw = [n * w / total for w in weights]
    counts = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: counts[i] - raw[i])[:n - sum(counts)]:
        counts[i] += 1
    return counts


def judge_prompt(question: str, proposed: int) -> str:
    """The proposed answer first, then the base model's own prompt (its skills start there)."""
    return f"Check {proposed}. Q: {question}=? A:"


def direct_target(question: str) -> str:
    """The direct judge's output: the whole question = its one-shot value, no intermediate
    steps (" 23+45-17=51"). For two operands this is one worked step; beyond, the chain must be
    computed at once, which a tiny model cannot: the non-reasoning mode."""
    operands, ops = arith.parse_question(question)
    return f" {question}={arith.solution_steps(operands, ops)[-1].value}"


def reasoning_target(question: str) -> str:
    """The reasoning judge's chain of thought: the worked solution (" 23+45=68; 68-17=51 #### 51")."""
    operands, ops = arith.parse_question(question)
    return arith.format_target(operands, ops)


_LAST_INT = re.compile(r"=\s*(-?\d+)\s*$")


def stated_value(text: str) -> int | None:
    """The value a judge output commits to: the integer after the last `####` (reasoning), else
    the integer closing a final `...=v` (direct); None when there is none (malformed)."""
    if "####" in text:
        return arith.extract_answer(text)
    m = _LAST_INT.search(text.strip())
    return int(m[1]) if m else None


def parse_verdict(text: str, proposed: int) -> str | None:
    """yes iff the judge's stated value equals the proposed answer; None for a malformed output
    (empty, truncated, no value)."""
    value = stated_value(text)
    if value is None:
        return None
    return "yes" if value == proposed else "no"


def wrong_answer(truth: int, rng: random.Random) -> int:
    delta = rng.choice([d for d in range(1, 10)] + [10, 20])
    return truth + delta * rng.choice((-1, 1))


def make_items(counts: dict[int, int], cfg: Config, split: str, seed: int,
               used: set[str]) -> list[dict[str, Any]]:
    """Items with `counts[k]` questions of k operands, unique (not in `used`), a `wrong_share`
    of them with a wrong proposed answer; shuffled."""
    rng = random.Random(f"racer:{split}:{seed}")
    rows: list[dict[str, Any]] = []
    for k, n in counts.items():
        if n == 0:
            continue
        acfg = arith.Config(min_operands=k, max_operands=k, max_value=cfg.max_value,
                            operators=cfg.operators)
        for r in arith.generate(acfg, n, f"{seed}:{split}", split=split, exclude=used):
            used.add(r["question"])
            rows.append(r)
    rng.shuffle(rows)
    n_wrong = round(cfg.wrong_share * len(rows))
    items = []
    for i, r in enumerate(rows):
        truth = int(r["answer"])
        proposed = wrong_answer(truth, rng) if i < n_wrong else truth
        items.append({"id": f"racer-{split}-{i:06d}", "split": split, "question": r["question"],
                      "proposed": proposed, "answer": truth,
                      "label": arith.verify_answer(r, f"#### {proposed}"),
                      "difficulty": int(r["n_operands"]),
                      "prompt": judge_prompt(r["question"], proposed)})
    rng.shuffle(items)
    return items


def item_spec(min_operands: int, max_operands: int) -> Any:
    import polars as pl

    from stages.core.checks import spec_from_schema

    schema = {"id": pl.String, "split": pl.String, "question": pl.String, "proposed": pl.Int64,
              "answer": pl.Int64, "label": pl.Boolean, "difficulty": pl.Int64,
              "prompt": pl.String}
    return spec_from_schema(schema, id={"unique": True}, question={"unique": True},
                            difficulty={"values": list(range(min_operands, max_operands + 1))})


def build_items(cfg: Config, seed: int) -> dict[str, list[dict[str, Any]]]:
    sizes = range(cfg.min_operands, cfg.max_operands + 1)
    used: set[str] = set()
    out = {}
    for split in ("test_hard", "test_iid", "val", "train"):   # held-out first (stable)
        mix = cfg.shift_mix if split == "test_hard" else cfg.train_mix
        out[split] = make_items(dict(zip(sizes, mix_counts(cfg.pool[split], mix))), cfg, split,
                                seed, used)
    uniform = [1.0] * len(sizes)
    out["judge_train"] = make_items(dict(zip(sizes, mix_counts(cfg.n_judge_train, uniform))),
                                    cfg, "judge_train", seed, used)
    return out


# --- stage ------------------------------------------------------------------------------------


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl
    from transformers import set_seed

    from stages.core.checks import validate_frame
    from stages.models.base import set_threads
    from stages.models.generate import load_model
    from stages.train.sft import sft

    set_threads(cfg.num_threads)
    items = build_items(cfg, ctx.seed)
    spec = item_spec(cfg.min_operands, cfg.max_operands)
    metrics: dict[str, float] = {}
    with io.atomic_path(ctx.path(cfg.items_out), is_dir=True) as tmp:
        for split, rows in items.items():
            df = pl.DataFrame(rows)
            validate_frame(df, spec, f"{cfg.items_out}/{split}.parquet")
            io.write_parquet(tmp / f"{split}.parquet", df)
            metrics[f"items/{split}"] = df.height
            metrics[f"items/{split}/mean_difficulty"] = float(df["difficulty"].mean())
            metrics[f"items/{split}/label_true_share"] = float(df["label"].mean())
    train = items["judge_train"]
    prompts = [r["prompt"] for r in train]
    targets = {"direct": [direct_target(r["question"]) for r in train],
               "reasoning": [reasoning_target(r["question"]) for r in train]}
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        for name, opt in (("direct", cfg.direct), ("reasoning", cfg.reasoning)):
            set_seed(ctx.seed)
            model, tokenizer = load_model(ctx.path(cfg.model))
            got = sft(model, tokenizer, prompts, targets[name], steps=opt.steps,
                      batch_size=opt.batch_size, lr=opt.lr, seed=ctx.seed, warmup=0.05,
                      min_lr_ratio=0.1, log_every=max(1, opt.steps // 10),
                      log=lambda m, s, name=name: ctx.log_metrics(
                          {f"{name}/{k}": v for k, v in m.items()}, step=s))
            metrics.update({f"{name}/{k}": float(v) for k, v in got.items()
                            if isinstance(v, (int, float))})
            io.save_model(model, tokenizer, tmp / name)
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: each judge's final training loss (`<judge>_loss`); item counts and the
    training record stay in details/judges.json."""
    return {f"{j}_loss": metrics[f"{j}/train_loss"] for j in ("direct", "reasoning")
            if f"{j}/train_loss" in metrics}
