"""Hallucination metrics, per image so that arms can be paired image by image: CHAIR over an
exact object vocabulary and POPE-style yes/no counting. The one implementation the vision
substrate's gates (stages/evaluate/vlm_gates.py) and the papers (GIFT) share.

CHAIR (Rohrbach et al., 2018), over an exact object vocabulary instead of COCO's synonym lists:
- an object class is a phrase "<colour> <shape>" (e.g. "red circle"); a caption MENTIONS a class
  when the phrase, or its plural ("red circles", "red boxes"), occurs as whole words
  (lowercased; punctuation ignored). A bare shape word ("a circle") names no class and counts
  nowhere. Each class counts once per caption (set semantics, however often it is repeated).
- a mention is HALLUCINATED when the class is not among the image's objects.
- CHAIR_S = share of captions with at least one hallucinated mention (every caption counts, also
  one that mentions nothing); CHAIR_I = hallucinated mentions / all mentions, over all captions
  (a ratio of sums, not a mean of per-image ratios).
- beside them, object precision / recall / F1 pooled over captions (correct mentions against
  mentions and against the classes really present): a caption that names nothing never
  hallucinates, so CHAIR is read next to recall.

POPE (Li et al., 2023): yes/no existence questions; "yes" is the positive class.
- an answer is read from its first word: "yes" or "no"; anything else is UNPARSED, counted as a
  non-yes answer (it is wrong on a positive, right on a negative) and reported in `unparsed`.
- accuracy, precision, recall and F1 of "yes", and yes_ratio (the share of yes answers: a model
  biased to "yes" shows it here first).

Per-image records are plain dicts (one row of a parquet table each). Aggregates take optional
`idx` (indices into the records, repeats allowed) so `paired_bootstrap` can resample images
with `stages.core.stats.percentile_ci`, and `stats.claim_from_ci` turns the interval into the
house verdict. A per-image mean (CHAIR_S, POPE accuracy) can go straight to
`stats.paired_ci(..., method="bootstrap")` on `chair_sentence` / `correct` columns.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from stages.core import stats

Record = dict[str, Any]


# --- CHAIR ---------------------------------------------------------------------------------------

def _words(text: str) -> str:
    """' red circle and blue square ': lowercased words padded with spaces for whole-word search."""
    return " " + " ".join(re.findall(r"[a-z]+", text.lower())) + " "


def _plural(phrase: str) -> str:
    return phrase + ("es" if re.search(r"(s|x|z|ch|sh)$", phrase) else "s")


def _check_vocabulary(vocabulary: Sequence[str]) -> list[str]:
    phrases = [_words(p).strip() for p in vocabulary]
    bad = [p for p, q in zip(vocabulary, phrases) if not q or q != p.lower().strip()]
    repeated = sorted({q for q in phrases if phrases.count(q) > 1})
    if bad or repeated:
        raise ValueError(f"the object vocabulary must be distinct phrases of words (e.g. 'red "
                         f"circle'); not plain words: {bad}, repeated: {repeated}")
    return phrases


def mentioned_objects(caption: str, vocabulary: Sequence[str]) -> set[str]:
    """Classes of `vocabulary` that `caption` mentions (singular or plural phrase, whole words)."""
    text = _words(caption)
    return {p for p in _check_vocabulary(vocabulary)
            if f" {p} " in text or f" {_plural(p)} " in text}


def chair_per_image(captions: Sequence[str], objects: Sequence[Sequence[str]],
                    vocabulary: Sequence[str]) -> list[Record]:
    """One record per caption: mentioned and hallucinated class counts and chair_sentence (0/1).
    `objects[k]` lists the classes really in image k (repeats allowed); each must be in the
    vocabulary, otherwise a hallucination could not be told from a missing class."""
    if len(captions) != len(objects):
        raise ValueError(f"{len(captions)} captions but {len(objects)} object lists")
    vocab = set(_check_vocabulary(vocabulary))
    records = []
    for k, (caption, truth) in enumerate(zip(captions, objects)):
        present = {t.lower().strip() for t in truth}
        unknown = sorted(present - vocab)
        if unknown:
            raise ValueError(f"image {k}: objects {unknown} are not in the object vocabulary")
        mentioned = mentioned_objects(caption, vocabulary)
        hallucinated = mentioned - present
        records.append({"mentioned": len(mentioned), "hallucinated": len(hallucinated),
                        "correct": len(mentioned & present), "missed": len(present - mentioned),
                        "chair_sentence": float(bool(hallucinated)),
                        "hallucinated_objects": sorted(hallucinated)})
    return records


def chair(records: Sequence[Record], idx: Sequence[int] | None = None) -> dict[str, float]:
    """CHAIR_S and CHAIR_I over the records (or the resampled `idx`); CHAIR_I is NaN when no
    caption mentions any object. See `objects_f1` for precision / recall / F1."""
    rows = [records[i] for i in (range(len(records)) if idx is None else idx)]
    if not rows:
        raise ValueError("CHAIR needs at least one caption")
    mentioned = sum(r["mentioned"] for r in rows)
    return {"chair_sentence": sum(r["chair_sentence"] for r in rows) / len(rows),
            "chair_instance": sum(r["hallucinated"] for r in rows) / mentioned if mentioned else math.nan}


def objects_f1(records: Sequence[Record], idx: Sequence[int] | None = None) -> dict[str, float]:
    """Object precision (correct / mentioned), recall (correct / present) and F1, pooled over
    the captions; NaN where a denominator is 0, F1 = 0 when nothing is correct."""
    rows = [records[i] for i in (range(len(records)) if idx is None else idx)]
    if not rows:
        raise ValueError("object F1 needs at least one caption")
    tp = sum(r["correct"] for r in rows)
    mentioned = sum(r["mentioned"] for r in rows)
    present = tp + sum(r["missed"] for r in rows)
    precision = tp / mentioned if mentioned else math.nan
    recall = tp / present if present else math.nan
    f1 = 2 * tp / (mentioned + present) if mentioned + present else math.nan
    return {"precision": precision, "recall": recall, "f1": f1}


# --- POPE ----------------------------------------------------------------------------------------

def pope_answer(text: str) -> str | None:
    """'yes' / 'no' from the answer's first word, None when it is neither."""
    words = re.findall(r"[a-z]+", text.lower())
    return words[0] if words and words[0] in ("yes", "no") else None


