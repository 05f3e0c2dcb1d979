"""Does PlugMem's learned reader read its memory, and after how many steps?

    .venv/bin/python benchmarks/plugmem_reader.py --steps 800 3000 --lr 3e-3 1e-3

A diagnostic behind the `cpu` profile's reader budget (`pipelines/plugmem/params.yaml`,
`train_reader`), chosen WITHOUT the eval split: the reader (the pipeline's tiny Llama, d = 64,
2 layers, batch 16, one torch thread) is trained on the first train seed's contexts only
(`pipelines/plugmem/data/contexts.parquet`, seed 100, every training arm) and scored by greedy
exact match (the `answer` stage's normalisation) on the second train seed's contexts (seed 101,
never trained on here), per memory arm: `oracle` (PlugMem over oracle facts), `bm25` and
`none` (no memory: what a reader that ignores its memory scores). A reader that reads scores
well above `none` on the memory arms; the perfect reader on the same memories is printed as
the ceiling. Needs the pipeline's `memory` stage output (`paperline repro plugmem` first).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = ("oracle", "bm25", "none")


def main() -> None:
    import polars as pl
    import torch
    from transformers import AutoTokenizer

    from stages.models import base
    from stages.models.generate import generate
    from stages.plugmem import text
    from stages.plugmem.answer import normalise
    from stages.plugmem.train import reader_examples
    from stages.train.sft import sft

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[800, 3000])
    ap.add_argument("--lr", type=float, nargs="+", default=[3e-3])
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = ROOT / "pipelines/plugmem/data"
    df = pl.read_parquet(data / "contexts.parquet").filter(pl.col("split") == "train")
    seeds = sorted(set(df["seed"].to_list()))
    if len(seeds) < 2:
        raise SystemExit(f"need two train seeds in {data / 'contexts.parquet'}, found {seeds}")
    fit, held = df.filter(pl.col("seed") == seeds[0]), df.filter(pl.col("seed") == seeds[1])
    prompts, targets = reader_examples(fit)
    tok = AutoTokenizer.from_pretrained(str(data / "corpus/tokenizer"), local_files_only=True)
    perfect = {a: float(held.filter(pl.col("arm") == a)["perfect"].mean()) for a in ARMS}
    print(f"fit on train seed {seeds[0]} ({len(prompts)} examples), scored on train seed "
          f"{seeds[1]}; perfect reader: " + ", ".join(f"{a} {perfect[a]:.3f}" for a in ARMS))
    print("| steps | lr | train loss | " + " | ".join(ARMS) + " | s |")
    print("|---|---|---|" + "---|" * len(ARMS) + "---|")
    for steps in args.steps:
        for lr in args.lr:
            torch.manual_seed(0)
            model = base.build_model(base.Config(hidden_size=64, num_layers=2, num_heads=4,
                                                 intermediate_size=128, max_positions=256), tok)
            t0 = time.time()
            got = sft(model, tok, prompts, targets, steps=steps, batch_size=16, lr=lr, seed=0,
                      warmup=0.05, min_lr_ratio=0.1, log_every=max(1, steps // 5))
            model.eval()
            for k in ("pad_token_id", "eos_token_id", "bos_token_id"):
                setattr(model.generation_config, k, getattr(tok, k))
            acc = {}
            for arm in ARMS:
                sub = held.filter(pl.col("arm") == arm)
                ps = [text.reader_prompt(json.loads(m), q)
                      for m, q in zip(sub["memory"], sub["question"])]
                # the local backend's decoding and the answer stage's scoring
                said = generate(model, tok, ps, max_new_tokens=6, batch_size=256)
                acc[arm] = sum(normalise(s[0]) == normalise(a)
                               for s, a in zip(said, sub["answer"])) / len(ps)
            print(f"| {steps} | {lr:g} | {float(got['train_loss']):.3f} | "
                  + " | ".join(f"{acc[a]:.3f}" for a in ARMS)
                  + f" | {time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
