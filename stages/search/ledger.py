"""The compute ledger: what every arm spent on every problem, so that methods are compared at
equal, reported compute and a budget is never exceeded.

Search methods win by spending more; a comparison means something only when every arm is
charged for every forward pass it made. DiffuReason's pitfall list calls unequal NFE accounting
"the most common source of inflated search gains"; Refine-Prover (arXiv 2604.18587) counts
every generation, restarts included, and reports value-model calls apart. The ledger holds those
counts per (arm, budget, problem); a `Meter` is one problem's view of it with a hard budget.

Units (the fields of `Cost`):

    nfe            network forward passes, counted PER SEQUENCE: a batched call over R rows that
                   runs S passes costs R*S. Batching makes a search faster, never cheaper.
                   Autoregressive decoding of n new tokens with a KV cache: n passes (the
                   prefill and n-1 decode steps). A masked-diffusion block of T_b denoising
                   steps: T_b passes, each over the whole sequence (no KV cache).
    generations    complete samples drawn from a generator (a proof, a thought block, a child)
    input_tokens   tokens a generation read (prompt and context; refinement reads more)
    output_tokens  tokens it wrote (Refine-Prover compares the two separately)
    value_calls    calls of a value model or verifier that are not forward passes of the
                   generator (a logistic regression, a checker); reported, never hidden in nfe

    ledger = Ledger()
    meter = ledger.meter("value_tree", Budget(unit="generations", limit=64), "p017")
    if meter.can_afford(Cost(generations=1)):
        meter.charge(Cost(generations=1, input_tokens=120, output_tokens=40))
    ledger.frame()   # one row per (arm, budget, problem): every unit, and the budget

A charge that would take a meter past its budget raises `BudgetExceeded` before anything is
recorded: a search checks `can_afford(bound)` with an upper bound of its next step and stops when
that fails, so the charge can only fail when the bound was wrong (a bug, not a tie-break).
Wall-clock seconds are kept per (arm, budget) run, not per problem: under batching one call serves
many problems and a per-problem share would be invented.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Unit = Literal["nfe", "generations", "input_tokens", "output_tokens", "value_calls"]
UNITS: tuple[str, ...] = ("nfe", "generations", "input_tokens", "output_tokens", "value_calls")


@dataclass(frozen=True)
class Cost:
    """An amount of compute in every unit (all >= 0; see the module docstring for the units)."""

    nfe: int = 0
    generations: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    value_calls: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Cost.{f.name} = {value!r}: expected an int >= 0")

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(**{u: getattr(self, u) + getattr(other, u) for u in UNITS})

    def __mul__(self, k: int) -> "Cost":
        return Cost(**{u: getattr(self, u) * k for u in UNITS})

    __rmul__ = __mul__

    def get(self, unit: str) -> int:
        if unit not in UNITS:
            raise ValueError(f"unknown compute unit {unit!r}; expected one of {UNITS}")
        return getattr(self, unit)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Budget(BaseModel):
    """How much one problem may spend, in one unit (the unit the papers budget in: Refine-Prover
    generations, DiffuReason NFE)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unit: Unit = Field(..., description="the budgeted unit (a field of Cost)")
    limit: int = Field(..., ge=1, description="most that unit one problem may spend")


class BudgetExceeded(RuntimeError):
    """A charge would take a problem past its budget (the step's cost bound was too low)."""


class Meter:
    """One problem's account in a ledger, with an optional hard budget."""

    def __init__(self, ledger: "Ledger", arm: str, budget: Budget | None, problem: str):
        self.ledger, self.arm, self.budget, self.problem = ledger, arm, budget, problem

    @property
    def spent(self) -> Cost:
        return self.ledger.spent(self.arm, self.budget, self.problem)

    @property
    def remaining(self) -> int | None:
        """What is left in the budget's unit (None: no budget)."""
        if self.budget is None:
            return None
        return self.budget.limit - self.spent.get(self.budget.unit)

    def can_afford(self, cost: Cost) -> bool:
        return self.budget is None or cost.get(self.budget.unit) <= (self.remaining or 0)

    def charge(self, cost: Cost) -> None:
        if not self.can_afford(cost):
            assert self.budget is not None
            unit = self.budget.unit
            raise BudgetExceeded(
                f"arm {self.arm!r}, problem {self.problem!r}: charging {cost.get(unit)} "
                f"{unit} with {self.remaining} of {self.budget.limit} left; the cost "
                f"bound of this step was too low")
        self.ledger.charge(self.arm, self.budget, self.problem, cost)


class Ledger:
    """Compute spent per (arm, budget, problem), and wall seconds per (arm, budget) run."""

    def __init__(self) -> None:
        self._spent: dict[tuple[str, Budget | None, str], Cost] = defaultdict(Cost)
        self.wall_seconds: dict[tuple[str, Budget | None], float] = defaultdict(float)

    def meter(self, arm: str, budget: Budget | None, problem: str) -> Meter:
        if not arm or not isinstance(arm, str):
            raise ValueError(f"arm = {arm!r}: expected a non-empty name")
        self._spent[(arm, budget, str(problem))] += Cost()  # a problem that spends nothing shows
        return Meter(self, arm, budget, str(problem))

    def charge(self, arm: str, budget: Budget | None, problem: str, cost: Cost) -> None:
        self._spent[(arm, budget, str(problem))] += cost

    def spent(self, arm: str, budget: Budget | None, problem: str) -> Cost:
        return self._spent.get((arm, budget, str(problem)), Cost())

    def total(self, arm: str, budget: Budget | None = None) -> Cost:
        """Everything `arm` spent at `budget`, summed over problems."""
        out = Cost()
        for (a, b, _), cost in self._spent.items():
            if a == arm and b == budget:
                out += cost
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (arm, budget, problem): arm, unit, budget (its limit; None without one),
        problem and every unit spent."""
        return [{"arm": arm, "unit": b.unit if b else None, "budget": b.limit if b else None,
                 "problem": problem, **cost.as_dict()}
                for (arm, b, problem), cost in self._spent.items()]

    def frame(self) -> Any:
        import polars as pl

        schema = {"arm": pl.String, "unit": pl.String, "budget": pl.Int64, "problem": pl.String,
                  **{u: pl.Int64 for u in UNITS}}
        return pl.DataFrame(self.rows(), schema=schema, orient="row")
