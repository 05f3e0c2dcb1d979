"""TRACE (Kim & Yang, ICML 2026, arXiv 2605.29656): how well a chain of thought is *argued*.

Each CoT sentence gets a set of "constructive elements" (Toulmin: Claim, Data, Warrant, Backing,
Qualifier, Rebuttal; Flavell: Monitoring, Evaluation). The label sequence L = (l_1..l_n) scores

    V_state = (1/n) sum_i max_{s in S_allowed} J(l_i, s)       J = Jaccard, capped at 0.5 when
                                                                   l_i holds a Qualifier
    C_trans = mean_i mean_{u in l_i, v in l_{i+1}} w(u -> v)     an empty l_i or l_{i+1}: 0.5
    TRACE   = alpha V_state + (1 - alpha) C_trans,  alpha = 0.7

This module holds that math as small pure functions (`v_state`, `c_trans`, `trace_score`), the
tables as a pydantic `Tables` (the params file versions them, spec §6), the sentence splitter
used for BOTH tagger training and scoring (spec pitfall: a different splitter shifts every
label), the LLM-labeler output parser (malformed replies are counted, never raised), and the
tagger wrapper every stage loads. Stages: trace_label (tagger), trace_policy (CoT generators),
trace_score (TRACE per sample), trace_correlate, trace_rl; see pipelines/trace/README.md.

Departures: S_allowed and the transition weights are the spec's [reconstructed] defaults; a
sentence splitter by regex instead of spaCy (not installed; the texts are templated); C_trans
of a one-sentence CoT is `single_sentence_trans` (0.5, neutral) [ours], and an empty CoT scores 0.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LABELS = ("C", "D", "W", "B", "Q", "R", "M", "E")
NAMES = {"C": "Claim", "D": "Data", "W": "Warrant", "B": "Backing", "Q": "Qualifier",
         "R": "Rebuttal", "M": "Monitoring", "E": "Evaluation"}

# spec §2 "Defaults to implement" [reconstructed]
DEFAULT_ALLOWED = ["C", "D", "W", "B", "R", "E", "DC", "WC", "DW", "DWC", "BW", "BE", "ME", "RC",
                   "EC", "QC"]
DEFAULT_GOOD = ["D>C", "W>C", "D>W", "B>W", "M>E", "E>C", "R>C"]
DEFAULT_BAD = ["M>Q", "Q>Q", "Q>M", "M>M"]


def _labels_of(text: str, where: str) -> frozenset[str]:
    bad = sorted(set(text) - set(LABELS))
    if bad or not text:
        raise ValueError(f"{where} {text!r}: expected letters from {''.join(LABELS)}")
    return frozenset(text)


class Tables(BaseModel):
    """The combination (allowed-state) and transition tables: a versioned params block."""

    model_config = ConfigDict(extra="forbid")

    version: str = Field("spec-v1", description="name of this table version; reported with every "
                                                "number (spec §6)")
    alpha: float = Field(0.7, ge=0, le=1, description="weight of V_state [secondary: 0.7]")
    allowed: list[str] = Field(default_factory=lambda: list(DEFAULT_ALLOWED), min_length=1,
                               description="S_allowed, each state as letters, e.g. 'DWC'")
    qualifier_cap: float = Field(0.5, ge=0, le=1, description="J cap for a set holding Q")
    good: list[str] = Field(default_factory=lambda: list(DEFAULT_GOOD),
                            description="transitions u>v of weight good_weight")
    bad: list[str] = Field(default_factory=lambda: list(DEFAULT_BAD),
                           description="transitions u>v of weight bad_weight")
    good_weight: float = Field(1.0, ge=0, le=1)
    bad_weight: float = Field(0.0, ge=0, le=1)
    other_weight: float = Field(0.5, ge=0, le=1, description="every other transition")
    empty_weight: float = Field(0.5, ge=0, le=1, description="a pair with an empty label set")
    single_sentence_trans: float = Field(0.5, ge=0, le=1, description="C_trans with no pair [ours]")

    @field_validator("allowed")
    @classmethod
    def _states(cls, value: list[str]) -> list[str]:
        for s in value:
            _labels_of(s, "allowed state")
        return value

    @field_validator("good", "bad")
    @classmethod
    def _pairs(cls, value: list[str]) -> list[str]:
        for p in value:
            if not re.fullmatch(r"[CDWBQRME]>[CDWBQRME]", p):
                raise ValueError(f"transition {p!r}: expected 'u>v' with u, v in "
                                 f"{''.join(LABELS)}")
        return value

    @model_validator(mode="after")
    def _disjoint(self) -> "Tables":
        both = sorted(set(self.good) & set(self.bad))
        if both:
            raise ValueError(f"transitions {both} are both good and bad")
        return self

    def states(self) -> list[frozenset[str]]:
        return [frozenset(s) for s in self.allowed]

    def weight(self, u: str, v: str) -> float:
        pair = f"{u}>{v}"
        if pair in self.good:
            return self.good_weight
        if pair in self.bad:
            return self.bad_weight
        return self.other_weight


# --- the score ------------------------------------------------------------------------------

def jaccard(a: frozenset[str] | set[str], b: frozenset[str] | set[str]) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 0.0


def state_validity(labels: Iterable[str], tables: Tables) -> float:
    """max_{s in S_allowed} J(l, s), capped at `qualifier_cap` when l holds Q; 0 for l = {}."""
    l = frozenset(labels)
    if not l:
        return 0.0
    best = max(jaccard(l, s) for s in tables.states())
    return min(best, tables.qualifier_cap) if "Q" in l else best


def v_state(seq: Sequence[Iterable[str]], tables: Tables) -> float:
    """(1/n) sum_i max_s J(l_i, s); 0 for an empty sequence."""
    seq = [frozenset(l) for l in seq]
    return sum(state_validity(l, tables) for l in seq) / len(seq) if seq else 0.0


def c_trans(seq: Sequence[Iterable[str]], tables: Tables) -> float:
    """mean over consecutive pairs of mean_{u in l_i, v in l_(i+1)} w(u -> v)."""
    seq = [frozenset(l) for l in seq]
    if len(seq) < 2:
        return tables.single_sentence_trans if seq else 0.0
    total = 0.0
    for a, b in zip(seq, seq[1:]):
        if not a or not b:
            total += tables.empty_weight
            continue
        total += sum(tables.weight(u, v) for u in sorted(a) for v in sorted(b)) / (len(a) * len(b))
    return total / (len(seq) - 1)


def trace_score(seq: Sequence[Iterable[str]], tables: Tables) -> dict[str, float]:
    """{'v_state', 'c_trans', 'trace'} of one label sequence."""
    seq = [frozenset(l) for l in seq]
    if not seq:
        return {"v_state": 0.0, "c_trans": 0.0, "trace": 0.0}
    v, c = v_state(seq, tables), c_trans(seq, tables)
    return {"v_state": v, "c_trans": c, "trace": tables.alpha * v + (1 - tables.alpha) * c}


# --- text -----------------------------------------------------------------------------------

_SPLIT = re.compile(r"(?<=[.!?])\s+(?=\S)")


def cot_block(completion: str) -> str:
    """The chain of thought: the text before the final-answer marker `####`."""
    return completion.split("####", 1)[0].strip()


def split_sentences(text: str) -> list[str]:
    """Sentences: split after . ! ? followed by whitespace (so '3.5' and '12+7=19.' keep
    together); the same splitter labels the tagger's training sentences and the scored CoTs."""
    return [s.strip() for s in _SPLIT.split(text.strip()) if s.strip()]


