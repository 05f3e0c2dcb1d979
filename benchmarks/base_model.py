"""Base model at a profile (default `cpu`): training speed, wall time, memory, accuracy.

    .venv/bin/python benchmarks/base_model.py [--profile cpu] [--seed 0] [--threads 0]

Runs the real shared stages in-process (tasks -> tokenizer -> base -> evaluate) with the
profile's settings from params.yaml, into a scratch folder (the repo's own outputs are not
touched, MLflow is not used), and writes the "Base model" section of benchmarks/RESULTS.md:
training tokens/s (non-padding tokens), training and stage wall time, peak RSS of the
process after training and after evaluation, and greedy accuracy / pass@k by difficulty.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks._results import write_section  # noqa: E402
from stages.core.config import active_profile, read_yaml, validate_section  # noqa: E402
from stages.core.context import Context  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="default: `profile` in params.yaml")
    parser.add_argument("--seed", type=int, default=None, help="default: `seed` in params.yaml")
    parser.add_argument("--threads", type=int, default=None,
                        help="override base.num_threads (0 = all cores)")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch RESULTS.md")
    args = parser.parse_args()

    from stages.evaluate import accuracy
    from stages.models import base, tokenizer
    from stages.tasks import build

    params = read_yaml(ROOT / "params.yaml")
    profile = args.profile or active_profile(params)
    seed = params.get("seed", 0) if args.seed is None else args.seed
    cfgs = {name: validate_section(mod.Config, params, name, profile, "params.yaml")
            for name, mod in [("tasks", build), ("tokenizer", tokenizer), ("base", base),
                              ("evaluate", accuracy)]}
    if args.threads is not None:
        cfgs["base"] = cfgs["base"].model_copy(update={"num_threads": args.threads})

    with tempfile.TemporaryDirectory(prefix="paperline-bench-base-") as scratch:
        out = Path(scratch)
        paths = {"tasks": out / "tasks", "tokenizer": out / "tokenizer",
                 "base_model": out / "base", "eval_samples": out / "samples.parquet",
                 "eval_plot": out / "plot.csv", "metrics": out / "metrics"}
        ctx = Context(root=ROOT, pipeline="base", stage="bench", pipeline_dir=ROOT,
                      profile=profile, seed=seed, paths=paths, params=params)
        build.run(cfgs["tasks"], ctx)
        tokenizer.run(cfgs["tokenizer"], ctx)
        rss_before = peak_rss_mb()
        started = time.perf_counter()
        train = base.run(cfgs["base"], ctx)
        base_wall = time.perf_counter() - started
        rss_train = peak_rss_mb()
        started = time.perf_counter()
        ev = accuracy.run(cfgs["evaluate"], ctx)
        eval_wall = time.perf_counter() - started
        rss_eval = peak_rss_mb()

    import torch

    threads = torch.get_num_threads()
    b = cfgs["base"]
    difficulties = sorted(int(k.rsplit("_d", 1)[1]) for k in ev if k.startswith("greedy_acc_d"))
    ks = [k for k in cfgs["evaluate"].pass_k] if cfgs["evaluate"].num_samples else []
    head = "| operands | greedy | " + " | ".join(f"pass@{k}" for k in ks) + " |"
    rows = [head, "|---|---|" + "---|" * len(ks)]
    for d in [*difficulties, None]:
        sfx = "" if d is None else f"_d{d}"
        cells = [f"{100 * ev[f'greedy_acc{sfx}']:.1f}%"] + [f"{100 * ev[f'pass@{k}{sfx}']:.1f}%"
                                                             for k in ks]
        rows.append(f"| {'all' if d is None else d} | " + " | ".join(cells) + " |")
    cmd = "HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/base_model.py " + " ".join(sys.argv[1:])
    model = (f"{b.init}, {train['n_params'] / 1e6:.2f}M params (d={b.hidden_size}, "
             f"{b.num_layers} layers, {b.num_heads} heads, MLP {b.intermediate_size})"
             if b.init == "scratch" else f"pretrained from {b.pretrained_path}")
    body = "\n".join([
        f"Command: `{cmd.strip()}` (profile `{profile}`, seed {seed}, "
        f"{threads} torch threads)",
        "",
        f"- model: {model}; {b.steps} steps x {b.batch_size} rows, peak lr {b.lr:g} "
        f"(warmup {b.warmup:g}, cosine to {b.min_lr_ratio:g}x), "
        f"{train['epochs']:.1f} epochs of {train['train_rows']:.0f} rows",
        f"- training: **{train['train_seconds']:.0f} s** wall "
        f"({train['train_tokens_per_s']:.0f} tokens/s, non-padding tokens), "
        f"base stage {base_wall:.0f} s in all; final train loss {train['train_loss']:.4f}, "
        f"val loss {train.get('val_loss', float('nan')):.4f}",
        f"- evaluation: {eval_wall:.0f} s ({cfgs['evaluate'].num_samples} samples/prompt at "
        f"T={cfgs['evaluate'].temperature:g} + greedy)",
        f"- peak RSS: {rss_before:.0f} MB before training, {rss_train:.0f} MB after training, "
        f"{rss_eval:.0f} MB after evaluation",
        "",
        *rows,
    ])
    print(body)
    print(json.dumps({"train": train, "evaluate": ev}, indent=1))
    if not args.no_write:
        write_section("Base model", body)


if __name__ == "__main__":
    main()
