"""PlugMem's reader training at one torch thread against two, side by side.

    .venv/bin/python benchmarks/plugmem_reader_threads.py [--steps 150] [--repeats 2] [--write]

The `cpu` profile's `train_reader` (pipelines/plugmem/params.yaml: d = 64, 2 layers, batch 16,
up to 256 tokens, the shared SFT engine) is the pipeline's longest stage. It runs alone under
`dvc repro` (stages run one at a time), so both cores are its own. Each run is a fresh process
that builds the reader and trains `--steps` updates on the pipeline's train contexts
(`pipelines/plugmem/data/contexts.parquet`: `paperline repro plugmem` first) at the given
thread count; the counts alternate, and the median seconds per update are compared. A busy box
(the test suite) is another matter: there two threads fight the other pytest worker.

`--write` replaces the "PlugMem reader threads" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_section  # noqa: E402

ONE_RUN = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
import polars as pl, torch
from transformers import AutoTokenizer
from stages.models import base
from stages.plugmem.train import reader_examples
from stages.train.sft import sft
threads, steps, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
base.set_threads(threads)
data = f"{root}/pipelines/plugmem/data"
prompts, targets = reader_examples(pl.read_parquet(f"{data}/contexts.parquet"))
tok = AutoTokenizer.from_pretrained(f"{data}/corpus/tokenizer", local_files_only=True)
torch.manual_seed(0)
model = base.build_model(base.Config(hidden_size=64, num_layers=2, num_heads=4,
                                     intermediate_size=128, max_positions=256), tok)
t0 = time.perf_counter()
sft(model, tok, prompts, targets, steps=steps, batch_size=16, lr=1e-3, seed=0, warmup=0.05,
    min_lr_ratio=0.1, log_every=10**6)
print(json.dumps({"s_per_update": (time.perf_counter() - t0) / steps}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    times: dict[int, list[float]] = {1: [], 2: []}
    for i in range(args.repeats):
        for threads in ((1, 2) if i % 2 == 0 else (2, 1)):
            proc = subprocess.run([sys.executable, "-c", ONE_RUN, str(threads), str(args.steps),
                                   str(ROOT)], capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            times[threads].append(json.loads(proc.stdout.splitlines()[-1])["s_per_update"])
            print(f"{threads} thread(s): {times[threads][-1]:.4f} s / update", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    body = "\n".join([
        f"`.venv/bin/python benchmarks/plugmem_reader_threads.py --steps {args.steps} "
        f"--repeats {args.repeats} --write`: PlugMem's `train_reader` at the `cpu` profile's "
        f"size (d = 64, 2 layers, batch 16, the shared SFT engine) on the pipeline's train "
        f"contexts, a fresh process per run, thread counts alternating; load average "
        f"{os.getloadavg()[0]:.1f} at the end.",
        "",
        "| torch threads | s / update (median) | runs |",
        "|---|---|---|",
        *(f"| {k} | {med[k]:.4f} | {len(times[k])} x {args.steps} updates |" for k in (1, 2)),
        "",
        f"Two threads: **{med[1] / med[2]:.2f}x** the updates per second of one. The `cpu` "
        f"profile trains the reader with 2 (3,000 updates; the stage runs alone under `dvc "
        f"repro`).",
    ])
    print(body)
    if args.write:
        write_section("PlugMem reader threads", body)


if __name__ == "__main__":
    main()
