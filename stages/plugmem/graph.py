"""PlugMem's memory: structured facts -> a knowledge graph of facts, tags and subgoals ->
retrieval by votes and similarity -> reasoning (condensation). Pure functions over numpy.

Paper: Yang et al., "PlugMem: a task-agnostic plugin memory module for LLM agents", arXiv
2603.03296 (ICML 2026), section 3; official code github.com/TIMAN-group/PlugMem (`plugmem/`).

Structuring output (paper's fact-extraction prompt):

    **Statement:** <fact, at most 4 sentences, pronouns resolved> **Tags:** [tag, tag, ...]

or `NONE` when a step states no fact (ours: the paper's prompt returns an empty list).
`parse_structured` validates it exactly: a reply that does not match counts as a parse failure
(the pitfall "parsing fails silently" of the spec), never as an empty memory.

Graph (code, `close()` and insertion):
    Semantic node   statement, embedding, tags, time, is_active (credibility is computed in
                    the code but never enters the ranking: not modelled, see README)
    Tag node        the tag string (deduplicated by exact string), embedding, importance, and
                    the facts it indexes
    Subgoal node    one per segment; a new segment starts when the cosine of consecutive step
                    embeddings is < tau_seg (paper 0.75 on NV-Embed-v2; recalibrated here)
    Merge           a new fact that updates an active one (`same_fact`: equal statements once
                    the value, the last tag, is masked) deactivates it: the later fact wins (the
                    code asks an LLM for UPDATE_SAME_FACT / SAME_TOPIC_MERGE_WELL; a rule here,
                    [reconstructed]; MiniLM puts "the user's sister lives in Paris" nearer to
                    "the user lives in Paris" than "the user lives in Oslo" is, so no cosine
                    threshold separates updates from other people's facts)

Retrieval, semantic mode (the mode the code fixes for QA benchmarks):
    A          = top-`top_a` (5) active facts by cos(query, fact)
    per query tag: the best tag node with cos >= tau_tag (paper 0.8), k = 1; each fact under it
               gets a vote: 5 x importance if the tag string equals the query tag, else
               importance; facts in A get +2
    candidates = voted facts U A, ranked by cos(query, fact), top-`top_k` (10)
    reason     = the LLM condenses the block to the facts that answer (verbatim); here the top
               `keep` facts in time order, `keep` calibrated on validation [reconstructed]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

STATEMENT_RE = re.compile(r"^\*\*Statement:\*\* (?P<s>[^*\[\]]+?) \*\*Tags:\*\* \[(?P<t>[^\[\]]*)\]$")
STOP = frozenset("a an the is are was were does do did what where who which when how now of "
                 "in on at to for by with and or s user's".split())


class ParseError(ValueError):
    """A structurer reply that is neither `NONE` nor `**Statement:** ... **Tags:** [...]`."""


def parse_structured(text: str) -> list[tuple[str, list[str]]]:
    """The facts in one structuring reply: [] for `NONE`, else [(statement, tags)] (one fact
    per line). Raises ParseError on anything else."""
    text = text.strip()
    if text == "NONE":
        return []
    out = []
    for line in text.splitlines():
        m = STATEMENT_RE.match(line.strip())
        if m is None:
            raise ParseError(f"not a `**Statement:** ... **Tags:** [...]` line: {line[:80]!r}")
        tags = [t.strip() for t in m["t"].split(",") if t.strip()]
        out.append((m["s"].strip(), tags))
    if not out:
        raise ParseError("empty structuring reply")
    return out


def query_tags(question: str) -> list[str]:
    """The query's tags: capitalised spans (entity names) and content words, verbatim. The
    paper's planner LLM emits 5-12 mostly verbatim tags; here a rule [reconstructed]."""
    words = re.findall(r"[A-Za-z']+", question)
    tags, span = [], []
    for k, w in enumerate(words):
        if w[0].isupper() and k > 0:
            span.append(w)
            continue
        if span:
            tags.append(" ".join(span))
            span = []
        if w.lower() not in STOP and len(w) > 2:
            tags.append(w.lower().removesuffix("'s"))
    if span:
        tags.append(" ".join(span))
    return list(dict.fromkeys(tags))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity matrix of row vectors (embeddings need not be normalised)."""
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return a @ b.T


def segments(step_emb: np.ndarray, tau_seg: float) -> list[int]:
    """Segment id per step: a new segment where cos(step t-1, step t) < tau_seg."""
    seg, out = 0, []
    for t in range(len(step_emb)):
        if t and float(cosine(step_emb[t - 1:t], step_emb[t:t + 1])[0, 0]) < tau_seg:
            seg += 1
        out.append(seg)
    return out


@dataclass
class Graph:
    """One memory: semantic nodes (facts), tag nodes and subgoal nodes, in insertion order."""
    dim: int
    statements: list[str] = field(default_factory=list)
    times: list[tuple[int, int]] = field(default_factory=list)
    fact_tags: list[list[str]] = field(default_factory=list)
    active: list[bool] = field(default_factory=list)
    tag_index: dict[str, list[int]] = field(default_factory=dict)   # tag -> facts
    tag_importance: dict[str, float] = field(default_factory=dict)
    subgoals: list[np.ndarray] = field(default_factory=list)
    merges: int = 0

    def __post_init__(self) -> None:
        self._emb = np.zeros((0, self.dim), dtype=np.float32)

    @property
    def emb(self) -> np.ndarray:
        return self._emb

    def insert(self, statement: str, emb: np.ndarray, tags: list[str], time: tuple[int, int],
               merge: bool = True) -> int:
        """Add a fact. With `merge`, an active fact that `same_fact` calls the same fact with
        another value is deactivated: the later fact wins. Returns the new fact's id."""
        if merge:
            for j, on in enumerate(self.active):
                if on and same_fact(self.statements[j], self.fact_tags[j], statement, tags):
                    self.active[j] = False
                    self.merges += 1
        fid = len(self.statements)
        self.statements.append(statement)
        self.times.append(time)
        self.fact_tags.append(list(tags))
        self.active.append(True)
        self._emb = np.vstack([self._emb, emb[None].astype(np.float32)])
        for t in dict.fromkeys(tags):                   # tags deduplicated by exact string
            self.tag_index.setdefault(t, []).append(fid)
            self.tag_importance.setdefault(t, 1.0)
        return fid


