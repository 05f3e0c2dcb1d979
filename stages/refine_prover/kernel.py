"""The toy proof language and its kernel: integer linear (in)equalities, checked line by line,
with structured errors `(line, error_class, residual_goal)` (spec §4: the Lean stand-in).

A statement names its hypotheses h1..hn, one per variable, and a goal over the variables:

    x>=2,y=5|-3x+2y>=14        h1: x >= 2, h2: y = 5  |-  3x + 2y >= 14   (x, y integers)

A proof is lines separated by `;`. Each line either derives a new fact, closes the goal, or is
the forbidden `sorry`:

    h3:3x>=6 mul h1            scale h1 by a positive integer (the claim's LHS says by what)
    h4:2y=10 mul h2
    h5:3x+2y>=16 add h3 h4     add two facts
    lin h5                     h5 implies the goal: same left-hand side, a bound at least as strong

Rules (what `check` accepts; the claim may be weaker than what the rule derives, never stronger):

    mul hI   hI: L rel a,  claim: cL rel' n   with c >= 1 and  (rel = '=' : rel' '=' and n = c*a,
                                                                or rel' '>=' and n <= c*a;
                                                rel = '>=': rel' '>=' and n <= c*a)
    add hI hJ  claim LHS = L_I + L_J (as linear forms); rel' '=' needs both '=' and n = a+b;
               rel' '>=' needs n <= a+b
    lin hI   L_I = goal LHS; goal '>=' r: n >= r (hI '=' or '>='); goal '=' r: hI '=' and n = r

Errors (Lean's failure modes, spec §2 "feedback encoding"):

    syntax              a line that does not parse, a reused name, a zero coefficient
    unknown_identifier  a hypothesis or variable that does not exist (yet)
    type_mismatch       a claim the rule does not give; residual = what the rule derives
    tactic_failed       `lin hI` when hI does not imply the goal; residual = the goal
    unsolved_goals      the proof ends with the goal open; residual = the goal
    no_goals            a line after the goal was closed
    forbidden           `sorry` (the cheat the paper's pitfall list warns about)

Like Lean, the kernel recovers after an error: a failed `have` still adds its claimed fact (as
Lean elaborates the rest of the proof against the stated type), so later lines are checked and
every error is listed; the first error and its residual goal are what a refiner sees. Many
different wrong proofs share one signature: every wrong product in line 1 of the example gives
`(1, type_mismatch, 3x>=6)` (`signature_counts` measures it).

`certify_z3` proves a statement true with z3 (hypotheses and not-goal unsatisfiable over the
integers); `coq_source` writes the statement and a proof as a Coq theorem in which every line
is checked by `lia` from the facts it cites only (`clear - hI hJ; lia`), for `coq_cross_check`.
Known difference (`explain_disagreement`): `lia` accepts any claim its cited facts entail, the
kernel only the rule's shape (e.g. `h3:x>=2 mul h4` from h4: 3x>=6); z3 tells those apart.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

VARIABLES = "xyz"
RELS = (">=", "=")
ERROR_CLASSES = ("syntax", "unknown_identifier", "type_mismatch", "tactic_failed",
                 "unsolved_goals", "no_goals", "forbidden")
# Short codes in model prompts (a char-level model pays per character).
CLASS_CODE = {"syntax": "syn", "unknown_identifier": "unk", "type_mismatch": "mis",
              "tactic_failed": "tac", "unsolved_goals": "uns", "no_goals": "nog",
              "forbidden": "forb"}


class StatementError(ValueError):
    """A malformed statement (named before any proof is checked)."""


# --- facts: linear forms with a relation and a bound ----------------------------------------

@dataclass(frozen=True)
class Fact:
    """sum(coef * var) rel bound; `lhs` is sorted (var, coef) with coef >= 1."""

    lhs: tuple[tuple[str, int], ...]
    rel: str
    bound: int

    def __str__(self) -> str:
        return format_lhs(self.lhs) + self.rel + str(self.bound)


def format_lhs(lhs: Iterable[tuple[str, int]]) -> str:
    return "+".join(f"{c if c != 1 else ''}{v}" for v, c in lhs)


_TERM = re.compile(r"^(\d*)([a-z])$")
_FACT = re.compile(r"^([0-9a-z+]+)(>=|=)(-?\d+)$")


def parse_fact(text: str) -> Fact | None:
    """'3x+2y>=16' -> Fact; None when it does not parse (a zero or repeated term included).
    Terms keep the written order in the parse; equality of LHS is by sorted form."""
    m = _FACT.match(text.strip())
    if not m:
        return None
    terms: dict[str, int] = {}
    for part in m[1].split("+"):
        t = _TERM.match(part)
        if not t:
            return None
        coef = int(t[1]) if t[1] else 1
        if coef < 1 or t[2] in terms or len(t[1]) > 4:
            return None
        terms[t[2]] = coef
    return Fact(tuple(sorted(terms.items())), m[2], int(m[3]))


@dataclass(frozen=True)
class Statement:
    hyps: tuple[Fact, ...]       # h1..hn
    goal: Fact
    goal_text: str               # the goal as written (term order matters to the prover)

    @property
    def variables(self) -> tuple[str, ...]:
        return tuple(sorted({v for h in self.hyps for v, _ in h.lhs}))

    def __str__(self) -> str:
        return ",".join(str(h) for h in self.hyps) + "|-" + self.goal_text


def parse_statement(text: str) -> Statement:
    """'x>=2,y=5|-3x+2y>=14' -> Statement; StatementError naming the fault otherwise."""
    if text.count("|-") != 1:
        raise StatementError(f"statement {text!r}: expected one '|-' between hypotheses and goal")
    left, goal_text = text.split("|-")
    hyps = []
    for i, part in enumerate(left.split(","), start=1):
        fact = parse_fact(part)
        if fact is None or len(fact.lhs) != 1 or fact.lhs[0][1] != 1:
            raise StatementError(f"statement {text!r}: hypothesis h{i} = {part!r} is not "
                                 f"'<var>>=<int>' or '<var>=<int>'")
        hyps.append(fact)
    goal = parse_fact(goal_text)
    if goal is None:
        raise StatementError(f"statement {text!r}: goal {goal_text!r} does not parse")
    names = [h.lhs[0][0] for h in hyps]
    if len(set(names)) != len(names):
        raise StatementError(f"statement {text!r}: two hypotheses on one variable")
    unknown = {v for v, _ in goal.lhs} - set(names)
    if unknown:
        raise StatementError(f"statement {text!r}: goal uses {sorted(unknown)} without a "
                             f"hypothesis")
    return Statement(tuple(hyps), goal, goal_text.strip())


# --- the kernel --------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelError:
    line: int                    # 1-based line of the proof (n+1: the end, for unsolved goals)
    error_class: str
    residual_goal: str           # what the rule derives / the open goal ('' when none)
    message: str

    @property
    def signature(self) -> tuple[int, str, str]:
        return (self.line, self.error_class, self.residual_goal)

    def encode(self) -> str:
        """The feedback a refiner reads: 'L1 mis 3x>=6'."""
        tail = f" {self.residual_goal}" if self.residual_goal else ""
        return f"L{self.line} {CLASS_CODE[self.error_class]}{tail}"


@dataclass
class Result:
    ok: bool
    errors: list[KernelError] = field(default_factory=list)
    n_lines: int = 0

    @property
    def first(self) -> KernelError | None:
        return self.errors[0] if self.errors else None

    def feedback(self, max_errors: int = 1) -> str:
        """The first error (and how many more there are): the refiner's context."""
        if self.ok:
            return "ok"
        shown = " | ".join(e.encode() for e in self.errors[:max_errors])
        more = len(self.errors) - max_errors
        return shown + (f" +{more}" if more > 0 else "")


