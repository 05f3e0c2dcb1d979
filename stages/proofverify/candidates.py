"""Stage `candidates` of ProofVerify: n sampled solutions per problem, labelled exactly.

The paper separates proof-level validity from final-answer correctness. `arith` solutions have
both: a solution is VALID iff every step is the true step and all steps are there
(`verify_steps`) and the final answer is right (`verify_answer`). Every candidate gets a flaw
class (spec §4): `none` (valid), `a` (wrong final answer) or `b` (right answer reached through a
wrong step: the style-correct but invalid proofs a judge is tempted to accept).

The base policy rarely writes flaw b on its own (under 1% of samples on 3-4 operands at T = 1:
`natural_flaw_b_share` in metrics), so a share `corrupt_rate` of the valid samples is turned into
flaw b [ours]: one step's result is shifted by a small slip (+-1, +-2, +-10), the next step copies
the wrong value but still lands on the true result, and the final answer is kept. `source`
records which candidates were corrupted; `corrupt_rate: 0` keeps the policy's own samples only.

    <out>/train.parquet   candidates on training problems (judge / selector training data)
    <out>/test.parquet    candidates on held-out problems (n_p per problem: what is selected)

Problems are drawn here (disjoint from every shared task split) rather than in a stage of their
own: one process less per pipeline run.
"""

from __future__ import annotations

import random
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io
from stages.tasks import arith as arith_family

SCHEMA: dict[str, Any] = {
    "candidate_id": pl.String, "problem_id": pl.String, "index": pl.Int64,
    "question": pl.String, "prompt": pl.String, "answer": pl.Int64, "n_operands": pl.Int64,
    "completion": pl.String, "source": pl.String, "final_answer": pl.Int64,
    "answer_correct": pl.Boolean, "steps_valid": pl.Boolean, "valid": pl.Boolean,
    "flaw": pl.String,
}
FLAWS = ("none", "a", "b")
SLIPS = (-10, -2, -1, 1, 2, 10)


def expectations(split: str | None = None) -> Any:
    from stages.core.checks import spec_from_schema

    from dataclasses import replace

    spec = spec_from_schema(SCHEMA, candidate_id={"unique": True}, flaw={"values": FLAWS},
                            source={"values": ["policy", "reference", "corrupted"]},
                            index={"min": 0})
    # final_answer is null where no integer follows `####`; a nullable Int64 reaches pandas as
    # float64 (the writer fixes it to Int64 through SCHEMA), so GE checks no dtype there
    spec.columns["final_answer"] = replace(spec.columns["final_answer"], dtype=None, nullable=True)
    return spec


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: str = Field("arith", description="task family (only arith has steps and answers)")
    arith: arith_family.Config = Field(
        default_factory=lambda: arith_family.Config(min_operands=3, max_operands=4),
        description="problem difficulty; the base policy errs on ~25% of 3-4 operand problems")
    n_train_problems: int = Field(400, ge=1, le=1_000_000, description="judge training problems")
    n_test_problems: int = Field(100, ge=1, le=100_000, description="held-out problems")
    exclude_tasks: str | None = Field("tasks", description="paths key of the shared task folder "
                                      "whose questions are excluded")
    policy: str = Field("base_model", description="paths key of the policy folder")
    n_train: int = Field(8, ge=1, le=4096, description="candidates per training problem")
    n_test: int = Field(16, ge=2, le=4096, description="n_p: candidates per held-out problem "
                                                       "(paper: 256 or 512)")
    temperature: float = Field(1.0, gt=0, le=10, description="policy sampling temperature "
                                                             "(paper: 0.6-1.0)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (paper: 0.95-1.0)")
    max_new_tokens: int = Field(64, ge=1, le=131072, description="generation budget, tokens")
    batch_size: int = Field(256, ge=1, le=65536, description="sequences generated together")
    corrupt_rate: float = Field(0.3, ge=0, le=1, description="[ours] share of valid samples "
                                "turned into flaw b (right answer, one wrong step)")
    reference_rate: float = Field(0.0, ge=0, le=1, description="[ours] share of samples "
                                  "replaced by the true solution before corruption (smoke only: "
                                  "its barely trained policy writes no valid solution)")
    num_threads: int = Field(0, ge=0, le=512, description="torch CPU threads (0: default)")
    out: str = Field("candidates", description="paths key of the output folder")

    @field_validator("family")
    @classmethod
    def _arith_only(cls, value: str) -> str:
        if value != "arith":
            raise ValueError(f"family {value!r}: ProofVerify needs step-level and answer-level "
                             "verifiers; only 'arith' has both")
        return value


def corrupt(row: dict[str, Any], rng: random.Random) -> str:
    """A flaw-b copy of the TRUE solution of `row`: step j's result slips by a small amount, the
    next step starts from the slipped value but writes the true result, the final answer stays.

    >>> corrupt({"question": "20+5-3"}, random.Random(0))   # doctest: +SKIP
    ' 20+5=35; 35-3=22 #### 22'
    """
    operands, ops = arith_family.parse_question(row["question"])
    steps = arith_family.solution_steps(operands, ops)
    j = rng.randrange(len(steps))
    slip = rng.choice(SLIPS)
    written = [arith_family.format_step(s) for s in steps]
    wrong = steps[j].value + slip
    written[j] = f"{steps[j].left}{steps[j].op}{steps[j].right}={wrong}"
    if j + 1 < len(steps):
        nxt = steps[j + 1]
        written[j + 1] = f"{wrong}{nxt.op}{nxt.right}={nxt.value}"
    return " " + "; ".join(written) + f" #### {steps[-1].value}"


