"""Stage `memory`: every arm's memory for every question, PlugMem's thresholds recalibrated on
the validation seeds first (never on eval).

Arms (the memory block the reader gets; chunks and facts one per line):

    none                    no memory
    raw                     raw-memory RAG: the top-`raw_k` chunks (user turn + assistant
                            reply, or a passage) by cos(question, chunk), in time order
    bm25                    the top-`raw_k` chunks by BM25 (rank-bm25's Okapi), in time order
    plugmem                 the learned structurer's facts in the graph (stages.plugmem.graph):
                            votes over tags + top-A, ranked by cosine, top-k, then reasoning
                            (condensed to `keep` facts, time order)
    plugmem_no_reasoning    the same top-k retrieved facts passed verbatim, ranked order
    plugmem_no_tags         no tag votes: candidates are the top-A facts only, then reasoning
    oracle                  [upper bound] the oracle parser's gold facts in the same PlugMem

The train seeds get `none`, `bm25`, `oracle` and `oracle_no_reasoning`: the reader's training
data (no structurer output there, so the reader never sees eval-time structurer errors in
training). Recalibration on `val` (learned structurer, every noise level), objective the
perfect reader's accuracy (`graph.perfect_reader`: the answer is in the memory and later than
every stale value), coordinate-wise: tau_tag (paper 0.8) at keep = top_k, then the smallest
`keep` within `keep_tolerance` of the best; tau_seg (paper 0.75) by boundary F1 against the
session boundaries (segments and subgoal nodes are built but the semantic mode the code uses for
QA does not read them; reported only).

`paths.plugmem_contexts` (parquet): split, seed, noise, arm, qid, kind, question, answer, stale,
memory (JSON list of lines), perfect (0/1).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import polars as pl
from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.core import io
from stages.core.checks import ColumnSpec, FrameSpec, read_parquet_checked
from stages.models.embed import EmbedConfig, EmbeddingCache
from stages.plugmem import graph as G
from stages.plugmem.corpus import obs_spec, question_spec
from stages.plugmem.structure import structured_spec

ARMS = ("none", "raw", "bm25", "plugmem", "plugmem_no_reasoning", "plugmem_no_tags", "oracle")
TRAIN_ARMS = ("none", "bm25", "oracle", "oracle_no_reasoning")
SCHEMA = {"split": pl.String, "seed": pl.Int64, "noise": pl.Int64, "arm": pl.String,
          "qid": pl.String, "kind": pl.String, "question": pl.String, "answer": pl.String,
          "stale": pl.String, "memory": pl.String, "perfect": pl.Int64}


def context_spec() -> FrameSpec:
    cols = {k: ColumnSpec(dtype=v) for k, v in SCHEMA.items()}
    cols["split"] = ColumnSpec(dtype=pl.String, values=("train", "eval"))
    cols["arm"] = ColumnSpec(dtype=pl.String, values=tuple(dict.fromkeys(ARMS + TRAIN_ARMS)))
    cols["perfect"] = ColumnSpec(dtype=pl.Int64, min=0, max=1)
    return FrameSpec(cols, min_rows=1)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str] = Field(min_length=1, description=f"eval arms, from {ARMS}")
    embed: EmbedConfig = Field(default_factory=EmbedConfig)
    noise_levels: list[int] = Field(min_length=1, description="the corpus's levels to evaluate")
    raw_k: int = Field(5, ge=1, le=100, description="chunks for raw and BM25 retrieval")
    top_a: int = Field(5, ge=1, le=100, description="[code] facts by cosine before voting")
    top_k: int = Field(10, ge=1, le=100, description="[code] candidates kept after ranking")
    tau_tag: float = Field(0.8, description="[code] tag match threshold (NV-Embed-v2); the "
                           "starting point when `recalibrate`")
    tau_seg: float = Field(0.75, description="[code] segmentation threshold (NV-Embed-v2)")
    keep: int = Field(3, ge=1, le=100, description="[reconstructed] facts the reasoning step "
                      "keeps, when not recalibrated")
    recalibrate: bool = Field(True, description="choose tau_tag, keep and tau_seg on val")
    tau_tag_grid: list[float] = Field(default_factory=lambda: [0.5, 0.6, 0.7, 0.8, 0.9, 1.01])
    tau_seg_grid: list[float] = Field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6,
                                                               0.75, 0.9])
    keep_tolerance: float = Field(0.02, ge=0, le=1, description="keep: the smallest within this "
                                  "much perfect-reader accuracy of the best")

    @field_validator("arms")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if a not in ARMS]
        if bad or len(set(v)) != len(v) or "none" not in v:
            raise ValueError(f"memory.arms {v}: unknown {bad}, repeated, or without `none` "
                             f"(density needs it); arms: {ARMS}")
        return v


def words(s: str) -> list[str]:
    return re.findall(r"\w+", s.lower())


class Haystack:
    """One sample at one noise level: its chunks in time order and its facts per source."""

    def __init__(self, rows: pl.DataFrame, learned: dict[str, list]) -> None:
        rows = rows.sort("session", "turn")
        self.chunks = rows["chunk"].to_list()
        self.times = list(zip(rows["session"], rows["turn"]))
        self.sessions = rows["session"].to_list()
        self.facts = {"oracle": [], "learned": []}
        for f, tags, txt, t in zip(rows["fact"], rows["tags"], rows["text"], self.times):
            if f:
                self.facts["oracle"].append((f, json.loads(tags), t))
            for s, tg in learned.get(txt, []):
                self.facts["learned"].append((s, tg, t))
        self._bm25 = None

    def graph(self, source: str, emb: EmbeddingCache) -> G.Graph:
        facts = self.facts[source]
        vecs = emb([f for f, _, _ in facts])
        g = G.Graph(dim=vecs.shape[1] if len(facts) else 1)
        for (f, tags, t), v in zip(facts, vecs):
            g.insert(f, v, tags, t)
        return g

    def raw(self, q_vec: np.ndarray, emb: EmbeddingCache, k: int) -> list[str]:
        sims = G.cosine(q_vec[None], emb(self.chunks))[0]
        top = sorted(np.argsort(-sims, kind="stable")[:k])
        return [self.chunks[i] for i in top]

    def bm25(self, question: str, k: int) -> list[str]:
        from rank_bm25 import BM25Okapi

        if self._bm25 is None:
            self._bm25 = BM25Okapi([words(c) for c in self.chunks])
        scores = self._bm25.get_scores(words(question))
        top = sorted(np.argsort(-scores, kind="stable")[:k])
        return [self.chunks[i] for i in top]


def plugmem_memory(g: G.Graph, question: str, emb: EmbeddingCache, *, top_a: int, top_k: int,
                   tau_tag: float, use_tags: bool, keep: int | None) -> list[str]:
    """PlugMem's semantic retrieval then reasoning (`keep` facts, time order), or without
    reasoning (`keep` None: the top-k block verbatim, ranked order)."""
    if not g.statements:
        return []
    q = emb([question])[0]
    qt = G.query_tags(question)
    tag_emb = {t: v for t, v in zip(g.tag_index, emb(list(g.tag_index)))}
    votes = G.vote(g, q, qt, emb(qt), tag_emb, top_a=top_a, tau_tag=tau_tag,
                   use_tags=use_tags)
    ranked = G.retrieve(g, q, votes, top_k)
    if keep is None:
        return [g.statements[f] for f in ranked]
    return G.reason(g, ranked, keep)


def haystacks(obs: pl.DataFrame, learned: dict[str, list], split: str, levels: list[int]
              ) -> dict[tuple[int, int, str], Haystack]:
    out = {}
    part = obs.filter(pl.col("split") == split)
    for n in levels:
        kept = part.filter((pl.col("noise_rank") < n) | (pl.col("noise_rank") == -1))
        for (seed, sample), rows in kept.group_by("seed", "sample", maintain_order=True):
            out[(int(seed), n, str(sample))] = Haystack(rows, learned)
    return out


def calibrate(cfg: Config, hay: dict, qs: pl.DataFrame, emb: EmbeddingCache
              ) -> dict[str, float]:
    """tau_tag, keep and tau_seg on the validation haystacks (module docstring)."""
    graphs = {k: h.graph("learned", emb) for k, h in hay.items()}
    items = [(k, q, a, json.loads(st)) for k in hay
             for q, a, st in qs.filter((pl.col("seed") == k[0]) & (pl.col("sample") == k[2]))
             .select("question", "answer", "stale").iter_rows()]

    def score(tau: float, keep: int | None, use_tags: bool = True) -> float:
        hits = [G.perfect_reader("\n".join(plugmem_memory(
            graphs[k], q, emb, top_a=cfg.top_a, top_k=cfg.top_k, tau_tag=tau,
            use_tags=use_tags, keep=keep)), a, st) for k, q, a, st in items]
        return float(np.mean(hits)) if hits else float("nan")

    out: dict[str, float] = {}
    tag_scores = {t: score(t, cfg.top_k) for t in cfg.tau_tag_grid}
    best = max(tag_scores.values())
    # ties: the threshold nearest the paper's 0.8
    tau_tag = min((t for t, s in tag_scores.items() if s == best), key=lambda t: abs(t - 0.8))
    keep_scores = {k: score(tau_tag, k) for k in range(1, cfg.top_k + 1)}
    top = max(keep_scores.values())
    keep = min(k for k, s in keep_scores.items() if s >= top - cfg.keep_tolerance)
    for t, s in tag_scores.items():
        out[f"val/tau_tag_{t:g}"] = s
    for k, s in keep_scores.items():
        out[f"val/keep_{k}"] = s
    # segmentation: boundary F1 against session starts, over the chat samples
    seg_f1 = {}
    for tau in cfg.tau_seg_grid:
        tp = fp = fn = 0
        for h in hay.values():
            if len(set(h.sessions)) < 2:
                continue
            seg = G.segments(emb(h.chunks), tau)
            for t in range(1, len(seg)):
                pred, gold = seg[t] != seg[t - 1], h.sessions[t] != h.sessions[t - 1]
                tp += pred and gold
                fp += pred and not gold
                fn += gold and not pred
        seg_f1[tau] = 2 * tp / max(2 * tp + fp + fn, 1)
        out[f"val/tau_seg_{tau:g}"] = seg_f1[tau]
    tau_seg = max(seg_f1, key=lambda t: (seg_f1[t], -abs(t - 0.75)))
    out.update({"tau_tag": tau_tag, "keep": float(keep), "tau_seg": tau_seg})
    return out


def arm_memory(arm: str, h: Haystack, g: dict[str, G.Graph], question: str,
               emb: EmbeddingCache, cfg: Config, th: dict[str, float]) -> list[str]:
    kw = dict(top_a=cfg.top_a, top_k=cfg.top_k, tau_tag=th["tau_tag"])
    keep = int(th["keep"])
    if arm == "none":
        return []
    if arm == "raw":
        return h.raw(emb([question])[0], emb, cfg.raw_k)
    if arm == "bm25":
        return h.bm25(question, cfg.raw_k)
    if arm == "plugmem":
        return plugmem_memory(g["learned"], question, emb, use_tags=True, keep=keep, **kw)
    if arm == "plugmem_no_reasoning":
        return plugmem_memory(g["learned"], question, emb, use_tags=True, keep=None, **kw)
    if arm == "plugmem_no_tags":
        return plugmem_memory(g["learned"], question, emb, use_tags=False, keep=keep, **kw)
    if arm == "oracle":
        return plugmem_memory(g["oracle"], question, emb, use_tags=True, keep=keep, **kw)
    if arm == "oracle_no_reasoning":
        return plugmem_memory(g["oracle"], question, emb, use_tags=True, keep=None, **kw)
    raise ValueError(f"unknown arm {arm!r}")


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    corpus = ctx.path("plugmem_corpus")
    obs = read_parquet_checked(corpus / "obs.parquet", obs_spec())
    qs = read_parquet_checked(corpus / "questions.parquet", question_spec())
    structured = read_parquet_checked(ctx.path("plugmem_structured"), structured_spec())
    present = sorted(set(obs["noise_rank"].to_list()) - {-1})
    top_level = (max(present) + 1) if present else 0
    if max(cfg.noise_levels) > top_level:
        raise ValueError(f"memory.noise_levels {cfg.noise_levels}: the corpus holds at most "
                         f"{top_level} distractors per session (corpus.noise_levels)")
    learned = {t: json.loads(f) for t, f in zip(structured["text"], structured["facts"])}
    emb = EmbeddingCache(cfg.embed)
    # embed every text once, in one batch (chunks, facts, tags, questions, query tags); the
    # train seeds' chunks are never embedded (their arms are BM25 and oracle facts)
    chunks = obs.filter(pl.col("split") != "train")["chunk"]
    texts = [*chunks, *obs["fact"].filter(obs["fact"] != ""), *qs["question"]]
    texts += [t for tags in obs["tags"] for t in json.loads(tags)]
    texts += [s for fs in learned.values() for s, tags in fs] + \
        [t for fs in learned.values() for _, tags in fs for t in tags]
    texts += [t for q in qs["question"] for t in G.query_tags(q)]
    emb.add(texts)

    out: dict[str, float] = {}
    if cfg.recalibrate:
        val = haystacks(obs, learned, "val", cfg.noise_levels)
        out.update(calibrate(cfg, val, qs.filter(pl.col("split") == "val"), emb))
    else:
        out.update({"tau_tag": cfg.tau_tag, "keep": float(cfg.keep), "tau_seg": cfg.tau_seg})
    rows = []
    merges: dict[str, list[int]] = {"learned": [], "oracle": []}
    for split, arms in (("train", TRAIN_ARMS), ("eval", tuple(cfg.arms))):
        hay = haystacks(obs, learned, split, cfg.noise_levels)
        questions = qs.filter(pl.col("split") == split)
        by_sample = {k: g for k, g in questions.group_by("seed", "sample")}
        for (seed, noise, sample), h in hay.items():
            sources = {s for a in arms for s in (("oracle",) if a.startswith("oracle") else
                                                 ("learned",) if a.startswith("plugmem") else ())}
            g = {s: h.graph(s, emb) for s in sources}
            if split == "eval":
                for s, gg in g.items():
                    merges[s].append(gg.merges)
            for r in by_sample[(seed, sample)].iter_rows(named=True):
                stale = json.loads(r["stale"])
                for arm in arms:
                    mem = arm_memory(arm, h, g, r["question"], emb, cfg, out)
                    rows.append({"split": split, "seed": seed, "noise": noise, "arm": arm,
                                 "qid": r["qid"], "kind": r["kind"], "question": r["question"],
                                 "answer": r["answer"], "stale": r["stale"],
                                 "memory": json.dumps(mem),
                                 "perfect": int(G.perfect_reader("\n".join(mem), r["answer"],
                                                                 stale))})
    frame = pl.DataFrame(rows, schema=SCHEMA)
    io.write_parquet(ctx.path("plugmem_contexts"), frame)
    ev = frame.filter(pl.col("split") == "eval")
    for arm in cfg.arms:
        out[f"perfect/{arm}"] = float(ev.filter(pl.col("arm") == arm)["perfect"].mean())
    for s, m in merges.items():
        if m:
            out[f"merges_per_sample/{s}"] = float(np.mean(m))
    out["train_contexts"] = float(frame.height - ev.height)
    return out


def headline(details: dict[str, float]) -> dict[str, float]:
    return {k: details[k] for k in ("tau_tag", "keep", "tau_seg")}
