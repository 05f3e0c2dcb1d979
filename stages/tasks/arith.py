"""Task family `arith`: multi-step integer arithmetic with a worked, checkable solution.

A problem is a chain of non-negative integer operands joined by operators, evaluated strictly
LEFT TO RIGHT with no operator precedence (also when `*` is enabled: `12+7*3` is `(12+7)*3 = 57`,
not 33). Each step of the solution applies one operator to the running value:

    question  23+45-17
    prompt    Q: 23+45-17=? A:
    target     23+45=68; 68-17=51 #### 51          (note the leading space)

The training text is `prompt + target`. Steps are separated by `;`, the final answer follows the
last `####`. Intermediate and final values may be negative (`5-17=-12`).

Verifiers are exact:
- `verify_answer`: the integer after the last `####` equals the true answer.
- `verify_steps`: one verdict per step the completion wrote. Step i is correct iff it reads
  `a op b=c` where `a` is the TRUE running value before step i (the first operand for step 0),
  `op b` is the question's i-th operator and next operand, and `c` is the TRUE running value after
  step i. A step that correctly continues from a WRONG earlier result is therefore marked wrong:
  "step i is correct" means "the solution is still on the true path after step i" (the notion the
  process-reward papers, e.g. BIS, label steps with). Steps beyond the question's last step are
  wrong.

Difficulty of a problem = its number of operands. `generate` balances rows across operand counts.
Everything is deterministic given the seed (a private `random.Random`, never global state).
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from stages.core.checks import FrameSpec

FAMILY = "arith"
OPERATORS = "+-*"
INT64_MAX = 2**63 - 1

# Column -> polars dtype of every split file of this family.
SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String,            # unique, e.g. arith-train-000123
    "family": pl.String,        # "arith"
    "split": pl.String,         # train | val | test
    "question": pl.String,      # 23+45-17 (unique across all splits)
    "prompt": pl.String,        # Q: 23+45-17=? A:
    "target": pl.String,        # " 23+45=68; 68-17=51 #### 51"
    "answer": pl.Int64,         # 51
    "n_operands": pl.Int64,     # 3
    "difficulty": pl.Int64,     # = n_operands
}


class Config(BaseModel):
    """Difficulty knobs of the arith family."""

    model_config = ConfigDict(extra="forbid")

    min_operands: int = Field(2, ge=2, le=8, description="fewest operands in a problem (difficulty)")
    max_operands: int = Field(4, ge=2, le=8, description="most operands in a problem (difficulty)")
    min_value: int = Field(0, ge=0, le=1_000_000, description="smallest operand value")
    max_value: int = Field(99, ge=0, le=1_000_000, description="largest operand value")
    operators: str = Field("+-", min_length=1, max_length=3,
                           description="operators to draw from, a subset of '+-*'; evaluation is "
                                       "left to right with no precedence")

    @field_validator("operators")
    @classmethod
    def _known_operators(cls, value: str) -> str:
        bad = sorted(set(value) - set(OPERATORS))
        if bad:
            raise ValueError(f"unknown operator(s) {''.join(bad)!r}: expected a subset of {OPERATORS!r}")
        if len(set(value)) != len(value):
            raise ValueError(f"operators {value!r} repeat a character: list each once")
        # Canonical order, so '-+' and '+-' generate identical data.
        return "".join(op for op in OPERATORS if op in value)

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        if self.min_operands > self.max_operands:
            raise ValueError(f"min_operands ({self.min_operands}) must be <= max_operands "
                             f"({self.max_operands})")
        if self.min_value > self.max_value:
            raise ValueError(f"min_value ({self.min_value}) must be <= max_value ({self.max_value})")
        bound = magnitude_bound(self.max_value, self.max_operands, self.operators)
        if bound > INT64_MAX:
            raise ValueError(f"values can reach about {bound:.3g} with operators {self.operators!r}, "
                             f"{self.max_operands} operands up to {self.max_value}: beyond int64; "
                             f"lower max_value or max_operands")
        return self


def magnitude_bound(max_value: int, n_operands: int, operators: str) -> int:
    """An upper bound on |running value| over any problem: B1 = M, B(k+1) = max(Bk + M, Bk * M)."""
    bound = max_value
    for _ in range(n_operands - 1):
        bound = max(bound + max_value, bound * max_value if "*" in operators else 0)
    return bound


class Step(NamedTuple):
    left: int
    op: str
    right: int
    value: int


def apply(left: int, op: str, right: int) -> int:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    raise ValueError(f"unknown operator {op!r}")


def solution_steps(operands: list[int], ops: list[str]) -> list[Step]:
    """The worked solution, left to right: one Step per operator."""
    if len(operands) != len(ops) + 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators, got {len(ops)}")
    steps, value = [], operands[0]
    for op, right in zip(ops, operands[1:]):
        new = apply(value, op, right)
        steps.append(Step(value, op, right, new))
        value = new
    return steps


def format_question(operands: list[int], ops: list[str]) -> str:
    return str(operands[0]) + "".join(f"{op}{b}" for op, b in zip(ops, operands[1:]))


_TOKEN = re.compile(r"\d+|[+\-*]")


def parse_question(question: str) -> tuple[list[int], list[str]]:
    """`23+45-17` -> ([23, 45, 17], ['+', '-'])."""
    tokens = _TOKEN.findall(question)
    if "".join(tokens) != question or len(tokens) % 2 == 0:
        raise ValueError(f"not an arith question: {question!r}")
    return [int(t) for t in tokens[0::2]], tokens[1::2]


def format_prompt(question: str) -> str:
    return f"Q: {question}=? A:"


def format_step(step: Step) -> str:
    return f"{step.left}{step.op}{step.right}={step.value}"


def format_target(operands: list[int], ops: list[str]) -> str:
    steps = solution_steps(operands, ops)
    return " " + "; ".join(format_step(s) for s in steps) + f" #### {steps[-1].value}"


def make_row(operands: list[int], ops: list[str], split: str, index: int) -> dict[str, Any]:
    question = format_question(operands, ops)
    return {
        "id": f"{FAMILY}-{split}-{index:06d}",
        "family": FAMILY,
        "split": split,
        "question": question,
        "prompt": format_prompt(question),
        "target": format_target(operands, ops),
        "answer": solution_steps(operands, ops)[-1].value,
        "n_operands": len(operands),
        "difficulty": len(operands),
    }


def generate(cfg: Config, n: int, seed: int | str, *, split: str = "train",
             exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """`n` rows with unique questions (none in `exclude`), balanced across operand counts.

    Counts per operand count differ by at most one; rows come in a seeded shuffled order.
    Raises ValueError when the settings cannot yield enough distinct questions.
    """
    if n < 0:
        raise ValueError(f"n = {n}: expected >= 0")
    rng = random.Random(f"{FAMILY}:{split}:{seed}")  # str seeds hash with sha512: stable
    seen = set(exclude)
    sizes = list(range(cfg.min_operands, cfg.max_operands + 1))
    problems: list[tuple[list[int], list[str]]] = []
    for k, n_operands in enumerate(sizes):
        want = n // len(sizes) + (1 if k < n % len(sizes) else 0)
        got, tries = 0, 0
        while got < want:
            tries += 1
            if tries > 50 * want + 1000:
                raise ValueError(
                    f"arith: found only {got} of {want} distinct {n_operands}-operand questions for "
                    f"split {split!r} (values {cfg.min_value}..{cfg.max_value}, operators "
                    f"{cfg.operators!r}); widen the value range or lower the split size")
            operands = [rng.randint(cfg.min_value, cfg.max_value) for _ in range(n_operands)]
            ops = [rng.choice(cfg.operators) for _ in range(n_operands - 1)]
            question = format_question(operands, ops)
            if question in seen:
                continue
            seen.add(question)
            problems.append((operands, ops))
            got += 1
    rng.shuffle(problems)
    return [make_row(operands, ops, split, i) for i, (operands, ops) in enumerate(problems)]


def generate_splits(cfg: Config, sizes: dict[str, int], seed: int) -> dict[str, list[dict[str, Any]]]:
    """Disjoint splits (no question in two splits). Splits are drawn in the order of `sizes`,
    each avoiding the earlier ones, so put the held-out splits first: then growing the train split
    leaves val and test unchanged."""
    out: dict[str, list[dict[str, Any]]] = {}
    used: set[str] = set()
    for split, n in sizes.items():
        out[split] = generate(cfg, n, seed, split=split, exclude=used)
        used.update(row["question"] for row in out[split])
    return out


def expectations(cfg: Config | None = None, split: str | None = None) -> "FrameSpec":
    """The data checks of one split file (pass the generating config for the value rules)."""
    from stages.core.checks import spec_from_schema

    rules: dict[str, dict[str, Any]] = {
        "id": {"unique": True}, "question": {"unique": True}, "prompt": {"unique": True},
        "family": {"values": [FAMILY]},
    }
    if split is not None:
        rules["split"] = {"values": [split]}
    if cfg is not None:
        sizes = list(range(cfg.min_operands, cfg.max_operands + 1))
        bound = magnitude_bound(cfg.max_value, cfg.max_operands, cfg.operators)
        rules["answer"] = {"min": -bound, "max": bound}
        # generate() makes counts per operand count differ by at most one
        rules["n_operands"] = {"values": sizes, "max_imbalance": 1.5}
        rules["difficulty"] = {"values": sizes}
    return spec_from_schema(SCHEMA, **rules)


def parse_steps(completion: str) -> list[str]:
    """The steps a completion wrote: text before the first `####`, split on `;`, stripped;
    empty pieces are dropped."""
    body = completion.split("####", 1)[0]
    return [s.strip() for s in body.split(";") if s.strip()]


def step_ends(completion: str) -> list[int]:
    """For each step `parse_steps` returns, the offset just past its last character in
    `completion`: `completion[:end]` is the solution prefix up to and including that step (what
    a process reward model scores and Monte Carlo annotation continues from).

    >>> step_ends(" 23+45=68; 68-17=51 #### 51")
    [9, 19]
    """
    body = completion.split("####", 1)[0]
    ends, start = [], 0
    for piece in body.split(";"):
        if piece.strip():
            ends.append(start + len(piece.rstrip()))
        start += len(piece) + 1
    return ends


def extract_answer(completion: str) -> int | None:
    """The integer after the last `####` (its first whitespace-separated token); None if there is
    no `####` or the token is not an integer."""
    if "####" not in completion:
        return None
    tokens = completion.rsplit("####", 1)[1].split()
    if not tokens or not re.fullmatch(r"-?\d+", tokens[0]):
        return None
    return int(tokens[0])


def verify_answer(row: dict[str, Any], completion: str) -> bool:
    answer = extract_answer(completion)
    return answer is not None and answer == int(row["answer"])


_STEP = re.compile(r"(-?\d+)\s*([+\-*])\s*(\d+)\s*=\s*(-?\d+)")


def verify_steps(row: dict[str, Any], completion: str) -> list[bool]:
    """One verdict per written step: True iff the step is exactly the true step at that index
    (true left value, the question's operator and operand, true result). See module docstring."""
    operands, ops = parse_question(row["question"])
    truth = solution_steps(operands, ops)
    verdicts = []
    for i, text in enumerate(parse_steps(completion)):
        m = _STEP.fullmatch(text)
        if m is None or i >= len(truth):
            verdicts.append(False)
            continue
        written = Step(int(m[1]), m[2], int(m[3]), int(m[4]))
        verdicts.append(written == truth[i])
    return verdicts