_HAVE = re.compile(r"^h(\d+):(\S+) (mul|add) (.+)$")
_LIN = re.compile(r"^lin (\S+)$")
_NAME = re.compile(r"^h\d+$")


def split_lines(proof: str) -> list[str]:
    return [ln.strip() for ln in proof.strip().split(";")] if proof.strip() else []


def _mul(src: Fact, claim: Fact) -> tuple[bool, Fact]:
    """(accepted, the fact the rule derives at the claim's multiplier)."""
    v0, c0 = src.lhs[0]
    got = dict(claim.lhs)
    coef = got.get(v0, c0) // c0 if got.get(v0, 0) % c0 == 0 else 1
    coef = max(coef, 1)
    derived = Fact(tuple((v, c * coef) for v, c in src.lhs), src.rel, src.bound * coef)
    return _entails(derived, claim), derived


def _add(a: Fact, b: Fact) -> Fact:
    lhs: dict[str, int] = dict(a.lhs)
    for v, c in b.lhs:
        lhs[v] = lhs.get(v, 0) + c
    rel = "=" if a.rel == b.rel == "=" else ">="
    return Fact(tuple(sorted(lhs.items())), rel, a.bound + b.bound)


def _entails(derived: Fact, claim: Fact) -> bool:
    """Same LHS and a bound no stronger: '=' gives '=' (same n) or '>=' (n <= bound)."""
    if derived.lhs != claim.lhs:
        return False
    if claim.rel == "=":
        return derived.rel == "=" and claim.bound == derived.bound
    return claim.bound <= derived.bound


