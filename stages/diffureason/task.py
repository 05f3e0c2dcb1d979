"""Stage `problems` of DiffuReason: multi-step modular arithmetic with a chain of thought.

Spec §4: chained + / x on 2-digit numbers, mod 100, 3-6 steps, one step per line, the answer in
a final block. A problem is a chain of operands joined by operators, evaluated left to right,
every intermediate value reduced mod m:

    prompt    37*04+81=
    response  37*04=48;48+81=29;#29          (mod 100)

`;` ends a step (our one-character line break: the character tokenizer keeps no newline),
`#` starts the answer. Numbers are zero-padded to the width of m - 1, so every step has the
same width and sits at a fixed position (the diffusion LM has absolute positions and no
causal order to count on). `stages/tasks/arith.py` evaluates without a modulus (values grow
and the response length varies with them), hence this family. The response is `<eos>`-padded to a fixed
length (`stages.models.mdlm` layout). Splits are disjoint (no question in two splits); test is
drawn first, so growing the train split leaves it unchanged. `difficulty` = number of steps.

    python -m stages diffureason problems
"""

from __future__ import annotations

import random
import re
import string
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.core import io

OPERATORS = "+-*"


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    modulus: int = Field(100, ge=2, le=1000, description="values are reduced mod m [spec: 100]")
    operators: str = Field("+*", min_length=1, max_length=3,
                           description="subset of '+-*' [spec: + and x]")
    min_steps: int = Field(3, ge=1, le=12, description="fewest steps [spec: 3]")
    max_steps: int = Field(6, ge=1, le=12, description="most steps [spec: 6]")
    sizes: dict[str, int] = Field(default_factory=lambda: {"test": 500, "val": 100,
                                                           "train": 20000},
                                  description="rows per split (test first)")
    block_size: int = Field(16, ge=2, le=64, description="thought block B [spec: 8-16]")

    @field_validator("operators")
    @classmethod
    def _ops(cls, v: str) -> str:
        bad = sorted(set(v) - set(OPERATORS))
        if bad or len(set(v)) != len(v):
            raise ValueError(f"operators {v!r}: expected distinct characters of {OPERATORS!r}")
        return "".join(op for op in OPERATORS if op in v)

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.min_steps > self.max_steps:
            raise ValueError(f"min_steps ({self.min_steps}) > max_steps ({self.max_steps})")
        if set(self.sizes) != {"train", "val", "test"} or min(self.sizes.values()) < 1:
            raise ValueError(f"sizes = {self.sizes}: expected train, val and test, each >= 1")
        return self

    @property
    def prompt_len(self) -> int:
        """<bos> + the longest question + '='."""
        width = len(str(self.modulus - 1))
        return 1 + (self.max_steps + 1) * width + self.max_steps + 1

    @property
    def response_len(self) -> int:
        """The longest response, rounded up to whole blocks (at least one `<eos>` after it)."""
        width = len(str(self.modulus - 1))
        longest = self.max_steps * (3 * width + 3) + 1 + width + 1
        return -(-longest // self.block_size) * self.block_size

    @property
    def n_blocks(self) -> int:
        return self.response_len // self.block_size


def apply(a: int, op: str, b: int, m: int) -> int:
    if op == "+":
        return (a + b) % m
    if op == "-":
        return (a - b) % m
    if op == "*":
        return (a * b) % m
    raise ValueError(f"unknown operator {op!r}")


def num(v: int, m: int) -> str:
    """v zero-padded to the width of m - 1 (every step has the same width)."""
    return str(v).zfill(len(str(m - 1)))


def question(operands: list[int], ops: list[str], m: int) -> str:
    return num(operands[0], m) + "".join(f"{o}{num(b, m)}" for o, b in zip(ops, operands[1:]))


def solve(operands: list[int], ops: list[str], m: int) -> tuple[str, int]:
    """The worked response and the answer: `a op b=c;` per step, then `#answer`."""
    if len(operands) != len(ops) + 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators")
    value, steps = operands[0], []
    for op, b in zip(ops, operands[1:]):
        new = apply(value, op, b, m)
        steps.append(f"{num(value, m)}{op}{num(b, m)}={num(new, m)};")
        value = new
    return "".join(steps) + f"#{num(value, m)}", value


_ANSWER = re.compile(r"#(\d+)$")


def extract_answer(response: str) -> int | None:
    """The integer after the last `#` when the response ends with it; else None."""
    found = _ANSWER.search(response.strip())
    return int(found[1]) if found else None


def generate(cfg: Config, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(f"diffureason:{seed}")
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    for split, n in cfg.sizes.items():
        tries = 0
        made = 0
        while made < n:
            tries += 1
            if tries > 50 * n + 1000:
                raise ValueError(f"only {made} of {n} distinct {split} problems: widen modulus "
                                 f"or steps, or lower sizes.{split}")
            k = cfg.min_steps + made % (cfg.max_steps - cfg.min_steps + 1)
            operands = [rng.randrange(cfg.modulus) for _ in range(k + 1)]
            ops = [rng.choice(cfg.operators) for _ in range(k)]
            q = question(operands, ops, cfg.modulus)
            if q in seen:
                continue
            seen.add(q)
            response, answer = solve(operands, ops, cfg.modulus)
            rows.append({"id": f"dr-{split}-{made:05d}", "split": split,
                         "prompt": q + "=", "response": response, "answer": answer,
                         "steps": k})
            made += 1
    return rows


def problem_spec(cfg: Config | None = None) -> Any:
    import polars as pl

    from stages.core.checks import spec_from_schema

    rules: dict[str, Any] = {"id": {"unique": True}, "prompt": {"unique": True},
                             "split": {"values": ["train", "val", "test"]},
                             "answer": {"min": 0}, "steps": {"min": 1}}
    return spec_from_schema({"id": pl.String, "split": pl.String, "prompt": pl.String,
                             "response": pl.String, "answer": pl.Int64, "steps": pl.Int64},
                            **rules)


def read_problems(folder: Any) -> tuple[Any, dict[str, Any]]:
    """(problems frame, task.json) of the `problems` stage, checked."""
    from stages.core.checks import read_json_checked, read_parquet_checked

    df = read_parquet_checked(folder / "problems.parquet", problem_spec())
    meta = read_json_checked(folder / "task.json", {"prompt_len": int, "response_len": int,
                                                    "block_size": int, "n_blocks": int,
                                                    "modulus": int})
    bad = [r for r, a in zip(df["response"].to_list(), df["answer"].to_list())
           if extract_answer(r) != a]
    if bad:
        raise ValueError(f"{folder / 'problems.parquet'}: {len(bad)} responses whose final "
                         f"answer is not the answer column, e.g. {bad[0]!r}")
    return df, meta


def build_tokenizer() -> Any:
    from stages.models.mdlm import add_mask_token
    from stages.models.tokenizer import build_tokenizer as house

    tok = house(set(string.digits + OPERATORS + "=;#"))
    add_mask_token(tok)
    return tok


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    rows = generate(cfg, ctx.seed)
    df = pl.DataFrame(rows)
    longest = max(len(r) for r in df["response"].to_list())
    tok = build_tokenizer()
    meta = {"prompt_len": cfg.prompt_len, "response_len": cfg.response_len,
            "block_size": cfg.block_size, "n_blocks": cfg.n_blocks, "modulus": cfg.modulus,
            "operators": cfg.operators}
    out = ctx.path("diffureason_problems")
    with io.atomic_path(out, is_dir=True) as tmp:
        io.write_parquet(tmp / "problems.parquet", df)
        io.write_json(tmp / "task.json", meta)
        tok.save_pretrained(str(tmp / "tokenizer"))
    test = df.filter(pl.col("split") == "test")
    counts = test["answer"].value_counts()
    return {"n_train": float(cfg.sizes["train"]), "n_test": float(cfg.sizes["test"]),
            "response_len": float(cfg.response_len), "n_blocks": float(cfg.n_blocks),
            "longest_response": float(longest), "vocab_size": float(len(tok)),
            # the best constant answer: what a model that ignores the question scores
            "majority_answer_rate": float(counts["count"].max() / len(test))}


def headline(details: dict[str, float]) -> dict[str, float]:
    return {k: details[k] for k in ("n_test", "n_blocks", "majority_answer_rate")
            if k in details}
