"""Stage `problems` of Refine-Prover: toy statements, certified true, and the kernel's checks.

Splits of random true statements (`kernel.random_statement`, unique across splits):
`train` (the base prover's and refiner's SFT data), `value` (search logs for the value model)
and `test` (the arms). Every statement is certified true by z3 before anything is trained
(a false statement stops the stage). Then:

- the canonical proof of every statement is accepted by the kernel (a kernel that rejects a true
  proof fails the stage), and every one-character tampering of a sample of them is checked:
  `tamper_rejected_share` (a tampering can be harmless, e.g. a weaker bound; those are counted
  and must also satisfy lia, see below);
- the compression statistics on synthetic wrong proofs (`kernel.signature_counts`; the base
  prover's own failures are measured by `search`);
- the cross-check with Coq's `lia` (`kernel.coq_cross_check`) on a sample of canonical and
  wrong proofs, where `coqc` exists: agreement and unexplained disagreements; without coqc the
  stage says so (`coq_ran` 0) and the rows are not written.

    python -m stages refine_prover problems
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.core import io
from stages.refine_prover import kernel

SPLITS = ("train", "value", "test")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sizes: dict[str, int] = Field(description="statements per split: train, value, test")
    min_vars: int = Field(2, ge=1, le=3, description="fewest variables in a statement")
    max_vars: int = Field(3, ge=1, le=3, description="most variables")
    max_bound: int = Field(20, ge=0, le=10_000, description="largest hypothesis bound")
    max_coef: int = Field(9, ge=1, le=999, description="largest goal coefficient")
    max_slack: int = Field(3, ge=0, le=1000, description="goal bound below the exact sum by "
                                                         "at most this")
    p_equal: float = Field(0.3, ge=0, le=1, description="share of equality hypotheses")
    tamper_sample: int = Field(50, ge=0, description="canonical proofs tampered character by "
                                                     "character")
    wrong_per_statement: int = Field(4, ge=0, description="synthetic wrong proofs per test "
                                                          "statement (compression statistics)")
    coq_sample: int = Field(20, ge=0, description="(statement, proof) pairs checked by coqc "
                                                  "(half canonical, half wrong)")
    out: str = Field("refine_prover_problems", description="paths key of the problems folder")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if set(self.sizes) != set(SPLITS) or any(v < 1 for v in self.sizes.values()):
            raise ValueError(f"sizes = {self.sizes}: expected >= 1 statements for exactly "
                             f"{list(SPLITS)}")
        if self.min_vars > self.max_vars:
            raise ValueError(f"min_vars {self.min_vars} > max_vars {self.max_vars}")
        return self


def problem_spec() -> Any:
    import polars as pl

    from stages.core.checks import spec_from_schema

    schema = {"id": pl.String, "split": pl.String, "statement": pl.String, "proof": pl.String}
    return spec_from_schema(schema, id={"unique": True}, statement={"unique": True},
                            split={"values": list(SPLITS)})


def make_statements(cfg: Config, seed: int) -> list[dict[str, str]]:
    rng = random.Random(f"refine_prover:{seed}")
    seen: set[str] = set()
    rows = []
    for split in ("test", "value", "train"):          # held-out first (stable under growth)
        n = 0
        while n < cfg.sizes[split]:
            st = kernel.random_statement(rng, n_vars=(cfg.min_vars, cfg.max_vars),
                                         max_bound=cfg.max_bound, max_coef=cfg.max_coef,
                                         max_slack=cfg.max_slack, p_equal=cfg.p_equal)
            if st in seen:
                continue
            seen.add(st)
            rows.append({"id": f"rp-{split}-{n:05d}", "split": split, "statement": st,
                         "proof": kernel.canonical_proof(st)})
            n += 1
    return rows


def tamper_all(proof: str) -> list[str]:
    """Every one-character substitution of `proof` by a character of the language's alphabet."""
    alphabet = sorted(set("0123456789xyzh+=>:; ") | set("mulad ino"))
    out = []
    for i, ch in enumerate(proof):
        for a in alphabet:
            if a != ch:
                out.append(proof[:i] + a + proof[i + 1:])
    return out


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import polars as pl

    rows = make_statements(cfg, ctx.seed)
    uncertified = [r["statement"] for r in rows if not kernel.certify_z3(r["statement"])]
    if uncertified:
        raise ValueError(f"z3 could not prove {len(uncertified)} statements true, e.g. "
                         f"{uncertified[:3]}: the generator is wrong")
    rejected = [r for r in rows if not kernel.check(r["statement"], r["proof"]).ok]
    if rejected:
        raise ValueError(f"the kernel rejects {len(rejected)} canonical proofs, e.g. "
                         f"{rejected[0]['statement']!r} / {rejected[0]['proof']!r}")
    rng = random.Random(ctx.seed)
    test = [r for r in rows if r["split"] == "test"]

    # One-character tampering: the kernel must reject what changes the proof's meaning; a
    # tampering it accepts must still be a correct proof (a weaker but entailed claim), which
    # z3 checks line by line through the cross-check's entailment (lia's semantics).
    tampered = accepted_ok = accepted_bad = 0
    for r in rng.sample(rows, min(cfg.tamper_sample, len(rows))):
        for t in tamper_all(r["proof"]):
            tampered += 1
            if kernel.check(r["statement"], t).ok:
                if kernel.certify_z3(r["statement"]) and _lines_entailed(r["statement"], t):
                    accepted_ok += 1
                else:
                    accepted_bad += 1
    if accepted_bad:
        raise ValueError(f"the kernel accepted {accepted_bad} tampered proofs with a line its "
                         f"cited facts do not entail")

    wrong = [(r["statement"], kernel.corrupt(r["proof"], rng))
             for r in test for _ in range(cfg.wrong_per_statement)]
    sig = kernel.signature_counts(wrong)

    sample = [(r["statement"], r["proof"]) for r in rng.sample(test, min(len(test),
                                                                          cfg.coq_sample // 2))]
    sample += wrong[:cfg.coq_sample - len(sample)]
    coq = kernel.coq_cross_check(sample) if cfg.coq_sample else {"ran": False,
                                                                 "reason": "coq_sample = 0"}
    out = ctx.path(cfg.out)
    with io.atomic_path(out, is_dir=True) as tmp:
        io.write_parquet(tmp / "problems.parquet", pl.DataFrame(rows))
        io.write_json(tmp / "coq_cross_check.json", coq)
    print(f"problems: {len(rows)} statements certified by z3; tampering {tampered} proofs, "
          f"{accepted_ok} accepted (entailed); coq: "
          f"{coq.get('agree', 0)}/{coq.get('n', 0)} agree" if coq["ran"]
          else f"problems: coq cross-check skipped: {coq['reason']}")
    metrics = {f"n_{s}": float(cfg.sizes[s]) for s in SPLITS}
    metrics.update({"z3_certified_share": 1.0, "tampered": float(tampered),
                    "tamper_rejected_share": 1 - accepted_ok / max(tampered, 1),
                    "coq_ran": float(coq["ran"])})
    if coq["ran"]:
        metrics.update({"coq_n": float(coq["n"]), "coq_agreement": coq["agree"] / max(coq["n"], 1),
                        "coq_unexplained": float(coq["unexplained"])})
    metrics.update({f"synthetic/{k}": v for k, v in sig.items()})
    return metrics


def _lines_entailed(statement: str, proof: str) -> bool:
    """Every derived line and the closing lin follow from the facts they cite (z3): the proof is
    correct under lia's semantics."""
    st = kernel.parse_statement(statement)
    facts = {f"h{i}": h for i, h in enumerate(st.hyps, start=1)}
    for line in kernel.split_lines(proof):
        if m := kernel._HAVE.match(line):
            claim = kernel.parse_fact(m[2])
            if claim is None or not kernel.entailed_z3([facts[a] for a in m[4].split(" ")],
                                                       claim, st.variables):
                return False
            facts[f"h{m[1]}"] = claim
        elif m := kernel._LIN.match(line):
            if not kernel.entailed_z3([facts[m[1]]], st.goal, st.variables):
                return False
    return True


def headline(details: dict[str, float]) -> dict[str, float]:
    keys = {"n_test": "n_test", "tamper_rejected_share": "tamper_rejected_share",
            "coq_agreement": "coq_agreement",
            "proofs_per_signature": "synthetic/proofs_per_signature"}
    return {short: details[k] for short, k in keys.items() if k in details}
