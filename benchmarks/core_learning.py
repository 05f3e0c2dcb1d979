"""Does CoRe's upper-bound arm (text SFT) learn to answer at the `cpu` budget, and what would
it take?

    .venv/bin/python benchmarks/core_learning.py --steps 400 1500 --lr 1e-3 \
        --kinds kv,arith,table kv --arms text_sft --seed 0
    .venv/bin/python benchmarks/core_learning.py --steps 1500 --kinds kv --fresh 24000
    .venv/bin/python benchmarks/core_learning.py --steps 400 1500 3000 --page aligned \
        --fresh 30000
    .venv/bin/python benchmarks/core_learning.py --steps 1500 --page index --fresh 30000 \
        --arms text_sft visual_sft core_sft --seed 1
    .venv/bin/python benchmarks/core_learning.py --steps 1000 --page index --fresh 16000 \
        --arms visual_sft core_sft --core 1,1 0,1 1,0 --seed 0

A diagnostic behind the `cpu` profile of `pipelines/core/params.yaml` (`sft`), chosen WITHOUT
the test split: each (arm, kinds, steps, lr) trains the sft stage's own loop (`train_arm`, one
torch thread) from the `vlm-text` checkpoint of one seed on the train pages and is scored by
greedy exact match (`score_arm`, the stage's verifier) on the **val** split, per kind. CoRe's
gap-recovery claim needs text SFT well above visual SFT (the transfer failure, issue 18); an arm
that does not learn to answer leaves nothing to recover. The score on the first train pages is
printed too (memorisation shows as train >> val). `--fresh N` trains on N new pages instead
(same generator and page config as the vlm `data` stage, another seed, none equal to a val or
test page), to tell memorisation of a small train set from a missing skill. `--page aligned`
and `--page index` (with `--fresh`) ask whether the pair tokenizer is what stands in the way:
key->value pages written so that every key and every value is exactly one pair token
(`ab17cd04...`, 8 items, values zero-padded; the vlm `kv` page `ab=17 cd=4` puts them across
token boundaries), asked by key (`get cd` -> `04`, an induction-style copy) or by position
(`item 2` -> `04`); trained on fresh such pages and scored on up to 200 more (another generator
seed, none a train page), never on the vlm splits; the pages do not depend on `--seed` (it
picks the checkpoint and the batch order). Each (steps, lr) is a run of its own, with its own
warm-up and cosine schedule. Printed per run: the final training loss (the mean of the last
tenth of the steps) and its parts (CoRe-SFT: `ce_img`, `ce_txt`, `match`), the accuracy on the
arm's own input (text SFT: the text; visual SFT and CoRe-SFT: the page) and on the other one.
`--core lam,mu ...` runs CoRe-SFT once per weight pair (the ablations: lam 0 drops the matching
term, mu 0 the CE on the text).
Needs the vlm pipeline's `data` and
`train_text` outputs (`paperline repro vlm`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fresh_pages(data: Path, kinds: list[str], n: int) -> tuple[object, list]:
    """`n` new pages of `kinds` from the vlm data stage's page config (pipelines/vlm/params.yaml),
    another generator seed, none equal to a val or test page's content."""
    import io

    import numpy as np
    import polars as pl
    import yaml
    from PIL import Image

    from stages.tasks import rendered_text

    page = yaml.safe_load((ROOT / "pipelines/vlm/params.yaml").read_text())["data"]
    cfg = rendered_text.Config(**{**page["rendered_text"], "kinds": kinds})
    held = pl.concat([pl.read_parquet(data / "rendered_text" / f"{s}.parquet")
                      for s in ("val", "test")])["content"]
    df = pl.DataFrame(rendered_text.generate(cfg, n, "core-probe", split="probe",
                                             exclude=set(held)), schema=rendered_text.SCHEMA)
    return df, [np.array(Image.open(io.BytesIO(b)).convert("RGB")) for b in df["image"]]