def check(statement: Statement | str, proof: str) -> Result:
    """Check `proof` against `statement`; every error in line order (see the module docstring)."""
    st = parse_statement(statement) if isinstance(statement, str) else statement
    facts: dict[str, Fact] = {f"h{i}": h for i, h in enumerate(st.hyps, start=1)}
    variables = set(st.variables)
    lines = split_lines(proof)
    errors: list[KernelError] = []
    closed = False
    goal = str(st.goal)

    def err(i: int, cls: str, residual: str, msg: str) -> None:
        errors.append(KernelError(i, cls, residual, msg))

    for i, line in enumerate(lines, start=1):
        if closed:
            err(i, "no_goals", "", "no goals to prove")
            continue
        if line == "sorry":
            err(i, "forbidden", goal, "sorry is not allowed")
            continue
        if m := _LIN.match(line):
            name = m[1]
            if name not in facts:
                err(i, "unknown_identifier", "", f"unknown identifier {name!r}")
                continue
            fact = facts[name]
            if _closes(fact, st.goal):
                closed = True
            else:
                err(i, "tactic_failed", goal, f"lin failed: {fact} does not imply {goal}")
                closed = True       # Lean: the goal is closed with an error (no cascade)
            continue
        m = _HAVE.match(line)
        claim = parse_fact(m[2]) if m else None
        if m is None or claim is None:
            err(i, "syntax", "", f"cannot parse {line!r}")
            continue
        name, rule, args = f"h{m[1]}", m[3], m[4].split(" ")
        if name in facts or not _NAME.match(name) or m[1].startswith("0"):
            err(i, "syntax", "", f"name {name!r} is already used or malformed")
            continue
        if {v for v, _ in claim.lhs} - variables:
            err(i, "unknown_identifier", "", f"unknown variable in {claim}")
            continue
        if len(args) != (1 if rule == "mul" else 2):
            err(i, "syntax", "", f"{rule} takes {1 if rule == 'mul' else 2} facts, got {args}")
            continue
        missing = [a for a in args if a not in facts]
        if missing:
            err(i, "unknown_identifier", "", f"unknown identifier {missing[0]!r}")
            facts[name] = claim     # recovery: later lines see the claimed fact
            continue
        if rule == "mul":
            ok, derived = _mul(facts[args[0]], claim)
        else:
            derived = _add(facts[args[0]], facts[args[1]])
            ok = _entails(derived, claim)
        if not ok:
            err(i, "type_mismatch", str(derived), f"{rule} gives {derived}, not {claim}")
        facts[name] = claim
    if not closed:
        err(len(lines) + 1, "unsolved_goals", goal, "unsolved goals")
    return Result(ok=not errors, errors=errors, n_lines=len(lines))


def _closes(fact: Fact, goal: Fact) -> bool:
    if fact.lhs != goal.lhs:
        return False
    if goal.rel == "=":
        return fact.rel == "=" and fact.bound == goal.bound
    return fact.bound >= goal.bound


# --- statements and canonical proofs ------------------------------------------------------------