def _residue(statement: str, tags: list[str]) -> str | None:
    if not tags or tags[-1] not in statement:
        return None
    head, _, tail = statement.rpartition(tags[-1])
    return head + "_" + tail


def same_fact(old: str, old_tags: list[str], new: str, new_tags: list[str]) -> bool:
    """UPDATE_SAME_FACT: the two statements are equal once their value (the last tag, a
    verbatim span) is masked, and the values differ ("The user lives in _." twice). The code
    asks the structuring LLM; this rule is [reconstructed]."""
    a, b = _residue(old, old_tags), _residue(new, new_tags)
    return a is not None and a == b and old_tags[-1] != new_tags[-1]


def vote(graph: Graph, q_emb: np.ndarray, q_tags: list[str], q_tag_emb: np.ndarray,
         tag_emb: dict[str, np.ndarray], *, top_a: int, tau_tag: float,
         use_tags: bool = True) -> dict[int, float]:
    """Votes per active candidate fact (the code's semantic retrieval, module docstring)."""
    live = np.flatnonzero(graph.active)
    if not len(live):
        return {}
    sims = cosine(q_emb[None], graph.emb[live])[0]
    a = live[np.argsort(-sims, kind="stable")[:top_a]]
    votes: dict[int, float] = {int(j): 2.0 for j in a}
    if not use_tags or not graph.tag_index:
        return votes
    names = list(graph.tag_index)
    mat = np.stack([tag_emb[n] for n in names])
    sim = cosine(q_tag_emb, mat) if len(q_tags) else np.zeros((0, len(names)))
    for i, qt in enumerate(q_tags):
        best = int(np.argmax(sim[i]))
        if sim[i, best] < tau_tag:
            continue
        name = names[best]
        w = graph.tag_importance[name] * (5.0 if name.lower() == qt.lower() else 1.0)
        for f in graph.tag_index[name]:
            if graph.active[f]:
                votes[f] = votes.get(f, 0.0) + w
    return votes


def retrieve(graph: Graph, q_emb: np.ndarray, votes: dict[int, float], top_k: int) -> list[int]:
    """Candidates ranked by cos(query, fact), the top `top_k` (fact ids, best first)."""
    ids = sorted(votes)
    if not ids:
        return []
    sims = cosine(q_emb[None], graph.emb[ids])[0]
    order = np.argsort(-sims, kind="stable")[:top_k]
    return [ids[i] for i in order]


def reason(graph: Graph, ranked: list[int], keep: int) -> list[str]:
    """Condensation: the `keep` best facts, verbatim, in time order (later last, so a reader
    that takes the last matching fact follows "later fact wins")."""
    kept = sorted(ranked[:keep], key=lambda f: graph.times[f])
    return [graph.statements[f] for f in kept]


def mention(value: str) -> re.Pattern[str]:
    """`value` as a whole word: not inside a longer word (`cat` is not in `catfish`). Written
    with lookarounds, not `\\b`, so that a value that starts or ends with a non-word character
    (`C++`, `3.5`) still matches where it stands alone."""
    return re.compile(rf"(?<!\w){re.escape(value)}(?!\w)")


def perfect_reader(memory: str, answer: str, stale: list[str]) -> bool:
    """The upper-bound reader: right iff the answer is in the memory and, where the asked
    value changed, it is mentioned after every earlier value (later fact wins)."""
    def last(v: str) -> int:
        m = [x.start() for x in mention(v).finditer(memory)]
        return m[-1] if m else -1
    pos = last(answer)
    return pos >= 0 and all(last(s) < pos for s in stale if s != answer)


LINE_BUCKETS = ("1", "2", "3", "4+", "absent")   # `line_bucket`'s names, in table order


def answer_line(memory: list[str], answer: str) -> int:
    """1-based line of the memory block that last mentions the answer as a word (the line a
    reader should copy from: later fact wins), 0 when no line does."""
    word = mention(answer)
    hits = [i for i, line in enumerate(memory, 1) if word.search(line)]
    return hits[-1] if hits else 0


def line_bucket(line: int) -> str:
    return "absent" if line == 0 else (str(line) if line <= 3 else "4+")


def density(acc_mem: float, acc_nomem: float, tokens: float) -> float:
    """[reconstructed] (Acc_mem - Acc_nomem) per 1000 memory tokens in the reader's prompt
    (spec section 2); NaN without memory tokens."""
    return (acc_mem - acc_nomem) / tokens * 1000.0 if tokens > 0 else float("nan")
