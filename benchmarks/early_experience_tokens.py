"""Characters vs subwords for the Early Experience policies: the cost of an update, side by side.

    .venv/bin/python benchmarks/early_experience_tokens.py [--updates 200] [--repeats 2] [--write]

For each world (the mini-WebShop, BabyAI) the IL policy of the `train` stage (its own
`train_one`, the `cpu` profile's model and batch, one thread) is trained for `--updates`
updates once with `tokenizer: chars` and once with `tokenizer: bpe` (`world_tokenizer`:
subwords learnt on every arm's text, `stages/models/subword.py`), alternating chars, bpe,
chars, bpe ... `--repeats` times so that both see the same machine load. Reported per world:
mean tokens per IL example (prompt + reply + <bos> + <eos>), median seconds per update and the
ratio. The IWM, SR and DPO arms train on longer texts, where the ratio is of the same kind.

Needs the pipeline's data stages (`paperline repro early_experience` or at least `dvc repro
shop experience babyai babyai_experience` in pipelines/early_experience). `--write` replaces
the "Early Experience tokens" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import polars as pl
    import yaml

    from stages.agents.imitation import il_examples
    from stages.agents.trajectories import read_rollouts
    from stages.core.checks import read_parquet_checked
    from stages.core.config import validate_section
    from stages.core.runner import load_params
    from stages.early_experience.experience import experience_spec
    from stages.early_experience.train import Config, train_one, world_tokenizer
    from stages.models import subword

    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    _, params, source = load_params(ROOT, "early_experience")
    folder = ROOT / "pipelines/early_experience"
    paths = yaml.safe_load((folder / "params.yaml").read_text())["paths"]
    lines = ["| world | tokens | tokens / IL example | s / update (median) | updates timed |",
             "|---|---|---|---|---|"]
    ratios = []
    for world, section in (("shop", "train"), ("babyai", "babyai_train")):
        base = validate_section(Config, params, section, "cpu", source)
        episodes, steps = read_rollouts(folder / paths[base.demos] / "expert")
        ok = sorted(int(s.split("/")[1]) for s in
                    episodes.filter(pl.col("success"))["episode_id"].to_list())
        il = il_examples(episodes.filter(pl.col("success")), steps)
        exp = read_parquet_checked(folder / paths[base.experience], experience_spec())
        rows = exp.filter(pl.col("episode").is_in(ok)).to_dicts()
        per: dict[str, list[float]] = {"chars": [], "bpe": []}
        length: dict[str, float] = {}
        for _ in range(args.repeats):
            for kind in ("chars", "bpe"):
                cfg = base.model_copy(update={"tokenizer": kind, "steps": args.updates})
                tok_json = world_tokenizer(cfg, il, rows)
                tok = subword.from_json(tok_json)
                # as `encode_sft_rows` encodes them: <bos> prompt, then reply <eos>
                n = [len(tok(p)["input_ids"]) + len(tok(t, add_special_tokens=False)
                                                    ["input_ids"]) + 1 for p, t in zip(*il)]
                length[kind] = sum(n) / len(n)
                with tempfile.TemporaryDirectory() as tmp:
                    m = train_one({"cfg": cfg.model_dump(), "arm": "il", "seed": 0,
                                   "data": {"il": il}, "tokenizer": tok_json,
                                   "out": str(Path(tmp) / "il"), "threads": 1})
                per[kind].append(m["train_seconds"] / args.updates)
                print(f"{world} {kind}: {per[kind][-1]:.4f} s / update", flush=True)
        med = {k: statistics.median(v) for k, v in per.items()}
        ratios.append((world, med["chars"] / med["bpe"], length["chars"] / length["bpe"]))
        for kind in ("chars", "bpe"):
            lines.append(f"| {world} | {kind} | {length[kind]:.1f} | {med[kind]:.4f} | "
                         f"{args.updates} x {args.repeats} |")
    body = (f"`.venv/bin/python benchmarks/early_experience_tokens.py --updates {args.updates} "
            f"--repeats {args.repeats} --write`: the IL policy of Early Experience's `train` "
            "(`train_one`, the `cpu` profile's d = 64, 2 layers, batch 16, one thread) trained "
            "on characters and on subwords (`tokenizer: bpe`, stages/models/subword.py), "
            "alternating, in one run. Seconds per update include the stage's model build and "
            "save (the same for both).\n\n" + "\n".join(lines) + "\n\n"
            + "; ".join(f"{w}: an update on subwords is {r:.2f}x cheaper, examples {t:.2f}x "
                        "shorter" for w, r, t in ratios) + ".\n")
    print(body)
    if args.write:
        from benchmarks._results import write_section

        write_section("Early Experience tokens", body)


if __name__ == "__main__":
    main()