def label(row: dict[str, Any], completion: str) -> dict[str, Any]:
    """Exact labels of one candidate: answer, steps, validity and flaw class."""
    answer_ok = arith_family.verify_answer(row, completion)
    verdicts = arith_family.verify_steps(row, completion)
    steps_ok = len(verdicts) == int(row["n_operands"]) - 1 and all(verdicts)
    valid = answer_ok and steps_ok
    return {"final_answer": arith_family.extract_answer(completion),
            "answer_correct": answer_ok, "steps_valid": steps_ok, "valid": valid,
            "flaw": "none" if valid else ("a" if not answer_ok else "b")}


def build_rows(problems: list[dict[str, Any]], samples: list[list[str]], corrupt_rate: float,
               rng: random.Random, reference_rate: float = 0.0
               ) -> tuple[list[dict[str, Any]], int]:
    """Labelled candidate rows, some valid samples corrupted; also the count of NATURAL flaw-b
    samples (before corruption)."""
    rows, natural_b = [], 0
    for p, outs in zip(problems, samples, strict=True):
        for k, text in enumerate(outs):
            source = "policy"
            if reference_rate and rng.random() < reference_rate:
                text, source = p["target"], "reference"
            lab = label(p, text)
            natural_b += lab["flaw"] == "b"
            if lab["valid"] and rng.random() < corrupt_rate:
                text, source = corrupt(p, rng), "corrupted"
                lab = label(p, text)
            rows.append({"candidate_id": f"{p['id']}-c{k:03d}", "problem_id": p["id"],
                         "index": k, "question": p["question"], "prompt": p["prompt"],
                         "answer": int(p["answer"]), "n_operands": int(p["n_operands"]),
                         "completion": text, "source": source, **lab})
    return rows, natural_b


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    from stages.core.checks import validate_frame
    from stages.models.base import set_threads
    from stages.models.generate import generate, load_model
    from stages.tasks import load_split

    exclude: set[str] = set()
    if cfg.exclude_tasks:
        for split in ("train", "val", "test"):
            exclude.update(load_split(ctx.path(cfg.exclude_tasks), cfg.family, split)["question"])
    seed = f"proofverify:{ctx.seed}"
    test = arith_family.generate(cfg.arith, cfg.n_test_problems, seed, split="test",
                                 exclude=exclude)
    exclude.update(r["question"] for r in test)
    train = arith_family.generate(cfg.arith, cfg.n_train_problems, seed, split="train",
                                  exclude=exclude)
    if cfg.num_threads:
        set_threads(cfg.num_threads)
    model, tokenizer = load_model(ctx.path(cfg.policy))
    metrics: dict[str, float] = {}
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        for split, problems, n in (("train", train, cfg.n_train), ("test", test, cfg.n_test)):
            samples = generate(model, tokenizer, [p["prompt"] for p in problems],
                               max_new_tokens=cfg.max_new_tokens, do_sample=True,
                               temperature=cfg.temperature, top_p=cfg.top_p, num_samples=n,
                               batch_size=cfg.batch_size, seed=ctx.seed + (split == "test"))
            rows, natural_b = build_rows(problems, samples, cfg.corrupt_rate,
                                         random.Random(f"{seed}:{split}:corrupt"),
                                         cfg.reference_rate)
            df = pl.DataFrame(rows, schema=SCHEMA)
            validate_frame(df, expectations(split), f"{cfg.out}/{split}.parquet")
            io.write_parquet(tmp / f"{split}.parquet", df)
            metrics |= {
                f"{split}_candidates": float(df.height),
                f"{split}_valid_share": float(df["valid"].mean()),
                f"{split}_answer_correct_share": float(df["answer_correct"].mean()),
                f"{split}_flaw_a_share": float((df["flaw"] == "a").mean()),
                f"{split}_flaw_b_share": float((df["flaw"] == "b").mean()),
                f"{split}_natural_flaw_b_share": natural_b / df.height,
                f"{split}_corrupted_share": float((df["source"] == "corrupted").mean()),
            }
            if split == "test":
                per = df.group_by("problem_id").agg(
                    pl.col("valid").any().alias("any_valid"),
                    pl.col("answer_correct").any().alias("any_right"))
                metrics["test_oracle_proof"] = float(per["any_valid"].mean())
                metrics["test_oracle_answer"] = float(per["any_right"].mean())
    print(f"candidates: {metrics}")
    return metrics


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the share of valid test candidates and the ceiling (a valid candidate in the
    pool); flaw shares and the train split in details/candidates.json."""
    return {k: metrics[k] for k in ("test_valid_share", "test_oracle_proof") if k in metrics}
