"""The arith family: hand-checked examples, verifier semantics, config messages, properties."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from stages.core.config import UnknownNameError
from stages.tasks import FAMILIES, arith, get_family
from stages.tasks.arith import (
    Config,
    Step,
    extract_answer,
    format_prompt,
    format_target,
    generate,
    generate_splits,
    parse_question,
    parse_steps,
    solution_steps,
    verify_answer,
    verify_steps,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def row_for(question: str) -> dict:
    operands, ops = parse_question(question)
    return arith.make_row(operands, ops, "test", 0)


# --- hand-checked examples ------------------------------------------------------------------------

@pytest.mark.parametrize("operands, ops, target", [
    ([23, 45, 17], ["+", "-"], " 23+45=68; 68-17=51 #### 51"),
    ([12, 7, 3], ["+", "*"], " 12+7=19; 19*3=57 #### 57"),        # left to right, not 12+21
    ([5, 17, 3], ["-", "+"], " 5-17=-12; -12+3=-9 #### -9"),       # negative running values
    ([9, 0], ["*"], " 9*0=0 #### 0"),
    ([2, 3, 4, 5], ["*", "-", "*"], " 2*3=6; 6-4=2; 2*5=10 #### 10"),
])
def test_format_target_by_hand(operands, ops, target):
    assert format_target(operands, ops) == target


def test_row_by_hand():
    row = arith.make_row([23, 45, 17], ["+", "-"], "train", 123)
    assert row == {
        "id": "arith-train-000123", "family": "arith", "split": "train",
        "question": "23+45-17", "prompt": "Q: 23+45-17=? A:",
        "target": " 23+45=68; 68-17=51 #### 51", "answer": 51, "n_operands": 3, "difficulty": 3,
    }
    assert format_prompt("1+2") == "Q: 1+2=? A:"


def test_solution_steps_by_hand():
    assert solution_steps([12, 7, 3], ["+", "*"]) == [Step(12, "+", 7, 19), Step(19, "*", 3, 57)]
    with pytest.raises(ValueError, match="3 operands need 2 operators"):
        solution_steps([1, 2, 3], ["+"])


def test_parse_question():
    assert parse_question("23+45-17") == ([23, 45, 17], ["+", "-"])
    assert parse_question("7") == ([7], [])
    for bad in ["", "1+", "+1", "1++2", "1 + 2", "a+b"]:
        with pytest.raises(ValueError, match="not an arith question"):
            parse_question(bad)


@pytest.mark.parametrize("completion, answer", [
    (" 23+45=68; 68-17=51 #### 51", 51),
    (" 5-17=-12 #### -12", -12),
    ("#### 5 #### 7", 7),              # the last marker counts
    ("#### 51\nQ: 1+1=? A:", 51),      # trailing text after whitespace is ignored
    ("####51", 51),
    (" 23+45=68; 68-17=51", None),     # no marker
    ("#### ", None),
    ("#### abc", None),
    ("#### 51abc", None),
    ("#### 5.0", None),
    ("", None),
])
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


def test_verify_answer():
    row = row_for("23+45-17")
    assert verify_answer(row, " 23+45=68; 68-17=51 #### 51")
    assert verify_answer(row, " nonsense #### 51")         # answer only, steps not looked at
    assert not verify_answer(row, " 23+45=68; 68-17=51 #### 50")
    assert not verify_answer(row, " 23+45=68; 68-17=51")


@pytest.mark.parametrize("completion, verdicts", [
    (" 23+45=68; 68-17=51 #### 51", [True, True]),
    ("23+45=68;68-17=51####51", [True, True]),                 # spacing does not matter
    (" 23 + 45 = 68 ; 68 - 17 = 51 #### 51", [True, True]),
    (" 23+45=69; 69-17=52 #### 52", [False, False]),           # right continuation of a wrong value
    (" 23+45=69; 68-17=51 #### 51", [False, True]),            # back on the true path
    (" 23+45=68; 68+17=85 #### 85", [True, False]),            # wrong operator
    (" 23+45=68; 68-18=50 #### 50", [True, False]),            # wrong operand
    (" 45+23=68; 68-17=51 #### 51", [False, True]),            # operands swapped
    (" 23+45=68 #### 51", [True]),                             # only the steps it wrote
    (" 23+45=68; 68-17=51; 51+0=51 #### 51", [True, True, False]),  # extra step
    (" 23+45=68; hello #### 51", [True, False]),
    (" 23+45=68; ; 68-17=51 #### 51", [True, True]),           # empty pieces dropped
    (" 23+45=68; 68-17=51 #### 51; 1+1=2", [True, True]),      # steps stop at the first ####
    ("", []),
    (" #### 51", []),
])
def test_verify_steps_by_hand(completion, verdicts):
    assert verify_steps(row_for("23+45-17"), completion) == verdicts


def test_parse_steps():
    assert parse_steps(" 23+45=68; 68-17=51 #### 51") == ["23+45=68", "68-17=51"]
    assert parse_steps("1+2=3") == ["1+2=3"]


# --- config ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"min_operands": 5, "max_operands": 3}, "min_operands (5) must be <= max_operands (3)"),
    ({"min_value": 50, "max_value": 10}, "min_value (50) must be <= max_value (10)"),
    ({"operators": "+/"}, "unknown operator(s) '/': expected a subset of '+-*'"),
    ({"operators": "++"}, "repeat a character"),
    ({"operators": ""}, "at least 1 character"),
    ({"max_operands": 9}, "less than or equal to 8"),
    ({"min_operands": 1}, "greater than or equal to 2"),
    ({"min_value": -1}, "greater than or equal to 0"),
    ({"operators": "*", "max_value": 1_000_000, "max_operands": 8}, "beyond int64"),
    ({"max_operand": 4}, "Extra inputs are not permitted"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValidationError) as info:
        Config(**kwargs)
    assert message in str(info.value)


def test_config_operators_canonical_order():
    assert Config(operators="*-+").operators == "+-*"
    assert Config().model_dump() == {"min_operands": 2, "max_operands": 4, "min_value": 0,
                                     "max_value": 99, "operators": "+-"}


def test_magnitude_bound_holds_for_extremes():
    assert Config(min_operands=8, max_operands=8, max_value=99, operators="+-*").max_value == 99
    assert arith.magnitude_bound(99, 8, "+-*") == 99**8         # B(k+1) = max(Bk + M, Bk * M)
    assert arith.magnitude_bound(99, 4, "+-") == 4 * 99
    assert solution_steps([99] * 8, ["*"] * 7)[-1].value == 99**8


# --- registry -------------------------------------------------------------------------------------

def test_family_registry():
    assert FAMILIES["arith"] is arith
    assert get_family("arith") is arith
    with pytest.raises(UnknownNameError, match="Did you mean 'arith'"):
        get_family("arth")
    for name in ("Config", "generate", "extract_answer", "verify_answer", "verify_steps", "SCHEMA"):
        assert hasattr(arith, name)


# --- generation -----------------------------------------------------------------------------------

def test_generate_balanced_unique_and_well_formed():
    cfg = Config(min_operands=2, max_operands=4)
    rows = generate(cfg, 301, seed=0, split="val")
    counts = {d: sum(r["difficulty"] == d for r in rows) for d in (2, 3, 4)}
    assert counts == {2: 101, 3: 100, 4: 100}
    assert len({r["question"] for r in rows}) == 301
    assert [r["id"] for r in rows] == [f"arith-val-{i:06d}" for i in range(301)]
    assert set(rows[0]) == set(arith.SCHEMA)
    for r in rows:
        operands, ops = parse_question(r["question"])
        assert all(0 <= v <= 99 for v in operands) and set(ops) <= {"+", "-"}
        assert r["n_operands"] == r["difficulty"] == len(operands)
        assert r["prompt"] == f"Q: {r['question']}=? A:"


def test_generate_exhausted_space_is_a_clear_error():
    cfg = Config(min_operands=2, max_operands=2, min_value=0, max_value=2, operators="+")
    assert len(generate(cfg, 9, seed=0)) == 9                    # all 3*3 questions
    with pytest.raises(ValueError, match="found only 9 of 10 distinct 2-operand questions"):
        generate(cfg, 10, seed=0)


def test_growing_train_keeps_heldout_splits():
    cfg = Config()
    small = generate_splits(cfg, {"test": 60, "val": 30, "train": 100}, seed=3)
    large = generate_splits(cfg, {"test": 60, "val": 30, "train": 400}, seed=3)
    assert small["test"] == large["test"] and small["val"] == large["val"]


# --- properties -----------------------------------------------------------------------------------

problems = st.integers(min_value=2, max_value=8).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 999), min_size=n, max_size=n),
    st.lists(st.sampled_from("+-*"), min_size=n - 1, max_size=n - 1)))


@FAST
@given(problems)
def test_generated_target_always_verifies(problem):
    operands, ops = problem
    row = arith.make_row(operands, ops, "train", 0)
    completion = row["target"]
    assert verify_answer(row, completion)
    assert verify_steps(row, completion) == [True] * (len(operands) - 1)
    assert extract_answer(completion) == row["answer"]
    # left to right == fully parenthesised Python arithmetic (an independent oracle)
    expr = str(operands[0])
    for op, b in zip(ops, operands[1:]):
        expr = f"({expr}{op}{b})"
    assert row["answer"] == eval(expr)  # noqa: S307 - digits and + - * only


@FAST
@given(problems, st.data())
def test_corrupted_step_is_caught_at_its_index(problem, data):
    operands, ops = problem
    row = arith.make_row(operands, ops, "train", 0)
    steps = solution_steps(operands, ops)
    k = data.draw(st.integers(0, len(steps) - 1), label="step")
    delta = data.draw(st.integers(-50, 50).filter(bool), label="delta")
    field = data.draw(st.sampled_from(["value", "left", "right"]), label="field")
    bad = steps[k]._replace(**{field: getattr(steps[k], field) + delta})
    if field == "right" and bad.right < 0:
        bad = bad._replace(right=steps[k].right + abs(delta))
    written = [arith.format_step(s) for s in steps[:k]] + [arith.format_step(bad)]
    verdicts = verify_steps(row, " " + "; ".join(written) + " #### 0")
    assert verdicts == [True] * k + [False]


@FAST
@given(st.integers(-(2**62), 2**62), st.text(alphabet="0123456789+-*=; ", max_size=30))
def test_extract_answer_round_trips(answer, prefix):
    assert extract_answer(f"{prefix} #### {answer}") == answer


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(1, 60),
       lo=st.integers(2, 4), span=st.integers(0, 2), ops=st.sampled_from(["+", "+-", "+-*", "*"]))
def test_determinism_and_disjoint_splits(seed, n, lo, span, ops):
    cfg = Config(min_operands=lo, max_operands=lo + span, operators=ops, max_value=99)
    sizes = {"test": n, "val": n, "train": 2 * n}
    first = generate_splits(cfg, sizes, seed)
    assert first == generate_splits(cfg, sizes, seed)
    assert first != generate_splits(cfg, sizes, seed + 1)
    questions = [{r["question"] for r in rows} for rows in first.values()]
    assert sum(map(len, questions)) == 4 * n                     # unique within each split
    assert len(set().union(*questions)) == 4 * n                 # and disjoint across splits