def pope_per_item(answers: Sequence[str], labels: Sequence[bool]) -> list[Record]:
    """One record per question: pred_yes, label_yes, correct (0/1 each) and unparsed."""
    if len(answers) != len(labels):
        raise ValueError(f"{len(answers)} answers but {len(labels)} labels")
    records = []
    for answer, label in zip(answers, labels):
        parsed = pope_answer(answer)
        pred = parsed == "yes"
        records.append({"pred_yes": float(pred), "label_yes": float(bool(label)),
                        "correct": float(pred == bool(label)), "unparsed": float(parsed is None)})
    return records


def pope(records: Sequence[Record], idx: Sequence[int] | None = None) -> dict[str, float]:
    """accuracy, precision, recall, F1 (positive = yes), yes_ratio, unparsed share. F1 is
    2 TP / (predicted yes + labelled yes): 0 for a model that never says yes to a question whose
    answer is yes (no true positive), NaN only when no question is answered or labelled yes;
    precision (no yes answer) and recall (no yes label) are NaN where undefined."""
    rows = [records[i] for i in (range(len(records)) if idx is None else idx)]
    if not rows:
        raise ValueError("POPE needs at least one question")
    tp = sum(r["pred_yes"] * r["label_yes"] for r in rows)
    pred_yes = sum(r["pred_yes"] for r in rows)
    label_yes = sum(r["label_yes"] for r in rows)
    precision = tp / pred_yes if pred_yes else math.nan
    recall = tp / label_yes if label_yes else math.nan
    f1 = 2 * tp / (pred_yes + label_yes) if pred_yes + label_yes else math.nan
    return {"accuracy": sum(r["correct"] for r in rows) / len(rows), "precision": precision,
            "recall": recall, "f1": f1, "yes_ratio": pred_yes / len(rows),
            "unparsed": sum(r["unparsed"] for r in rows) / len(rows)}


# --- paired resampling ---------------------------------------------------------------------------

