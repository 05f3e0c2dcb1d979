"""Task family `toulmin`: arith problems whose worked solutions are argued in Toulmin sentences.

The question, prompt, answer and exact verifier are arith's (stages/tasks/arith.py: left to right,
the integer after `####`), so every arith consumer (the GRPO verifier reward, greedy accuracy)
works unchanged. What differs is the chain of thought: short sentences built from templates, one
template per Toulmin/Flavell role, so every sentence carries gold labels (spec §4 "CoT
generator"):

    Q: 12+7=? A: We have 12 and 7. Adding joins both. So 12+7=19. Let me check. 19-7=12, right.
                 #### 19
    gold:        {D}               {W}               {C}          {M}            {E}

A trace is `good` (data, warrant, claim per step; sometimes backing, rebuttal, a hedged claim;
a check at the end) or one of the poorly structured kinds of the spec: `unsupported` (bare claims,
no data or warrant), `hedge_loop` (stacked qualifiers), `monitor_loop` (M -> M chains, no
evaluation), `no_warrant` (data and claims only). Any kind may contain a wrong step (an off-by-k
result carried to the end): with probability `good_error_rate` for good traces and
`degenerate_error_rate` otherwise, so structure correlates with correctness without being it.

Labeller sentences (`sentences`) come from the same templates with paraphrase noise (dropped
words, swapped letters, case), multi-role sentences, label-free fillers and label-free random
character strings (what a half-trained policy writes).
Everything is deterministic in the seed (private `random.Random`).
"""

from __future__ import annotations

import random
import string
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from stages.tasks import arith as arith_family  # not `arith`: that name is a Config field

FAMILY = "toulmin"
KINDS = ("good", "unsupported", "hedge_loop", "monitor_loop", "no_warrant")
DEGENERATE = KINDS[1:]

extract_answer = arith_family.extract_answer
verify_answer = arith_family.verify_answer


class Config(BaseModel):
    """How the traces are argued and how often they are wrong."""

    model_config = ConfigDict(extra="forbid")

    arith: arith_family.Config = Field(default_factory=lambda: arith_family.Config(max_operands=3),
                                description="the problems (arith difficulty knobs)")
    good_error_rate: float = Field(0.05, ge=0, le=1, description="P(a wrong step) in a good trace")
    degenerate_error_rate: float = Field(0.5, ge=0, le=1,
                                         description="P(a wrong step) in a poorly structured trace")
    noise: float = Field(0.15, ge=0, le=1, description="P(paraphrase noise) per labeller sentence")
    multi_role: float = Field(0.25, ge=0, le=1,
                              description="share of compound (multi-role) labeller sentences")
    garbage: float = Field(0.05, ge=0, le=1,
                           description="share of random-character labeller sentences with no "
                                       "label (a half-trained policy writes such text)")
    policy_variants: int = Field(1, ge=1, le=10,
                                 description="templates per role used in the SFT traces (the "
                                             "first k of each list; the tagger sees all): a "
                                             "tiny policy learns one phrasing per role fast")
    max_chars: int = Field(230, ge=40, le=100_000,
                           description="longest prompt + target; a longer trace is redrawn "
                                       "(the tiny policy's context is 256 tokens, one per char)")


# --- sentence templates, one role set each --------------------------------------------------
# Fields: a, b (operands of the step), o (operator), c (its result), s ('sum'/'difference'),
# i (the inverse operator), n (the answer). Keep them short: the policy sees ~256 characters.

