"""Probe: how many SFT steps, at which lr, the TRACE generator needs to solve its arith traces.

    .venv/bin/python benchmarks/trace_sft_probe.py <lr> <mix> <checkpoints,comma-separated> [batch]
    e.g. benchmarks/trace_sft_probe.py 3e-4 0.2 100,300,600 16

Fine-tunes the shared base model (`models/base`) on the trace corpus (`pipelines/trace/data/
corpus`, run the pipeline's `corpus` stage first) with the `policy` stage's own recipe
(`base.train`, `trace_policy.mix_rows`) and prints, per checkpoint, the train loss and the
accuracy on the first 48 test prompts, greedy and sampled at t = 0.7 (4 samples). This is the
probe that chose `policy.lr` (pipelines/trace/README.md): note that it reads the test prompts.
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import polars as pl
from transformers import set_seed
from stages.models import base
from stages.models.generate import load_model, generate
from stages.tasks import arith
from stages.trace.policy import mix_rows

lr = float(sys.argv[1]); mix = float(sys.argv[2]); ckpts = [int(x) for x in sys.argv[3].split(",")]
bs = int(sys.argv[4]) if len(sys.argv) > 4 else 16
base.set_threads(2)
P = f"{ROOT}/pipelines/trace/data/corpus/"
sft = pl.read_parquet(P + "sft.parquet")
test = pl.read_parquet(P + "test.parquet").to_dicts()[:48]
set_seed(0)
model, tok = load_model(ROOT / "models/base")
model.train()
rows_df = mix_rows(sft, mix, 0)
rows = base.encode_sft_rows(tok, rows_df["prompt"].to_list(), rows_df["target"].to_list(),
                            model.config.max_position_embeddings)
done = 0; t0 = time.perf_counter()
for k, steps in enumerate(ckpts):
    cfg = base.Config(steps=steps - done, batch_size=bs, lr=lr, warmup=0.05 if k == 0 else 0.0,
                      min_lr_ratio=1.0, weight_decay=0.01, log_every=max(1, steps - done))
    got = base.train(cfg, model, tok, rows, k)
    done = steps
    model.eval(); model.generation_config.pad_token_id = tok.pad_token_id
    outs = generate(model, tok, [r["prompt"] for r in test], max_new_tokens=160)
    acc = sum(arith.verify_answer(r, o[0]) for r, o in zip(test, outs)) / len(test)
    outs7 = generate(model, tok, [r["prompt"] for r in test], max_new_tokens=160, do_sample=True,
                     temperature=0.7, num_samples=4, seed=0)
    acc7 = sum(arith.verify_answer(r, c) for r, o in zip(test, outs7) for c in o) / (4 * len(test))
    model.train()
    print(json.dumps({"lr": lr, "mix": mix, "steps": steps, "loss": round(got["train_loss"], 3),
                      "greedy": acc, "t0.7": acc7, "sec": round(time.perf_counter() - t0),
                      "ex": outs[0][0][:120]}), flush=True)