def labels_str(labels: Iterable[str]) -> str:
    """Canonical string of a label set, in LABELS order ('' for none)."""
    s = set(labels)
    return "".join(l for l in LABELS if l in s)


_LLM_TOKEN = re.compile(r"[A-Za-z]+")
_BY_NAME = {v.lower(): k for k, v in NAMES.items()} | {"evidence": "D"}


def parse_llm_labels(reply: str) -> frozenset[str] | None:
    """Labels from an LLM labeler's reply, or None when it is malformed.

    Accepted: the first line lists labels as letters or names separated by commas/spaces
    ('C, D', 'Warrant Claim'), or 'none'. Anything else (unknown words, empty) is malformed:
    the caller counts it and uses the empty set, so a bad reply never stops a run."""
    line = reply.strip().splitlines()[0].strip() if reply.strip() else ""
    line = line.rstrip(".")
    words = _LLM_TOKEN.findall(line)
    if not words or re.search(r"[^A-Za-z,;/\s]", line):
        return None
    if len(words) == 1 and words[0].lower() == "none":
        return frozenset()
    out = set()
    for w in words:
        if w.upper() in LABELS and len(w) == 1:
            out.add(w.upper())
        elif w.lower() in _BY_NAME:
            out.add(_BY_NAME[w.lower()])
        else:
            return None
    return frozenset(out)