def random_statement(rng: random.Random, *, n_vars: tuple[int, int] = (2, 3), max_bound: int = 20,
                     max_coef: int = 9, max_slack: int = 3, p_equal: float = 0.3) -> str:
    """A true statement: hypotheses v rel a, goal sum c_v v rel r (r <= the exact sum; '=' only
    when every hypothesis is an equality). Goal terms in a random order."""
    k = rng.randint(*n_vars)
    names = sorted(rng.sample(VARIABLES, k))
    hyps = [(v, "=" if rng.random() < p_equal else ">=", rng.randint(0, max_bound)) for v in names]
    coefs = {v: rng.randint(1, max_coef) for v in names}
    total = sum(coefs[v] * a for v, _, a in hyps)
    all_eq = all(rel == "=" for _, rel, _ in hyps)
    if all_eq and rng.random() < 0.5:
        rel, bound = "=", total
    else:
        rel, bound = ">=", total - rng.randint(0, max_slack)
    order = names[:]
    rng.shuffle(order)
    goal = format_lhs((v, coefs[v]) for v in order) + rel + str(bound)
    return ",".join(f"{v}{r}{a}" for v, r, a in hyps) + "|-" + goal


def goal_terms(st: Statement) -> list[tuple[str, int]]:
    """The goal's (var, coef) terms in the order the goal is written."""
    lhs = re.split(r">=|=", st.goal_text)[0]
    return [(t[2], int(t[1]) if t[1] else 1) for t in map(_TERM.match, lhs.split("+")) if t]


def canonical_proof(statement: Statement | str) -> str:
    """The proof the base prover is trained on: scale each hypothesis by its goal coefficient (in
    the goal's term order), add them up left to right, close with lin."""
    st = parse_statement(statement) if isinstance(statement, str) else statement
    hyp_of = {h.lhs[0][0]: (f"h{i}", h) for i, h in enumerate(st.hyps, start=1)}
    order = goal_terms(st)
    lines, names, acc = [], [], None
    k = len(st.hyps)
    for v, c in order:
        name, h = hyp_of[v]
        k += 1
        fact = Fact(((v, c),), h.rel, h.bound * c)
        lines.append(f"h{k}:{fact} mul {name}")
        names.append((f"h{k}", fact))
    acc_name, acc = names[0]
    for name, fact in names[1:]:
        k += 1
        acc_new = _add(acc, fact)
        # Written in the goal's term order so the claim reads like the goal.
        seen = [v for v, _ in order if v in dict(acc_new.lhs)]
        text = format_lhs((v, dict(acc_new.lhs)[v]) for v in seen) + acc_new.rel + str(acc_new.bound)
        lines.append(f"h{k}:{text} add {acc_name} {name}")
        acc_name, acc = f"h{k}", acc_new
    lines.append(f"lin {acc_name}")
    return ";".join(lines)


# --- the scripted fixer (cold-start repairs) -----------------------------------------------

def scripted_fix(statement: Statement | str, proof: str, result: Result | None = None) -> str:
    """Fix the FIRST error only (spec §4: the cold-start oracle): a mismatched claim becomes what
    the rule derives; an unsolved goal gets `lin` of the last fact; lines after a closed goal go;
    a failed `lin` cites the last fact; anything else (syntax, unknown names, sorry) takes the
    canonical proof from that line on. The result may still fail further down (one repair)."""
    st = parse_statement(statement) if isinstance(statement, str) else statement
    result = result or check(st, proof)
    if result.ok:
        return proof
    e = result.errors[0]
    lines = split_lines(proof)
    names = [m[1] for ln in lines if (m := re.match(r"^(h\d+):", ln))]
    last = names[-1] if names else "h1"
    if e.error_class == "type_mismatch":
        name_rule = re.match(r"^(h\d+):\S+ (.*)$", lines[e.line - 1])
        assert name_rule is not None
        lines[e.line - 1] = f"{name_rule[1]}:{e.residual_goal} {name_rule[2]}"
    elif e.error_class == "unsolved_goals":
        lines.append(f"lin {last}")
    elif e.error_class == "no_goals":
        lines = lines[:e.line - 1]
    elif e.error_class == "tactic_failed":
        before = [m[1] for ln in lines[:e.line - 1] if (m := re.match(r"^(h\d+):", ln))]
        lines[e.line - 1] = f"lin {before[-1] if before else 'h1'}"
    else:
        # Keep the lines before the error; take the canonical lines that define what the kept
        # prefix does not (a name already used there would clash).
        kept = [ln for ln in lines[:e.line - 1] if ln != "sorry" and not _LIN.match(ln)]
        defined = {m[1] for ln in kept if (m := re.match(r"^(h\d+):", ln))}
        canon = [ln for ln in split_lines(canonical_proof(st))
                 if not ((m := re.match(r"^(h\d+):", ln)) and m[1] in defined)]
        lines = kept + canon
    return ";".join(lines)