T: dict[str, list[str]] = {
    # The first template of each list is the short form the SFT traces use (policy_variants: 1):
    # few new characters for a character-level policy that has only seen digits.
    "D": ["Given {a},{b}.", "We have {a} and {b}.", "The numbers are {a} and {b}.",
          "Take {a} and {b}.", "Start from {a}, then {b}."],
    "W+": ["Add.", "Adding joins both.", "A sum counts both parts.", "Plus means add."],
    "W-": ["Sub.", "Subtracting takes {b} away.", "A difference removes {b}.",
           "Minus means remove."],
    "C": ["So {a}{o}{b}={c}.", "Thus {a}{o}{b}={c}.", "Hence {a}{o}{b}={c}.",
          "That gives {a}{o}{b}={c}.", "{a}{o}{b}={c}."],
    "B": ["Rule holds.", "Sums are well defined.", "Counting backs this.",
          "Place value backs it."],
    "R": ["Unless typo.", "Unless a sign is misread.", "But not if {b} is negative."],
    "RC": ["Still {a}{o}{b}={c}.", "Still, it gives {c}."],
    "QC": ["Maybe {a}{o}{b}={c}.", "Probably {a}{o}{b}={c}.", "I guess {a}{o}{b}={c}."],
    "Q": ["Maybe.", "Perhaps.", "Probably.", "Not sure."],
    "M": ["Check.", "Let me check.", "Wait, let me verify.", "Hmm, let me see."],
    "E": ["{c}{i}{b}={a} ok.", "Yes, that holds.", "It matches.", "{c}{i}{b}={a}, correct."],
    "EC": ["Verified, {n}.", "Checked, so it is {n}.", "Verified, the answer is {n}."],
    "WC+": ["Add: {a}+{b}={c}.", "By adding, {a}+{b}={c}."],
    "WC-": ["Sub: {a}-{b}={c}.", "By subtracting, {a}-{b}={c}."],
    "DC": ["From {a},{b}: {c}.", "From {a} and {b}, we get {c}."],
    "DWC": ["Since {a}{o}{b} is a {s}, {c}.", "Since {a}{o}{b} is a {s}, it is {c}."],
    "BW": ["Rule holds, so {w}.", "The rule is exact, so {w}."],
    "BE": ["By the rule, correct.", "The rule confirms it."],
    "ME": ["Check: {c}{i}{b}={a}.", "Checking, {c}{i}{b}={a} holds."],
    "": ["Ok.", "Right.", "Now.", "Next."],
}

# Multi-role sentence templates (labeller only; the traces use WC/DC/DWC/QC/RC/EC/ME).
COMPOUND = ["WC", "DC", "DWC", "BW", "BE", "ME", "RC", "EC", "QC"]
SINGLE = ["D", "W", "C", "B", "Q", "R", "M", "E", ""]


def _fields(step: arith_family.Step, answer: int) -> dict[str, Any]:
    return {"a": step.left, "b": step.right, "o": step.op, "c": step.value,
            "s": "sum" if step.op == "+" else "difference", "i": "-" if step.op == "+" else "+",
            "w": "add" if step.op == "+" else "subtract",
            "n": answer}


def sentence(rng: random.Random, role: str, step: arith_family.Step, answer: int,
             variants: int | None = None) -> tuple[str, str]:
    """(text, gold labels) of one sentence of `role` ('W' picks the operator's warrant), from
    the first `variants` templates of the role (None: all)."""
    key = f"{role}{step.op}" if role in ("W", "WC") else role
    text = rng.choice(T[key][:variants]).format(**_fields(step, answer))
    return text, "".join(sorted(role, key="CDWBQRME".index))


def _wrong(rng: random.Random, steps: list[arith_family.Step]) -> list[arith_family.Step]:
    """The same steps with one result off by 1..9, carried through the later steps."""
    k = rng.randrange(len(steps))
    out, value = [], steps[0].left
    for i, s in enumerate(steps):
        new = arith_family.apply(value, s.op, s.right)
        if i == k:
            new += rng.choice([-1, 1]) * rng.randint(1, 9)
        out.append(arith_family.Step(value, s.op, s.right, new))
        value = new
    return out


def build_trace(rng: random.Random, steps: list[arith_family.Step], kind: str,
                variants: int | None = None) -> list[tuple[str, str]]:
    """The sentences (text, labels) of one trace of `kind` over the (possibly wrong) steps."""
    n = steps[-1].value
    out: list[tuple[str, str]] = []

    def say(role: str, step: arith_family.Step) -> None:
        out.append(sentence(rng, role, step, n, variants))

    for j, s in enumerate(steps):
        if kind == "good":
            r = rng.random()
            if r < 0.15:
                say("DWC", s)
            elif r < 0.30:
                say("D", s), say("WC", s)
            else:
                say("D", s), say("W", s)
                if rng.random() < 0.15:
                    say("B", s)
                if rng.random() < 0.1:
                    say("QC", s)
                else:
                    say("C", s)
            if rng.random() < 0.1:
                say("R", s), say("RC", s)
        elif kind == "unsupported":
            say("C", s)
        elif kind == "hedge_loop":
            for _ in range(rng.randint(1, 2)):
                say("Q", s)
            say("QC", s)
        elif kind == "monitor_loop":
            if j == 0:
                say("D", s)
            say("M", s), say("M", s)
            say("C", s)
        elif kind == "no_warrant":
            say("D", s), say("C", s)
        else:
            raise ValueError(f"unknown trace kind {kind!r}: expected one of {KINDS}")
    last = steps[-1]
    if kind == "good":
        r = rng.random()
        if r < 0.6:
            say("M", last), say("E", last)
        elif r < 0.8:
            say("ME", last)
        else:
            say("M", last), say("E", last), say("EC", last)
    elif kind == "monitor_loop":
        say("M", last)
    return out


