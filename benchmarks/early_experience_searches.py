"""Where does a mini-WebShop policy lose an unseen colour x category goal: the search or after it?
Read from the run.

    .venv/bin/python benchmarks/early_experience_searches.py

A diagnostic behind the Early Experience README ("What the run shows"): from the `evaluate`
stage's rollouts (`data/runs/rollouts`, every seed), per arm and split, the share of episodes
whose first call searches exactly the goal's colour and category, and the success rate of those
episodes. On the `ood_combo` split the right search is a combination no train goal has, so it
separates writing the unseen combination from what comes after it (choosing the item and the
size, as in-domain). Also: how many of the experience stage's alternatives search a held-out
pair (IWM and SR train on those outcomes, IL never sees them). Needs the pipeline's outputs
(`paperline repro early_experience`); trains nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import polars as pl

    from stages.agents.trajectories import read_rollouts
    from stages.early_experience import shop

    folder = ROOT / "pipelines/early_experience/data"
    episodes, steps = read_rollouts(folder / "runs/rollouts")
    _, goals = shop.read_shop(folder / "shop")
    first = steps.filter(pl.col("step") == 0).join(
        episodes.select("episode_id", "success"), on="episode_id")
    parts = first["episode_id"].str.split("/")
    first = first.with_columns(parts.list.get(0).alias("arm"), parts.list.get(2).alias("split"),
                               parts.list.get(3).cast(pl.Int64).alias("goal"))
    print("| split | arm | episodes | first call = the goal's search | success after it |")
    print("|---|---|---|---|---|")
    for split in shop.EVAL_SPLITS:
        f = first.filter(pl.col("split") == split)
        want = [f"{goals[split][g].color} {goals[split][g].category}" for g in f["goal"]]
        query = [json.loads(a).get("query") if t == "search" and a else None
                 for t, a in zip(f["tool"].to_list(), f["arguments"].to_list())]
        f = f.with_columns(right=pl.Series(query, dtype=pl.String).eq(pl.Series(want))
                           .fill_null(False))
        for arm, g in sorted(f.group_by("arm"), key=lambda x: x[0][0]):
            hit = g.filter(pl.col("right"))
            after = f"{hit['success'].mean():.3f}" if hit.height else "-"
            print(f"| {split} | {arm[0]} | {g.height} | {g['right'].mean():.3f} | {after} |")
    exp = pl.read_parquet(ROOT / "pipelines/early_experience/data/experience.parquet")
    alts = exp.filter(pl.col("j") > 0)
    held = [f"search[{p}]" for p in shop.HELD_OUT]
    n = alts.filter(pl.col("call").is_in(held)).height
    searches = alts.filter(pl.col("call").str.starts_with("search[")).height
    print(f"\nexperience: {n} of {alts.height} alternatives ({searches} searches) search a "
          f"held-out pair ({', '.join(shop.HELD_OUT)})")


if __name__ == "__main__":
    main()
