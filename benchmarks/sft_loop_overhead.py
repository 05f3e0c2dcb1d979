"""What the shared SFT loop costs beyond the update itself, for the tiny models: side by side.

    .venv/bin/python benchmarks/sft_loop_overhead.py [--updates 300] [--repeats 2] [--write]

Every paper's SFT runs `stages.models.base.train` (the Hugging Face `Trainer`: its data loader,
callbacks, logging, LR scheduler and optimizer step around each forward and backward). For a
tiny model an update is a few milliseconds of arithmetic, so the loop around it may be a large
share of a pipeline's wall time (Early Experience trains 80 such policies at `cpu`). This
trains the same model on the same rows for `--updates` updates twice, alternating, `--repeats`
times, on one thread (as the pipelines' pool jobs do):

    trainer   `base.train` (AdamW, warm-up then cosine, clipping at 1.0: the engine's recipe)
    bare      a plain torch loop with the same collator, batch, AdamW, schedule and clipping

and reports the median seconds per update of each and their ratio. The model is Early
Experience's `cpu` policy (d = 64, 2 layers, intermediate 128, batch 16) on a character
vocabulary; rows are random tokens of 35-55 ids with a 10-token completion (a shop IL example
is 45 subwords on average). Nothing here changes a stage: it says what replacing the Trainer by
a bare loop could save, and at what model size it stops mattering (`--hidden` 128 / 256).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import string
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rows_for(n: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    """`n` completion-only rows: prompt ids unlabelled (-100), 10 labelled completion ids."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(35, 55)
        ids = [rng.randrange(4, vocab) for _ in range(length)]
        out.append({"input_ids": ids, "labels": [-100] * (length - 10) + ids[-10:]})
    return out


def bare_loop(model, rows, pad_id: int, steps: int, batch_size: int, lr: float,
              seed: int) -> float:
    """Seconds for `steps` updates of a plain loop with the engine's optimizer settings."""
    import torch

    from stages.models.base import CompletionCollator

    collate = CompletionCollator(pad_id)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, round(0.05 * steps))

    def factor(step: int) -> float:                # warm-up, then cosine to 0.1 * lr
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    rng = random.Random(seed)
    model.train()
    model.config.use_cache = False
    started = time.perf_counter()
    for _ in range(steps):
        batch = collate([rows[rng.randrange(len(rows))] for _ in range(batch_size)])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> None:
    import torch

    from stages.models import base
    from stages.models.tokenizer import build_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hidden", type=int, nargs="+", default=[64])
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = build_tokenizer(list(string.printable[:95]))
    rows = rows_for(1200, len(tok), seed=0)
    lines = ["| d (layers 2, batch 16) | trainer s / update | bare s / update | trainer / bare |",
             "|---|---|---|---|"]
    summary = []
    for d in args.hidden:
        mcfg = base.Config(hidden_size=d, num_layers=2, num_heads=4, intermediate_size=2 * d,
                           max_positions=384)
        per: dict[str, list[float]] = {"trainer": [], "bare": []}
        for _ in range(args.repeats):
            torch.manual_seed(0)
            model = base.build_model(mcfg, tok)
            tcfg = base.Config(steps=args.updates, batch_size=16, lr=3e-3, warmup=0.05,
                               min_lr_ratio=0.1, log_every=max(1, args.updates // 4))
            m = base.train(tcfg, model, tok, rows, seed=0)
            per["trainer"].append(m["train_seconds"] / args.updates)
            torch.manual_seed(0)
            model = base.build_model(mcfg, tok)
            per["bare"].append(bare_loop(model, rows, tok.pad_token_id, args.updates, 16, 3e-3,
                                         seed=0) / args.updates)
            print(f"d={d}: trainer {per['trainer'][-1]:.4f}, bare {per['bare'][-1]:.4f} "
                  "s / update", flush=True)
        med = {k: statistics.median(v) for k, v in per.items()}
        ratio = med["trainer"] / med["bare"]
        lines.append(f"| {d} | {med['trainer']:.4f} | {med['bare']:.4f} | {ratio:.2f} |")
        summary.append(f"d = {d}: the Trainer's update costs {ratio:.2f}x the bare loop's")
    body = (f"`.venv/bin/python benchmarks/sft_loop_overhead.py --updates {args.updates} "
            f"--repeats {args.repeats} --hidden {' '.join(map(str, args.hidden))} --write`: "
            "the shared SFT loop (`stages.models.base.train`, the Hugging Face Trainer) against "
            "a bare torch loop with the same collator, batch, AdamW, warm-up + cosine schedule "
            "and clipping, alternating in one run, one thread, random rows of 35-55 tokens "
            "(Early Experience's `cpu` policy at d = 64). Trainer seconds are its `train()` "
            "call only (its construction excluded).\n\n" + "\n".join(lines) + "\n\n"
            + "; ".join(summary) + ".\n")
    print(body)
    if args.write:
        from benchmarks._results import write_section

        write_section("SFT loop overhead", body)


if __name__ == "__main__":
    main()
