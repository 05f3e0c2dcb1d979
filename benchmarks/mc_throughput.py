"""Monte Carlo step annotation throughput (BIS `mc_annotate`), side by side in one run.

    .venv/bin/python benchmarks/mc_throughput.py [--model models/base] [--rollouts 100]
                                                 [--k 16] [--batch-sizes 64 256 1024]
                                                 [--repeats 2]

The same rollouts (the bis pipeline's `data/rollouts/train.parquet`; run `make run PIPELINE=bis`
or its `rollouts` stage first), the same model and sampling settings as the stage (T 1.0, K
continuations per step prefix, 48 new tokens). Arms: one `generate` over every step prefix at
each batch size (sequences per forward pass), and the stage's default, identical prefixes of a
problem continued once (`share_prefixes`) at the largest batch size. Passes alternate `--repeats`
times so machine noise hits every arm alike; seconds are medians. Reports continuations/s (what
the model generates) and annotated steps/s (what the pipeline gets). Writes the "BIS Monte Carlo
annotation" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks._results import write_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models/base"))
    parser.add_argument("--rollouts-file",
                        default=str(ROOT / "pipelines/bis/data/rollouts/train.parquet"))
    parser.add_argument("--rollouts", type=int, default=100)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    import polars as pl
    import torch

    from stages.models.base import set_threads
    from stages.models.generate import generate, load_model
    from stages.models.mc_annotate import step_prefixes

    path, model_dir = Path(args.rollouts_file), Path(args.model)
    for p, what in ((path, "rollouts: run the bis pipeline's `rollouts` stage"),
                    (model_dir / "config.json", "model: run `make run PIPELINE=base`")):
        if not p.is_file():
            sys.exit(f"{p}: missing {what} first")
    threads = set_threads(args.threads)
    model, tokenizer = load_model(model_dir)
    rows = pl.read_parquet(path).head(args.rollouts).to_dicts()
    prefixes = step_prefixes(rows)
    every = [p for ps in prefixes for p in ps]
    shared = list(dict.fromkeys((r["problem_id"], p) for r, ps in zip(rows, prefixes)
                                for p in ps))
    shared_texts = [p for _, p in shared]
    largest = max(args.batch_sizes)
    arms = {**{f"batch {b}": (every, b) for b in args.batch_sizes},
            f"batch {largest}, shared prefixes": (shared_texts, largest)}
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0,
              num_samples=args.k, seed=0)
    generate(model, tokenizer, every[:8], batch_size=64, **kw)  # warm-up
    seconds: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(args.repeats):
        for arm, (texts, batch) in arms.items():
            started = time.perf_counter()
            generate(model, tokenizer, texts, batch_size=batch, **kw)
            seconds[arm].append(time.perf_counter() - started)
            print(arm, f"{seconds[arm][-1]:.1f}s", flush=True)
    med = {a: statistics.median(v) for a, v in seconds.items()}
    base_arm = f"batch {args.batch_sizes[0]}"
    lines = ["| arm | prefixes continued | continuations | seconds (median) | continuations/s "
             "| annotated steps/s | speed-up vs " + base_arm + " |", "|---|---|---|---|---|---|---|"]
    for arm, (texts, _) in arms.items():
        lines.append(f"| {arm} | {len(texts)} | {len(texts) * args.k} | {med[arm]:.1f} "
                     f"| {len(texts) * args.k / med[arm]:.0f} | {len(every) / med[arm]:.1f} "
                     f"| {med[base_arm] / med[arm]:.2f}x |")
    body = (f"`.venv/bin/python benchmarks/mc_throughput.py --rollouts {args.rollouts} --k "
            f"{args.k} --batch-sizes {' '.join(map(str, args.batch_sizes))} --repeats "
            f"{args.repeats}` on `models/base`: {len(rows)} rollouts of "
            f"`{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}` ({len(every)} "
            f"step prefixes), K = {args.k} continuations per prefix, T 1.0, up to "
            f"{args.max_new_tokens} new tokens; batch = sequences per `generate` call; passes "
            f"interleaved, {threads} torch threads, torch {torch.__version__}.\n\n"
            + "\n".join(lines) + "\n\nShared prefixes: rollouts of one problem that agree "
            "through step j have the same prefix, whose MC score is the same random variable, so "
            "the stage continues it once (`share_prefixes: true`); annotated steps/s counts "
            "every step of every rollout either way.\n")
    print(body)
    if not args.no_write:
        write_section("BIS Monte Carlo annotation", body)


if __name__ == "__main__":
    main()