def probe_pages(n: int, query: str, seed: str, exclude: set[str]) -> tuple[object, list]:
    """`n` token-aligned key->value pages (`--page aligned|index`): the core pipeline's `pages`
    generator (`stages.core_align.pages.index_page`, asked by key or by position) with the vlm
    data stage's page config and this probe's own draw; the rows have the rendered-text schema
    (kind `kv`, as the probe's `--kinds kv`)."""
    import io
    import random

    import numpy as np
    import polars as pl
    import yaml
    from PIL import Image

    from stages.core_align.pages import index_page
    from stages.tasks import rendered_text
    from stages.tasks.images import encode_png, pixel_sha

    page = yaml.safe_load((ROOT / "pipelines/vlm/params.yaml").read_text())["data"]
    cfg = rendered_text.Config(**{**page["rendered_text"], "kinds": ["kv"]})
    rng = random.Random(f"core-probe:{query}:{seed}")
    rows, seen = [], set(exclude)
    while len(rows) < n:
        p = index_page(cfg.capacity, rng, "key" if query == "aligned" else "position")
        if p["content"] in seen:
            continue
        seen.add(p["content"])
        pixels = rendered_text.render(cfg, p["content"])
        rows.append({**p, "id": f"probe-{seed}-{len(rows):06d}", "family": rendered_text.FAMILY,
                     "split": "probe", "kind": "kv", "image": encode_png(pixels),
                     "image_sha": pixel_sha(pixels), "n_chars": len(p["content"]),
                     "n_lines": -(-len(p["content"]) // cfg.cols),
                     "visual_tokens": cfg.visual_tokens,
                     "chars_per_token": len(p["content"]) / cfg.visual_tokens})
    df = pl.DataFrame(rows, schema=rendered_text.SCHEMA)
    return df, [np.array(Image.open(io.BytesIO(b)).convert("RGB")) for b in df["image"]]


def main() -> None:
    import torch

    from stages.core_align import sft
    from stages.core_align.core import CoReParams
    from stages.models import vlm as vlm_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[400, 1500])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-3])
    ap.add_argument("--kinds", nargs="+", default=None,
                    help="comma-separated kinds trained and scored together, per run "
                         "(default kv,arith,table; with --page aligned|index: kv)")
    ap.add_argument("--arms", nargs="+", default=["text_sft"])
    ap.add_argument("--core", nargs="+", default=["1,1"],
                    help="CoRe-SFT's lam,mu pairs, one run each (lam = 0: no matching term; "
                         "mu = 0: no CE on the text)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-eval", type=int, default=200)
    ap.add_argument("--fresh", type=int, default=0, help="train on this many new pages")
    ap.add_argument("--page", choices=["vlm", "aligned", "index"], default="vlm",
                    help="vlm: the vlm data stage's pages; aligned / index: token-aligned "
                         "key->value pages asked by key / by position (needs --fresh)")
    args = ap.parse_args()
    if args.fresh < 0 or args.max_eval < 1:
        ap.error("--fresh must be >= 0 and --max-eval >= 1")
    try:
        variants = [tuple(float(x) for x in v.split(",")) for v in args.core]
        CoReParams(lam=variants[0][0], mu=variants[0][1])
        if any(len(v) != 2 or min(v) < 0 for v in variants):
            raise ValueError
    except (ValueError, IndexError):
        ap.error(f"--core {args.core}: want lam,mu pairs of non-negative numbers, e.g. 0,1")
    if args.kinds is None:
        args.kinds = ["kv,arith,table"] if args.page == "vlm" else ["kv"]
    if args.page != "vlm" and (not args.fresh or args.kinds != ["kv"]):
        ap.error("--page aligned|index needs --fresh N (and trains the kind kv only)")
    torch.set_num_threads(1)
    data = ROOT / "pipelines/vlm/data/tasks"
    model_dir = ROOT / f"pipelines/vlm/models/text/seed{args.seed}"
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir}: no vlm-text checkpoint (paperline repro vlm first)")
    n_eval = min(200, args.max_eval)
    if args.page == "vlm":
        print(f"vlm-text seed {args.seed}; scored on val (at most {args.max_eval} items), "
              "greedy")
        print("train pages: " + (f"{args.fresh} new pages" if args.fresh
                                 else "the vlm train split"))
    else:
        asked = "by key" if args.page == "aligned" else "by position"
        print(f"vlm-text seed {args.seed}; {args.fresh} new token-aligned key->value pages, "
              f"asked {asked}; scored on {n_eval} more such pages (not the vlm val split), "
              "greedy")
    print("| arm | kinds | steps | lr | final loss | loss parts | train acc (first 200) "
          "| val acc (own input) | val acc (other input) | val by kind | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kinds in args.kinds:
        kl = kinds.split(",")
        if args.page != "vlm":
            eval_df, eval_images = probe_pages(n_eval, args.page, "val", set())
            train_df, train_images = probe_pages(args.fresh, args.page, "train",
                                                 set(eval_df["content"]))
        elif args.fresh:
            eval_df, eval_images = sft.load_split(data, "val", kl, 32, args.max_eval)
            train_df, train_images = fresh_pages(data, kl, args.fresh)
        else:
            eval_df, eval_images = sft.load_split(data, "val", kl, 32, args.max_eval)
            train_df, train_images = sft.load_split(data, "train", kl, 32, None)
        first = vlm_model.load_vlm(model_dir)     # the same processor and tokenizer every run
        pixels = vlm_model.pixel_values(first.processor, train_images)
        pairs = sft.encode_pairs(first, train_df)
        runs = [(arm, v) for arm in args.arms
                for v in (variants if arm == "core_sft" else [(1.0, 1.0)])]
        for arm, (lam, mu) in runs:
            label = f"{arm} (lam {lam:g}, mu {mu:g})" if arm == "core_sft" else arm
            for steps in args.steps:
                for lr in args.lr:
                    cfg = sft.Config(seeds=[args.seed], arms=[arm], kinds=kl, steps=steps, lr=lr,
                                     split="val", log_every=max(1, steps // 10),
                                     num_threads=1, core=CoReParams(lam=lam, mu=mu))
                    vlm = vlm_model.load_vlm(model_dir)
                    t = time.perf_counter()
                    m = sft.train_arm(cfg, arm, vlm, pairs, pixels, args.seed)
                    rows, acc = sft.score_arm(vlm, eval_df, eval_images, arm, args.seed, cfg,
                                              "probe")
                    own = "text" if arm == "text_sft" else "image"
                    other = "image" if own == "text" else "text"
                    _, fit = sft.score_arm(vlm, train_df.head(args.max_eval),
                                           train_images[:args.max_eval], arm, args.seed, cfg,
                                           "probe (train pages)")
                    by_kind = {k: sum(r["correct"] for r in rows
                                      if r["modality"] == own and r["kind"] == k)
                               / max(1, sum(1 for r in rows
                                            if r["modality"] == own and r["kind"] == k))
                               for k in kl}
                    loss = m.get("final_loss", float("nan"))
                    parts = ", ".join(f"{k} {m[f'final_{k}']:.3f}"
                                      for k in ("ce_img", "ce_txt", "match")
                                      if f"final_{k}" in m) if arm == "core_sft" else ""
                    print(f"| {label} | {kinds} | {steps} | {lr:g} | {loss:.3f} | {parts} | "
                          f"{fit['acc_' + own]:.3f} | {acc['acc_' + own]:.3f} | "
                          f"{acc['acc_' + other]:.3f} | "
                          + ", ".join(f"{k} {v:.2f}" for k, v in by_kind.items())
                          + f" | {time.perf_counter() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