def corrupt(proof: str, rng: random.Random) -> str:
    """A plausible wrong proof: one edit of the kinds a small prover makes (a wrong number, a
    wrong fact cited, a line dropped, a stray character, `sorry`)."""
    lines = split_lines(proof)
    kind = rng.choice(("number", "number", "number", "cite", "drop", "char", "sorry"))
    i = rng.randrange(len(lines))
    if kind == "number":
        nums = list(re.finditer(r"(?<=[=>])\d+", lines[i]))
        if nums:
            m = rng.choice(nums)
            val = int(m[0]) + rng.choice((-10, -2, -1, 1, 2, 10, 3))
            lines[i] = lines[i][:m.start()] + str(max(val, 0)) + lines[i][m.end():]
            return ";".join(lines)
        kind = "cite"
    if kind == "cite":
        cites = list(re.finditer(r"(?<= )h\d+", lines[i]))
        if cites:
            m = rng.choice(cites)
            lines[i] = lines[i][:m.start()] + f"h{rng.randint(1, len(lines) + 2)}" + lines[i][m.end():]
            return ";".join(lines)
        kind = "drop"
    if kind == "drop":
        del lines[i]
    elif kind == "char":
        pos = rng.randrange(len(lines[i]))
        lines[i] = lines[i][:pos] + rng.choice("0123456789xyh+= ") + lines[i][pos + 1:]
    else:
        lines[i] = "sorry"
    return ";".join(lines)


def signature_counts(pairs: Iterable[tuple[str, str]]) -> dict[str, float]:
    """The compression the paper rests on: over (statement, wrong proof) pairs, how many
    distinct wrong proofs share each first-error signature (statement, line, class, residual).
    Returns distinct wrong proofs, distinct signatures, proofs per signature (mean, max) and the
    share of wrong proofs whose signature some other wrong proof shares."""
    by_sig: dict[tuple, set[str]] = {}
    for st, proof in set(pairs):
        res = check(st, proof)
        if res.ok:
            continue
        by_sig.setdefault((st, *res.errors[0].signature), set()).add(proof)
    n_proofs = sum(len(v) for v in by_sig.values())
    n_sigs = len(by_sig)
    shared = sum(len(v) for v in by_sig.values() if len(v) > 1)
    classes = {c: 0 for c in ERROR_CLASSES}
    for sig, proofs in by_sig.items():
        classes[sig[2]] += len(proofs)
    return {"wrong_proofs": float(n_proofs), "signatures": float(n_sigs),
            "proofs_per_signature": n_proofs / n_sigs if n_sigs else float("nan"),
            "max_proofs_per_signature": float(max((len(v) for v in by_sig.values()), default=0)),
            "shared_share": shared / n_proofs if n_proofs else float("nan"),
            **{f"class_share/{c}": v / n_proofs if n_proofs else 0.0 for c, v in classes.items()}}


# --- certification with z3, cross-check with Coq -------------------------------------------------

def _z3_fact(fact: Fact, env: dict[str, Any]) -> Any:
    lhs = sum(c * env[v] for v, c in fact.lhs)
    return lhs == fact.bound if fact.rel == "=" else lhs >= fact.bound


def certify_z3(statement: Statement | str) -> bool:
    """True iff z3 proves the statement over the integers (hyps and not goal: unsat)."""
    import z3

    st = parse_statement(statement) if isinstance(statement, str) else statement
    env = {v: z3.Int(v) for v in st.variables}
    s = z3.Solver()
    s.add(*[_z3_fact(h, env) for h in st.hyps])
    s.add(z3.Not(_z3_fact(st.goal, env)))
    return s.check() == z3.unsat


def entailed_z3(premises: Sequence[Fact], claim: Fact, variables: Sequence[str]) -> bool:
    """Does `claim` follow from `premises` over the integers (what `clear - ...; lia` decides)?"""
    import z3

    env = {v: z3.Int(v) for v in variables}
    s = z3.Solver()
    s.add(*[_z3_fact(p, env) for p in premises])
    s.add(z3.Not(_z3_fact(claim, env)))
    return s.check() == z3.unsat


def _coq_fact(fact: Fact | str) -> str:
    f = parse_fact(fact) if isinstance(fact, str) else fact
    assert f is not None
    lhs = " + ".join(f"{c} * {v}" for v, c in f.lhs)
    return f"{lhs} {f.rel} {f.bound}"