def llm_prompt(sentence: str) -> str:
    """A completion prompt with the element definitions (plain text: no chat template)."""
    defs = "; ".join(f"{k}={v}" for k, v in NAMES.items())
    return (f"Label the sentence with argument elements ({defs}). Reply with letters, comma "
            f"separated, or none.\nSentence: {sentence}\nLabels:")


# --- taggers --------------------------------------------------------------------------------

class ClassifierTagger:
    """The trained sentence tagger (TF-IDF + one-vs-rest logistic regression, 8 sigmoids)."""

    FILE = "tagger.pkl"

    def __init__(self, pipeline: Any, threshold: float = 0.5):
        self.pipeline = pipeline
        self.threshold = threshold
        self.malformed = 0  # a classifier never replies malformed; kept for a common interface

    @classmethod
    def load(cls, folder: str | Path) -> "ClassifierTagger":
        path = Path(folder) / cls.FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tagger there; run the `label` stage first")
        with path.open("rb") as f:
            blob = pickle.load(f)
        return cls(blob["pipeline"], blob["threshold"])

    def save(self, folder: str | Path) -> None:
        """Same fitted tagger, same bytes (a DVC output compared by hash): sklearn's
        vectorizers cache `_stop_words_id`, the memory address of their `stop_words`, which
        differs in every process; it is only a cache (recomputed when missing), so it is left
        out of the file."""
        for _, step in _estimators(self.pipeline):
            step.__dict__.pop("_stop_words_id", None)
        with (Path(folder) / self.FILE).open("wb") as f:
            pickle.dump({"pipeline": self.pipeline, "threshold": self.threshold}, f)

    def proba(self, sentences: Sequence[str]) -> Any:
        return self.pipeline.predict_proba(list(sentences))

    def tag(self, sentences: Sequence[str]) -> list[frozenset[str]]:
        if not sentences:
            return []
        p = self.proba(sentences)
        return [frozenset(LABELS[j] for j in range(len(LABELS)) if row[j] >= self.threshold)
                for row in p]


def _estimators(obj: Any) -> Iterable[tuple[str, Any]]:
    """Every estimator nested in a sklearn Pipeline / FeatureUnion (depth first), with itself."""
    yield "", obj
    for name, child in getattr(obj, "steps", None) or getattr(obj, "transformer_list", None) or []:
        for sub, est in _estimators(child):
            yield f"{name}.{sub}".rstrip("."), est


class LLMTagger:
    """Labels through the backend interface (`stages.models.backend`); malformed replies are
    counted in `malformed` and labelled with the empty set."""

    def __init__(self, backend: Any, max_new_tokens: int = 12):
        self.backend = backend
        self.max_new_tokens = max_new_tokens
        self.malformed = 0
        self.calls = 0

    def tag(self, sentences: Sequence[str]) -> list[frozenset[str]]:
        if not sentences:
            return []
        replies = self.backend.complete([llm_prompt(s) for s in sentences],
                                        max_new_tokens=self.max_new_tokens, temperature=0.0)
        out = []
        for r in replies:
            self.calls += 1
            got = parse_llm_labels(r[0].text if r else "")
            if got is None:
                self.malformed += 1
                got = frozenset()
            out.append(got)
        return out


def tag_cots(tagger: Any, cots: Sequence[str]) -> list[list[frozenset[str]]]:
    """Label sequences of many CoTs with one batched tagger call."""
    sents = [split_sentences(c) for c in cots]
    flat = tagger.tag([s for ss in sents for s in ss])
    out, i = [], 0
    for ss in sents:
        out.append(flat[i:i + len(ss)])
        i += len(ss)
    return out


def macro_f1(gold: Sequence[Iterable[str]], pred: Sequence[Iterable[str]]) -> dict[str, float]:
    """Per-label precision/recall/F1 over sentences, and their macro averages."""
    out: dict[str, float] = {}
    ps, rs, fs = [], [], []
    for lab in LABELS:
        tp = sum(1 for g, p in zip(gold, pred) if lab in g and lab in p)
        fp = sum(1 for g, p in zip(gold, pred) if lab not in g and lab in p)
        fn = sum(1 for g, p in zip(gold, pred) if lab in g and lab not in p)
        prec = tp / (tp + fp) if tp + fp else 0.0
        rec = tp / (tp + fn) if tp + fn else 0.0
        f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
        out[f"f1_{lab}"] = f1
        ps.append(prec), rs.append(rec), fs.append(f1)
    out["macro_precision"] = sum(ps) / len(ps)
    out["macro_recall"] = sum(rs) / len(rs)
    out["macro_f1"] = sum(fs) / len(fs)
    return out