def make_trace(rng: random.Random, cfg: Config, operands: list[int], ops: list[str],
               kind: str) -> dict[str, Any]:
    """One SFT row: prompt, Toulmin target, per-sentence gold labels, and whether it is right."""
    truth = arith_family.solution_steps(operands, ops)
    rate = cfg.good_error_rate if kind == "good" else cfg.degenerate_error_rate
    steps = _wrong(rng, truth) if rng.random() < rate else truth
    question = arith_family.format_question(operands, ops)
    room = cfg.max_chars - len(arith_family.format_prompt(question)) - len(f" #### {steps[-1].value}")
    for _ in range(50):
        sents = build_trace(rng, steps, kind, cfg.policy_variants)
        if len(" ".join(t for t, _ in sents)) + 1 <= room:
            break
    else:
        raise ValueError(f"toulmin: no {kind} trace of {question} fits max_chars = "
                         f"{cfg.max_chars}; raise it or use fewer operands")
    return {"question": question, "prompt": arith_family.format_prompt(question),
            "target": " " + " ".join(t for t, _ in sents) + f" #### {steps[-1].value}",
            "answer": truth[-1].value, "kind": kind,
            "correct": steps[-1].value == truth[-1].value,
            "sentences": [t for t, _ in sents], "labels": [l for _, l in sents]}


def traces(cfg: Config, rows: list[dict[str, Any]], seed: int | str) -> list[dict[str, Any]]:
    """For each arith row, one good trace and one trace of every poorly structured kind."""
    rng = random.Random(f"{FAMILY}:traces:{seed}")
    out = []
    for row in rows:
        operands, ops = arith_family.parse_question(row["question"])
        for kind in KINDS:
            out.append({"id": row["id"], **make_trace(rng, cfg, operands, ops, kind)})
    return out


# --- labeller sentences ---------------------------------------------------------------------

def _noise(rng: random.Random, text: str) -> str:
    """Paraphrase noise: drop a word, swap two letters, or lower-case the first letter."""
    words = text.split()
    r = rng.random()
    if r < 0.4 and len(words) > 2:
        del words[rng.randrange(1, len(words))]
        return " ".join(words)
    if r < 0.8 and len(text) > 4:
        i = rng.randrange(len(text) - 1)
        return text[:i] + text[i + 1] + text[i] + text[i + 2:]
    return text[:1].lower() + text[1:]


NOISERS: dict[str, Callable[[random.Random, str], str]] = {"default": _noise}


def sentences(cfg: Config, n: int, seed: int | str, split: str) -> list[dict[str, str]]:
    """`n` labelled sentences for the tagger: text, labels (canonical letters, '' = none)."""
    rng = random.Random(f"{FAMILY}:sentences:{split}:{seed}")
    out = []
    for _ in range(n):
        a, b = rng.randint(cfg.arith.min_value, cfg.arith.max_value), \
            rng.randint(cfg.arith.min_value, cfg.arith.max_value)
        op = rng.choice(cfg.arith.operators)
        step = arith_family.Step(a, op, b, arith_family.apply(a, op, b))
        if rng.random() < cfg.garbage:
            chars = string.ascii_letters + string.digits + string.punctuation + "     "
            text = "".join(rng.choice(chars) for _ in range(rng.randint(2, 40)))
            out.append({"text": text, "labels": "", "split": split})
            continue
        role = rng.choice(COMPOUND if rng.random() < cfg.multi_role else SINGLE)
        text, labels = sentence(rng, role, step, step.value)
        if rng.random() < cfg.noise:
            text = _noise(rng, text)
        out.append({"text": text, "labels": labels, "split": split})
    return out
