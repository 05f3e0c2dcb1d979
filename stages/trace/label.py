"""Stage `label` of the TRACE pipeline: the 8-label sentence tagger (spec §2 step 2-3, §4).

Paper: DeBERTa-v3-base with an 8-way sigmoid head, trained on ~100k LLM-written synthetic
sentences; macro-F1 0.666 on 400 human-labelled sentences. Here (spec §4, option 1): TF-IDF
(word 1-2-grams + character 2-4-grams) and one-vs-rest logistic regression, i.e. 8 independent
sigmoids, a label on when p >= `threshold` (0.5, as in the paper), trained on templated sentences
with paraphrase noise (stage `corpus`), scored on held-out sentences with gold labels.

Option: `llm` (a `stages.models.backend.BackendConfig`) also labels the first `llm_rows` held-out
sentences through the backend interface (local HF folder or an OpenAI-compatible server) and
reports its macro-F1; replies that do not parse (`trace.parse_llm_labels`) are counted in
`llm_malformed` and labelled with the empty set, never raised.

Output: `<out>/tagger.pkl` + `labels.json`, registered in MLflow as `trace-tagger`.

    python -m stages trace label
"""

from __future__ import annotations

import time
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.core.checks import read_parquet_checked, spec_from_schema
from stages.models.backend import BackendConfig
from stages.trace import trace
from stages.trace.corpus import SENT_SCHEMA


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    corpus: str = Field("corpus", description="paths key of the corpus folder")
    out: str = Field("tagger", description="paths key of the tagger folder")
    threshold: float = Field(0.5, gt=0, lt=1, description="label on when p >= threshold [paper]")
    C: float = Field(10.0, gt=0, le=1e6, description="inverse L2 strength of each sigmoid")
    char_ngrams: tuple[int, int] = Field((2, 4), description="character n-gram range")
    max_iter: int = Field(1000, ge=10, le=100_000, description="solver iterations")
    llm: BackendConfig | None = Field(None, description="optional LLM labeler (backend) "
                                                        "evaluated on the held-out sentences")
    llm_rows: int = Field(200, ge=1, le=1_000_000, description="held-out sentences for the LLM")
    register_as: str | None = Field("trace-tagger", description="registered model name")


def build_classifier(cfg: Config) -> Any:
    """TF-IDF features -> 8 one-vs-rest logistic regressions (each an independent sigmoid)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.multiclass import OneVsRestClassifier
    from sklearn.pipeline import FeatureUnion, Pipeline
    from sklearn.feature_extraction.text import TfidfVectorizer

    features = FeatureUnion([
        ("word", TfidfVectorizer(analyzer="word", ngram_range=(1, 2), lowercase=True,
                                 token_pattern=r"[A-Za-z]+|\d+|[+\-=]")),
        ("char", TfidfVectorizer(analyzer="char_wb", ngram_range=tuple(cfg.char_ngrams),
                                 lowercase=True, sublinear_tf=True)),
    ])
    head = OneVsRestClassifier(LogisticRegression(C=cfg.C, max_iter=cfg.max_iter))
    return Pipeline([("features", features), ("head", head)])


def label_matrix(labels: list[str]) -> Any:
    import numpy as np

    return np.array([[1 if lab in s else 0 for lab in trace.LABELS] for s in labels])


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    spec = spec_from_schema(SENT_SCHEMA)
    folder = ctx.path(cfg.corpus)
    train = read_parquet_checked(folder / "sentences_train.parquet", spec)
    test = read_parquet_checked(folder / "sentences_test.parquet", spec)
    y = label_matrix(train["labels"].to_list())
    missing = [trace.LABELS[j] for j in range(len(trace.LABELS)) if y[:, j].sum() == 0]
    if missing:
        raise ValueError(f"{cfg.corpus}/sentences_train.parquet: column 'labels': no sentence "
                         f"carries {missing}; raise corpus.n_sentences")
    model = build_classifier(cfg)
    started = time.perf_counter()
    model.fit(train["text"].to_list(), y)
    seconds = time.perf_counter() - started
    tagger = trace.ClassifierTagger(model, cfg.threshold)
    gold = [frozenset(s) for s in test["labels"].to_list()]
    pred = tagger.tag(test["text"].to_list())
    m = trace.macro_f1(gold, pred)
    m["empty_rate"] = sum(1 for p in pred if not p) / len(pred)
    m["gold_empty_rate"] = sum(1 for g in gold if not g) / len(gold)
    m["exact_match"] = sum(1 for g, p in zip(gold, pred) if g == p) / len(gold)
    m["train_seconds"] = seconds
    m["n_train"], m["n_test"] = float(train.height), float(test.height)
    preds = test.with_columns(pl.Series("pred", [trace.labels_str(p) for p in pred]))
    if cfg.llm is not None:
        from stages.models.backend import make_backend

        llm = trace.LLMTagger(make_backend(cfg.llm, root=ctx.root))
        rows = test.head(cfg.llm_rows)
        got = llm.tag(rows["text"].to_list())
        lm = trace.macro_f1([frozenset(s) for s in rows["labels"].to_list()], got)
        m |= {f"llm_{k}": v for k, v in lm.items() if k.startswith("macro")}
        m["llm_malformed"] = float(llm.malformed)
        m["llm_malformed_rate"] = llm.malformed / max(1, llm.calls)
        m["llm_rows"] = float(rows.height)
    out = ctx.path(cfg.out)
    with io.atomic_path(out, is_dir=True) as tmp:
        tagger.save(tmp)
        io.write_json(tmp / "labels.json", {"labels": list(trace.LABELS), "names": trace.NAMES,
                                            "threshold": cfg.threshold, "kind": "tfidf-ovr-lr"})
        io.write_parquet(tmp / "test_predictions.parquet", preds)
    if cfg.register_as and ctx.tracker is not None:
        ctx.tracker.register_model(out, cfg.register_as, ["candidate", "champion"],
                                   tags={"paperline.method": "tfidf-ovr-lr"})
        ctx.tracker.annotate_model(out, {"macro_f1": m["macro_f1"]})
    print(f"label: tagger macro-F1 {m['macro_f1']:.3f} (P {m['macro_precision']:.3f}, "
          f"R {m['macro_recall']:.3f}) on {test.height} held-out sentences")
    return m


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """DVC metrics: the tagger's held-out macro-F1; per label in details/label.json."""
    return {k: metrics[k] for k in ("macro_f1",) if k in metrics}