def paired_bootstrap(statistic: Callable[[Sequence[Record], Sequence[int] | None], float],
                     method: Sequence[Record], baseline: Sequence[Record], *,
                     relative: bool = False, draws: int = 2000, seed: int = 0
                     ) -> tuple[float, float, float]:
    """(difference, 95% CI low, high) of statistic(method) - statistic(baseline), resampling the
    SAME images on both sides (`stats.percentile_ci`). `relative`: the difference divided by the
    baseline's statistic (e.g. the relative CHAIR_S drop, paper: -20.7%), NaN where that is 0.
    For CHAIR_I, F1 and other ratios of sums, which are not means of per-image values."""
    if len(method) != len(baseline) or not method:
        raise ValueError(f"paired images need two equally long non-empty lists, got "
                         f"{len(method)} and {len(baseline)}")

    def diff(idx: Sequence[int] | None) -> float:
        base = statistic(baseline, idx)
        d = statistic(method, idx) - base
        if not relative:
            return d
        return d / base if base else math.nan

    low, high = stats.percentile_ci(len(method), diff, draws, seed)
    return diff(None), low, high


def paired_ratio_bootstrap(num_m: Sequence[float], den_m: Sequence[float],
                           num_b: Sequence[float], den_b: Sequence[float], *,
                           strata: Sequence[Any] | None = None, relative: bool = False,
                           draws: int = 2000, seed: int = 0
                           ) -> tuple[float, float, float, list[float]]:
    """`paired_bootstrap` for a statistic that is a ratio of sums over the pairs (CHAIR_S:
    hallucinating captions / captions; CHAIR_I: hallucinated / mentioned; POPE F1: 2 TP /
    (predicted yes + labelled yes)), vectorised with numpy: the same resampled pairs on both
    sides. -> (difference, 95% CI low, high, per-pair differences). The per-pair differences
    are the linearisation d_i = n (num_m_i / sum den_m - num_b_i / sum den_b) (their mean is the
    difference; divided by the baseline's statistic when `relative`, per draw for the CI), for
    the MDE.

    `strata` (e.g. the seed of each pair): each draw resamples the pairs *within each stratum*,
    as many as it has, and recomputes both ratios over all strata. Pooling (seed, image) pairs
    as one sample would let a draw hold more pairs of one seed than another, mixing
    seed-to-seed differences into the spread as if they were image noise. None: one stratum
    (the same draws as resampling all pairs)."""
    import numpy as np

    arrays = [np.asarray(a, dtype=float) for a in (num_m, den_m, num_b, den_b)]
    n = len(arrays[0])
    if n == 0 or any(len(a) != n for a in arrays) or (strata is not None and len(strata) != n):
        got = ([] if strata is None else [len(strata)]) + [len(a) for a in arrays]
        raise ValueError(f"paired ratios need equally long non-empty columns "
                         f"({'strata, ' if strata is not None else ''}num_m, den_m, num_b, "
                         f"den_b), got {got}")
    nm, dm, nb, db = arrays

    def ratio(num: Any, den: Any) -> Any:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)

    rng = np.random.default_rng(seed)
    labels = np.zeros(n, dtype=int) if strata is None else np.asarray(list(strata))
    idx = np.concatenate([pos[rng.integers(0, len(pos), size=(draws, len(pos)))]
                          for pos in (np.flatnonzero(labels == s) for s in np.unique(labels))],
                         axis=1)                                      # (draws, n)
    base = float(ratio(nb.sum(), db.sum()))
    diff = float(ratio(nm.sum(), dm.sum())) - base
    b = ratio(nb[idx].sum(1), db[idx].sum(1))
    d = ratio(nm[idx].sum(1), dm[idx].sum(1)) - b
    per_pair = n * (ratio(nm, dm.sum()) - ratio(nb, db.sum()))
    if relative:
        with np.errstate(invalid="ignore", divide="ignore"):
            d = np.where(b != 0, d / np.where(b != 0, b, 1.0), np.nan)
        diff = diff / base if base else math.nan
        per_pair = per_pair / base if base else per_pair * math.nan
    d = np.sort(d[np.isfinite(d)])
    if not len(d):
        return diff, math.nan, math.nan, [float(x) for x in per_pair]
    low, high = d[int(0.025 * (len(d) - 1))], d[int(0.975 * (len(d) - 1))]
    return diff, float(low), float(high), [float(x) for x in per_pair]