def coq_source(statement: Statement | str, proof: str) -> str:
    """The statement as a Coq theorem over Z and the proof as tactics, each line checked by
    `lia` from the facts it cites only; a line the translation cannot express fails (`fail`)."""
    st = parse_statement(statement) if isinstance(statement, str) else statement
    binders = " ".join(f"({v} : Z)" for v in st.variables)
    hyps = " ".join(f"(h{i} : {_coq_fact(h)})" for i, h in enumerate(st.hyps, start=1))
    tactics = []
    for line in split_lines(proof):
        if line == "sorry":
            tactics.append("admit.")
        elif m := _LIN.match(line):
            tactics.append(f"clear - {m[1]}; lia." if _NAME.match(m[1]) else "fail.")
        elif (m := _HAVE.match(line)) and (claim := parse_fact(m[2])) is not None and \
                all(_NAME.match(a) for a in m[4].split(" ")) and \
                len(m[4].split(" ")) == (1 if m[3] == "mul" else 2):
            tactics.append(f"assert (h{m[1]} : {_coq_fact(claim)}) by "
                           f"(clear - {' '.join(m[4].split(' '))}; lia).")
        else:
            tactics.append("fail.")
    body = "\n  ".join(tactics)
    return ("Require Import ZArith Lia.\nOpen Scope Z_scope.\n"
            f"Theorem t {binders} {hyps} : {_coq_fact(st.goal)}.\nProof.\n  {body}\nQed.\n")


def coqc_path() -> str | None:
    return shutil.which("coqc")


def coq_accepts(statement: Statement | str, proof: str, coqc: str, timeout: float = 60) -> bool:
    """Run coqc on `coq_source`; True iff it compiles (Qed accepted)."""
    with tempfile.TemporaryDirectory(prefix="refine-prover-coq-") as tmp:
        src = Path(tmp) / "T.v"
        src.write_text(coq_source(statement, proof))
        done = subprocess.run([coqc, "-q", str(src)], cwd=tmp, capture_output=True, text=True,
                              timeout=timeout)
        return done.returncode == 0


def explain_disagreement(statement: Statement | str, proof: str) -> str:
    """Why the kernel and `lia` disagree on a proof: 'lia_entails_non_rule_claim' when the first
    line the kernel rejects is a claim its cited facts entail (lia accepts any entailed claim,
    the kernel only its rule's shape); 'unexplained' otherwise."""
    st = parse_statement(statement) if isinstance(statement, str) else statement
    res = check(st, proof)
    if res.ok or res.errors[0].error_class != "type_mismatch":
        return "unexplained"
    facts = {f"h{i}": h for i, h in enumerate(st.hyps, start=1)}
    for i, line in enumerate(split_lines(proof), start=1):
        m = _HAVE.match(line)
        claim = parse_fact(m[2]) if m else None
        if m and claim is not None and i == res.errors[0].line:
            cited = [facts[a] for a in m[4].split(" ") if a in facts]
            if entailed_z3(cited, claim, st.variables):
                return "lia_entails_non_rule_claim"
            return "unexplained"
        if m and claim is not None:
            facts[f"h{m[1]}"] = claim
    return "unexplained"


def coq_cross_check(pairs: Sequence[tuple[str, str]], coqc: str | None = None
                    ) -> dict[str, Any]:
    """Kernel vs Coq's `lia` on (statement, proof) pairs: agreement and each disagreement with
    its explanation. Skipped with a reason when there is no coqc (`coqc_path()`)."""
    coqc = coqc or coqc_path()
    if coqc is None:
        return {"ran": False, "reason": "coqc not found on PATH (Debian: apt-get install coq)"}
    rows = []
    for st, proof in pairs:
        kernel = check(st, proof).ok
        coq = coq_accepts(st, proof, coqc)
        rows.append({"statement": st, "proof": proof, "kernel": kernel, "coq": coq,
                     "explanation": "" if kernel == coq else explain_disagreement(st, proof)})
    agree = sum(r["kernel"] == r["coq"] for r in rows)
    return {"ran": True, "n": len(rows), "agree": agree,
            "unexplained": sum(r["explanation"] == "unexplained" for r in rows), "rows": rows}
