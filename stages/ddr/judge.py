"""The judge and the metrics of DDR-Bench (arXiv 2602.02039, section 3; official evaluator).

The paper's judge (gpt-5-mini) sees the numbered insights `[Message i]`, a checklist question
and its gold answer, and returns the JSON contract

    {"context_quality": CORRECT_INFO | INCORRECT_INFO | INSUFFICIENT_INFO,
     "supporting_message_indices": [...], "contradicting_message_indices": [...],
     "evidence_text": "...", "reasoning": "..."}

Here the judge is deterministic fact matching on the same contract (spec section 4): a message
is a list of facts ({column: value}, `stages.ddr.env.result_facts`); it *supports* an item when
one of its facts is about the item's object (the binding) and states the item's aspect with the
gold value, and *contradicts* it when it states the aspect with another value. Strict, like the
paper's MIMIC prompt: an item both supported and contradicted takes the latest message's side.
A `Judge` is anything with `judge(question, answer, messages) -> contract`, so an LLM judge
through the backend can replace it.

Two scorings per item, as in the paper: against the per-turn messages I_m, and against the
final summary I_t (here: every fact the run stated, the last statement of each fact winning,
what a FINISH summary built from the run's notes says).

Metrics: accuracy (share CORRECT) sample-averaged (mean over entities of the per-entity share)
and item-averaged (over all items), incorrect and insufficient shares, and the top-k message
curve: an item is correct at k when it is CORRECT and all its supporting indices are < k.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from stages.ddr.world import answer_matches

CORRECT, INCORRECT, INSUFFICIENT = "CORRECT_INFO", "INCORRECT_INFO", "INSUFFICIENT_INFO"
QUALITIES = (CORRECT, INCORRECT, INSUFFICIENT)

Facts = list[dict[str, str]]


@dataclass(frozen=True)
class ItemSpec:
    """What the judge is told about an item: the question and the gold answer (and, for the
    deterministic judge, which fact states it)."""

    question: str
    answer: str
    aspect: str
    binding: dict[str, str]
    kind: str


class Judge(Protocol):
    def judge(self, item: ItemSpec, messages: Sequence[Facts]) -> dict[str, Any]: ...


def _about(fact: dict[str, str], item: ItemSpec) -> bool:
    return item.aspect in fact and all(
        str(fact.get(k, "")).lower() == str(v).lower() for k, v in item.binding.items())


def message_text(facts: Facts) -> str:
    """How a message reads: its facts as `k=v` lists (the observation's own rendering)."""
    return "; ".join(", ".join(f"{k}={v}" for k, v in f.items()) for f in facts) or "NO INSIGHT"


class FactMatchJudge:
    """Deterministic fact matching on the paper's contract (module docstring)."""

    name = "fact_match"

    def judge(self, item: ItemSpec, messages: Sequence[Facts]) -> dict[str, Any]:
        support, contra = [], []
        for i, facts in enumerate(messages):
            about = [f for f in facts if _about(f, item)]
            if any(answer_matches(f[item.aspect], item.answer, item.kind) for f in about):
                support.append(i)
            elif about:
                contra.append(i)
        if support and (not contra or max(support) > max(contra)):
            quality = CORRECT
        elif contra:
            quality = INCORRECT
        else:
            quality = INSUFFICIENT
        evidence = [message_text(messages[i])[:200] for i in (support or contra)[:2]]
        return {"context_quality": quality, "supporting_message_indices": support,
                "contradicting_message_indices": contra, "evidence_text": " | ".join(evidence),
                "reasoning": f"{len(support)} message(s) state {item.aspect} = {item.answer}, "
                             f"{len(contra)} another value"}


def summary_message(messages: Sequence[Facts]) -> list[Facts]:
    """I_t as one message: every fact stated, where a later statement of the same fact (same
    non-value columns) replaces an earlier one."""
    latest: dict[str, dict[str, str]] = {}
    for facts in messages:
        for f in facts:
            latest[json.dumps(sorted(f.keys()) + [f.get("item", "")])] = f
    return [list(latest.values())]


def check_contract(out: dict[str, Any], n_messages: int) -> dict[str, Any]:
    """A judge's reply checked against the JSON contract (an LLM judge can break it)."""
    keys = {"context_quality", "supporting_message_indices", "contradicting_message_indices",
            "evidence_text", "reasoning"}
    if set(out) != keys:
        raise ValueError(f"judge reply keys {sorted(out)}: the contract has {sorted(keys)}")
    if out["context_quality"] not in QUALITIES:
        raise ValueError(f"context_quality {out['context_quality']!r}: one of {QUALITIES}")
    for key in ("supporting_message_indices", "contradicting_message_indices"):
        bad = [i for i in out[key] if not (isinstance(i, int) and 0 <= i < n_messages)]
        if bad:
            raise ValueError(f"{key}: {bad} are not message indices 0..{n_messages - 1}")
    return out


def correct_at_k(verdict: dict[str, Any], k: int) -> bool:
    """The top-k rule: CORRECT and every supporting message among the first k."""
    return (verdict["context_quality"] == CORRECT
            and all(i < k for i in verdict["supporting_message_indices"]))


def accuracies(qualities: Sequence[tuple[Any, str]]) -> dict[str, float]:
    """(entity, quality) per item -> sample- and item-averaged accuracy, incorrect and
    insufficient shares (item-averaged)."""
    n = len(qualities)
    if n == 0:
        raise ValueError("no judged item")
    per: dict[Any, list[bool]] = {}
    for entity, q in qualities:
        per.setdefault(entity, []).append(q == CORRECT)
    return {"acc_sample": sum(sum(v) / len(v) for v in per.values()) / len(per),
            "acc_item": sum(q == CORRECT for _, q in qualities) / n,
            "incorrect": sum(q == INCORRECT for _, q in qualities) / n,
            "insufficient": sum(q == INSUFFICIENT for _, q in qualities) / n}
